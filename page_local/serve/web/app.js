// page-local's chat page. Talks to this server's own /v1/chat/completions (streamed: fetch + a
// ReadableStream reader over the SSE body), keeps conversations in localStorage, and beside each answer
// shows what the cache holds: the server's `page_local` extension (docs/serve.md, "The web UI").
// Model text only ever reaches the DOM as text nodes (markdown.js builds nodes with textContent).

import { render } from "./markdown.js";

const STORE = "page-local/chats";
const CURRENT = "page-local/current";
const KEY = "page-local/key";
const FORMAT = "page-local-chats";
const DEFAULTS = { system: "", temperature: 0.7, maxTokens: 512 };
const STATE_WORDS = {
  held: "held in the cache: the answer attends to it",
  parked: "set aside: still in memory but out of the attention; it comes back before your next message is read",
  speed: "deleted for speed (the gate's budget)",
  room: "deleted to make room (the context was full)",
  evicted: "deleted (why is not known: the conversation was restored from a snapshot)",
};
// the legend's words for each state (the class names stay the server's)
const STATE_LABELS = { held: "held", parked: "set aside", speed: "deleted (speed)", room: "deleted (room)", evicted: "deleted" };

const $ = (id) => document.getElementById(id);
const el = (tag, className, text) => {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined && text !== null) node.textContent = String(text);
  return node;
};

let chats = [];
let currentId = null;
let running = null; // {controller, chatId} while an answer streams
let server = null; // /v1/models' card: name, n_ctx, the server's defaults
let options = { gates: [], evictors: [], on_full: [] };

// --- storage ---------------------------------------------------------------------------------
function newId() {
  return `${Date.now().toString(36)}-${Math.random().toString(36).slice(2, 8)}`;
}

function blankChat() {
  return {
    id: newId(), title: "New chat", created: Date.now(), ...DEFAULTS,
    settings: { gate: "", budget: "", evictor: "", on_full: "" }, messages: [],
  };
}

// A chat read from storage or an imported file, with only the fields the page knows, checked.
function cleanChat(c) {
  if (!c || typeof c !== "object" || !Array.isArray(c.messages)) throw new Error("a chat has no messages list");
  const messages = c.messages.map((m, i) => {
    if (!m || !["user", "assistant"].includes(m.role) || typeof m.content !== "string") {
      throw new Error(`message ${i} of "${c.title}" needs role user or assistant and text content`);
    }
    const out = { role: m.role, content: m.content };
    if (m.meta && typeof m.meta === "object") out.meta = m.meta;
    return out;
  });
  const s = c.settings && typeof c.settings === "object" ? c.settings : {};
  const num = (v, d) => (typeof v === "number" && Number.isFinite(v) ? v : d);
  return {
    id: typeof c.id === "string" ? c.id : newId(),
    title: typeof c.title === "string" && c.title.trim() ? c.title.slice(0, 200) : "Untitled",
    created: num(c.created, Date.now()),
    system: typeof c.system === "string" ? c.system : "",
    temperature: num(c.temperature, DEFAULTS.temperature),
    maxTokens: num(c.maxTokens, DEFAULTS.maxTokens),
    settings: {
      gate: String(s.gate ?? ""), budget: String(s.budget ?? ""), evictor: String(s.evictor ?? ""),
      on_full: String(s.on_full ?? ""),
    },
    messages,
  };
}

function load() {
  try {
    const raw = JSON.parse(localStorage.getItem(STORE) || "[]");
    chats = Array.isArray(raw) ? raw.map(cleanChat) : [];
  } catch (e) {
    chats = [];
    notice(`The stored chats could not be read (${e.message}); starting afresh.`);
  }
  currentId = localStorage.getItem(CURRENT);
  if (!chats.some((c) => c.id === currentId)) currentId = chats[0]?.id ?? null;
}

function save() {
  try {
    localStorage.setItem(STORE, JSON.stringify(chats));
    if (currentId) localStorage.setItem(CURRENT, currentId);
  } catch (e) {
    notice(`The chats could not be saved in this browser (${e.message}); export them to keep them.`);
  }
}

const current = () => chats.find((c) => c.id === currentId) ?? null;

function notice(text) {
  $("status").textContent = text;
}

// --- the API ---------------------------------------------------------------------------------
function askKey(why) {
  const dialog = $("key-dialog");
  $("key-why").textContent = why;
  $("key-input").value = "";
  dialog.showModal();
  return new Promise((resolve) => {
    const done = (key) => {
      dialog.close();
      $("key-save").onclick = $("key-cancel").onclick = $("key-input").onkeydown = null;
      resolve(key);
    };
    $("key-save").onclick = () => done($("key-input").value.trim() || null);
    $("key-cancel").onclick = () => done(null);
    $("key-input").onkeydown = (e) => {
      if (e.key === "Enter") done($("key-input").value.trim() || null);
    };
  });
}

// fetch with the stored key; a 401 asks for the key (once per refusal) and tries again with it.
async function api(path, init = {}) {
  for (;;) {
    const key = localStorage.getItem(KEY);
    const headers = { ...(init.headers || {}) };
    if (key) headers.Authorization = `Bearer ${key}`;
    const res = await fetch(path, { ...init, headers });
    if (res.status !== 401) return res;
    const entered = await askKey(key ? "The server refused the stored API key. Enter the right one:"
      : "This server needs an API key (page-local serve --api-key). It is kept in this browser:");
    if (!entered) return res;
    localStorage.setItem(KEY, entered);
  }
}

async function errorText(res) {
  try {
    const body = await res.json();
    return body?.error?.message || `HTTP ${res.status}`;
  } catch {
    return `HTTP ${res.status}`;
  }
}

async function loadServer() {
  try {
    const [cfg, models] = await Promise.all([fetch("/ui/config.json"), api("/v1/models")]);
    if (cfg.ok) options = await cfg.json();
    if (models.ok) server = (await models.json()).data?.[0] ?? null;
    else notice(await errorText(models));
  } catch (e) {
    notice(`The server did not answer: ${e.message}`);
  }
  const pl = server?.page_local;
  $("server-name").textContent = server ? `${server.id} · n_ctx ${pl?.n_ctx} · gate ${pl?.gate} · budget ${pl?.budget}${pl?.park && pl?.budget != 1 ? " set aside" : ""} · ${pl?.evictor}` : "";
  fillOptions();
  showSettings();
}

// --- one answer ------------------------------------------------------------------------------
function requestMessages(chat, upto, system) {
  const out = system ? [{ role: "system", content: system }] : [];
  return out.concat(chat.messages.slice(0, upto).map((m) => ({ role: m.role, content: m.content })));
}

function overrides(chat) {
  const s = chat.settings;
  const o = { cache_map: true }; // what the cache holds, for the view beside the answer
  if (s.gate) o.gate = s.gate;
  if (s.evictor) o.evictor = s.evictor;
  if (s.on_full) o.on_full = s.on_full;
  if (String(s.budget).trim()) {
    const b = Number(s.budget);
    if (!Number.isFinite(b) || b <= 0) throw new Error(`budget must be a ratio like 0.25 or a count like 1024, not "${s.budget}"`);
    o.budget = b;
  }
  return o;
}

async function send(chat) {
  let page_local;
  try {
    page_local = overrides(chat);
  } catch (e) {
    notice(e.message);
    return;
  }
  const sent = chat.messages.length;
  const system = chat.system.trim() ? chat.system : null;
  const answer = { role: "assistant", content: "", meta: { sent, system, started: Date.now() } };
  chat.messages.push(answer);
  renderMessages();
  const node = $("messages").lastElementChild;
  const controller = new AbortController();
  running = { controller, chatId: chat.id };
  setRunning(true);
  const body = {
    messages: requestMessages(chat, sent, system), stream: true, temperature: chat.temperature,
    max_tokens: chat.maxTokens,
  };
  body.page_local = page_local;
  const t0 = performance.now();
  try {
    const res = await api("/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
      signal: controller.signal,
    });
    if (!res.ok) throw new Error(await errorText(res));
    await readStream(res, answer, node, t0);
  } catch (e) {
    if (e.name === "AbortError") answer.meta.stopped = true;
    else answer.meta.error = e.message;
  } finally {
    answer.meta.elapsed_ms = performance.now() - t0;
    running = null;
    setRunning(false);
    save();
    renderMessages();
  }
}

async function readStream(res, answer, node, t0) {
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  let painted = false;
  const paint = () => {
    if (painted) return;
    painted = true;
    requestAnimationFrame(() => {
      painted = false;
      fillBody(node, answer);
    });
  };
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += decoder.decode(value, { stream: true });
    const lines = buf.split(/\r?\n/);
    buf = lines.pop();
    for (const line of lines) {
      if (!line.startsWith("data:")) continue;
      const data = line.slice(5).trim();
      if (data === "[DONE]") return;
      const obj = JSON.parse(data);
      if (obj.error) throw new Error(obj.error.message);
      const choice = obj.choices?.[0];
      const text = choice?.delta?.content;
      if (text) {
        if (answer.meta.ttft_ms === undefined) answer.meta.ttft_ms = performance.now() - t0;
        answer.content += text;
        paint();
      }
      if (choice?.finish_reason) answer.meta.finish = choice.finish_reason;
      if (obj.page_local) answer.meta.ext = obj.page_local;
    }
  }
}

function setRunning(on) {
  $("send").hidden = on;
  $("stop").hidden = !on;
  $("regenerate").disabled = on;
}

// --- drawing ---------------------------------------------------------------------------------
function renderList() {
  const list = $("chat-list");
  list.replaceChildren();
  for (const c of chats) {
    const item = el("li", c.id === currentId ? "active" : null);
    const b = el("button", "chat-item", c.title);
    b.type = "button";
    b.dataset.id = c.id;
    b.addEventListener("click", () => {
      currentId = c.id;
      save();
      renderAll();
    });
    item.append(b);
    list.append(item);
  }
}

function fillBody(node, m) {
  const body = node.querySelector(".body");
  body.replaceChildren(m.role === "assistant" ? render(m.content) : el("div", "plain", m.content));
}

function renderMessages() {
  const chat = current();
  const box = $("messages");
  box.replaceChildren();
  $("chat-title").textContent = chat ? chat.title : "";
  if (!chat) return;
  if (!chat.messages.length) {
    box.append(el("p", "empty", "Ask something, or paste a document longer than the context and ask about it: " +
      "beside each answer you will see which parts of the conversation the cache still holds."));
  }
  chat.messages.forEach((m, i) => {
    const node = el("div", `msg ${m.role}`);
    node.dataset.index = i;
    node.append(el("div", "role", m.role === "user" ? "You" : "page-local"), el("div", "body"));
    fillBody(node, m);
    if (m.role === "assistant" && m.meta) node.append(metaView(chat, m));
    box.append(node);
  });
  box.scrollTop = box.scrollHeight;
}

function fmt(v, digits = 1) {
  return typeof v === "number" && Number.isFinite(v) ? v.toFixed(digits) : "–";
}

function metaView(chat, m) {
  const meta = m.meta;
  const box = el("div", "meta");
  if (meta.error) box.append(el("p", "error", meta.error));
  if (meta.stopped) box.append(el("p", "stopped", "stopped"));
  const ext = meta.ext;
  if (!ext) return box;
  const d = ext.decision ?? {};
  const stats = el("div", "stats");
  const stat = (label, value, cls) => {
    const s = el("span", `stat ${cls || ""}`);
    s.append(el("b", null, label), document.createTextNode(` ${value}`));
    stats.append(s);
  };
  stat("D", d.D === null || d.D === undefined ? "–" : d.D.toFixed(4), "stat-d");
  stat("gate", d.open ? "open" : "closed", "stat-gate");
  stat("tok/s", fmt(ext.answer?.tokens_per_s), "stat-tps");
  stat("TTFT", meta.ttft_ms === undefined ? "–" : `${(meta.ttft_ms / 1000).toFixed(2)} s`, "stat-ttft");
  if (ext.cache) stat("reused", `${ext.cache.reused_tokens} tokens`, "stat-reused");
  if (ext.cache?.disk_tokens) {  // restored from the disk cache of prompt prefixes (engine/prefixes.py)
    stat("from disk", `${ext.cache.disk_tokens} tokens in ${(ext.cache.disk_ms / 1000).toFixed(1)} s`, "stat-disk");
  }
  box.append(stats);
  if (d.verdict) box.append(el("p", "verdict", d.verdict));
  // narrate's summary begins with the verdict: the rest of it (the answer's tokens, speed, how it ended)
  const rest = d.summary && d.verdict && d.summary.startsWith(d.verdict)
    ? d.summary.slice(d.verdict.length).replace(/^[;,]\s*/, "") : d.summary;
  if (rest) box.append(el("p", "summary", rest));
  const cm = ext.cache_map;
  if (cm) {
    const bar = el("div", "cells");
    const fill = el("div", "cells-fill");
    fill.style.width = `${Math.min(100, (100 * cm.cells) / cm.n_ctx)}%`;
    const track = el("div", "cells-track");
    track.append(fill);
    const aside = cm.parked_cells ? ` · ${cm.parked_cells} set aside` : "";
    bar.append(track, el("span", "cells-label", `${cm.cells} / ${cm.n_ctx} cells held${aside} · ${cm.tokens} tokens in the conversation`));
    box.append(bar);
    const view = el("details", "cache-view");
    view.append(el("summary", null, "What the cache holds"));
    view.addEventListener("toggle", () => {
      if (view.open && view.children.length === 1) view.append(cacheView(chat, m, cm));
    }, { once: false });
    box.append(view);
  }
  if (Array.isArray(d.agreement) && d.agreement.length) box.append(whyView(d));
  return box;
}

// The conversation of that request as it was sent, its answer last, with the server's spans marked.
function cacheView(chat, m, cm) {
  const at = chat.messages.indexOf(m);
  const sent = requestMessages(chat, m.meta.sent ?? at, m.meta.system);
  sent.push({ role: "assistant", content: m.content });
  const wrap = el("div", "cache-map");
  const legend = el("div", "legend");
  for (const [state, words] of Object.entries(STATE_WORDS)) {
    if ((state === "evicted" || state === "parked") && !cm.spans.some((s) => s.state === state)) continue;
    const k = el("span", `mark s-${state}`, STATE_LABELS[state] ?? state);
    k.title = words;
    legend.append(k);
  }
  wrap.append(legend);
  if (!cm.aligned) wrap.append(el("p", "note", "The server could not place the prompt's tokens in its text; only the answer is marked."));
  const byMsg = new Map();
  for (const s of cm.spans) {
    if (!byMsg.has(s.message)) byMsg.set(s.message, []);
    byMsg.get(s.message).push(s);
  }
  sent.forEach((msg, i) => {
    const block = el("div", `cm-msg cm-${msg.role}`);
    block.dataset.message = i;
    block.append(el("div", "cm-role", msg.role));
    const text = el("div", "cm-text");
    const chars = Array.from(msg.content); // offsets are code points
    let pos = 0;
    for (const s of (byMsg.get(i) ?? []).sort((a, b) => a.start - b.start)) {
      if (s.start > pos) text.append(document.createTextNode(chars.slice(pos, s.start).join("")));
      const span = el("span", `mark s-${s.state}`, chars.slice(s.start, s.end).join(""));
      span.dataset.message = i;
      span.dataset.start = s.start;
      span.dataset.end = s.end;
      span.dataset.state = s.state;
      span.title = STATE_WORDS[s.state] ?? s.state;
      text.append(span);
      pos = Math.max(pos, s.end);
    }
    if (pos < chars.length) text.append(document.createTextNode(chars.slice(pos).join("")));
    block.append(text);
    wrap.append(block);
  });
  return wrap;
}

// The probe's per-layer head agreement: what D was read from (the `inspect` plot's data).
function whyView(d) {
  const view = el("details", "why");
  view.append(el("summary", null, "Why: per-layer head agreement"));
  const rows = el("div", "agreement");
  d.agreement.forEach((a, layer) => {
    const row = el("div", "agree-row");
    const track = el("div", "agree-track");
    const fill = el("div", "agree-fill");
    fill.style.width = `${Math.max(0, Math.min(1, a)) * 100}%`;
    track.append(fill);
    row.append(el("span", "agree-layer", `L${layer}`), track, el("span", "agree-value", fmt(a, 3)));
    rows.append(row);
  });
  view.append(rows, el("p", "note", "D is the drop in the heads' agreement across layers; the gate opens when it is high enough (docs/design.md)."));
  return view;
}

function fillOptions() {
  const fill = (id, names, serverValue) => {
    const select = $(id);
    select.replaceChildren(el("option", null, `server default${serverValue !== undefined ? ` (${serverValue})` : ""}`));
    select.firstChild.value = "";
    for (const n of names) {
      const o = el("option", null, n);
      o.value = n;
      select.append(o);
    }
  };
  const pl = server?.page_local ?? {};
  fill("set-gate", options.gates, pl.gate);
  fill("set-evictor", options.evictors, pl.evictor);
  fill("set-on-full", options.on_full, undefined);
  $("set-budget").placeholder = pl.budget !== undefined ? `server default (${pl.budget})` : "server default";
}

function showSettings() {
  const chat = current();
  if (!chat) return;
  $("set-system").value = chat.system;
  $("set-temperature").value = chat.temperature;
  $("set-max-tokens").value = chat.maxTokens;
  $("set-gate").value = chat.settings.gate;
  $("set-budget").value = chat.settings.budget;
  $("set-evictor").value = chat.settings.evictor;
  $("set-on-full").value = chat.settings.on_full;
}

function renderAll() {
  renderList();
  renderMessages();
  showSettings();
}

// --- actions ---------------------------------------------------------------------------------
function ensureChat() {
  if (!current()) {
    const c = blankChat();
    chats.unshift(c);
    currentId = c.id;
  }
  return current();
}

function submit() {
  if (running) return;
  const text = $("input").value;
  if (!text.trim()) return;
  const chat = ensureChat();
  chat.messages.push({ role: "user", content: text });
  if (chat.title === "New chat") chat.title = text.trim().split("\n")[0].slice(0, 48);
  $("input").value = "";
  save();
  renderList();
  send(chat);
}

function regenerate() {
  const chat = current();
  if (running || !chat || !chat.messages.length) return;
  if (chat.messages.at(-1).role === "assistant") chat.messages.pop();
  if (!chat.messages.length || chat.messages.at(-1).role !== "user") return;
  send(chat);
}

function exportChats() {
  const blob = new Blob([JSON.stringify({ format: FORMAT, version: 1, chats }, null, 2)], { type: "application/json" });
  const a = el("a");
  a.href = URL.createObjectURL(blob);
  a.download = `page-local-chats-${new Date().toISOString().slice(0, 10)}.json`;
  a.click();
  setTimeout(() => URL.revokeObjectURL(a.href), 1000);
}

async function importChats(file) {
  try {
    const data = JSON.parse(await file.text());
    const list = Array.isArray(data) ? data : data?.chats;
    if (!Array.isArray(list)) throw new Error(`expected {"format": "${FORMAT}", "chats": [...]}`);
    const incoming = list.map(cleanChat);
    const ids = new Set(chats.map((c) => c.id));
    for (const c of incoming) if (ids.has(c.id)) c.id = newId();
    chats = incoming.concat(chats);
    currentId = incoming[0]?.id ?? currentId;
    save();
    renderAll();
    notice(`Imported ${incoming.length} chat${incoming.length === 1 ? "" : "s"}.`);
  } catch (e) {
    notice(`That file could not be imported: ${e.message}`);
  }
}

function bind() {
  $("new-chat").addEventListener("click", () => {
    const c = blankChat();
    chats.unshift(c);
    currentId = c.id;
    save();
    renderAll();
    $("input").focus();
  });
  $("rename").addEventListener("click", () => {
    const chat = current();
    if (!chat) return;
    const name = prompt("Name this chat:", chat.title);
    if (name && name.trim()) {
      chat.title = name.trim().slice(0, 200);
      save();
      renderAll();
    }
  });
  $("delete").addEventListener("click", () => {
    const chat = current();
    if (!chat || running?.chatId === chat.id) return;
    if (!confirm(`Delete "${chat.title}"?`)) return;
    chats = chats.filter((c) => c !== chat);
    currentId = chats[0]?.id ?? null;
    save();
    renderAll();
  });
  $("export").addEventListener("click", exportChats);
  $("import").addEventListener("change", (e) => {
    if (e.target.files[0]) importChats(e.target.files[0]);
    e.target.value = "";
  });
  $("forget-key").addEventListener("click", () => {
    localStorage.removeItem(KEY);
    notice("The API key was removed from this browser.");
  });
  $("send").addEventListener("click", submit);
  $("stop").addEventListener("click", () => running?.controller.abort());
  $("regenerate").addEventListener("click", regenerate);
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      submit();
    }
  });
  $("toggle-settings").addEventListener("click", () => {
    $("settings").hidden = !$("settings").hidden;
  });
  const bindSetting = (id, apply) => $(id).addEventListener("change", (e) => {
    const chat = ensureChat();
    apply(chat, e.target.value);
    save();
  });
  bindSetting("set-system", (c, v) => (c.system = v));
  bindSetting("set-temperature", (c, v) => (c.temperature = Math.min(5, Math.max(0, Number(v) || 0))));
  bindSetting("set-max-tokens", (c, v) => (c.maxTokens = Math.max(1, Math.round(Number(v) || DEFAULTS.maxTokens))));
  bindSetting("set-gate", (c, v) => (c.settings.gate = v));
  bindSetting("set-budget", (c, v) => (c.settings.budget = v.trim()));
  bindSetting("set-evictor", (c, v) => (c.settings.evictor = v));
  bindSetting("set-on-full", (c, v) => (c.settings.on_full = v));
}

load();
bind();
renderAll();
loadServer();
document.body.dataset.ready = "1"; // for tests: the page's script ran
