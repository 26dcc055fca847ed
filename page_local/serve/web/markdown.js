// Markdown to DOM nodes, safely: every piece of the model's text becomes a text node (textContent), never
// HTML; a link keeps its URL only for http, https and mailto. What it reads: fenced code blocks (``` and
// ~~~, unclosed while an answer streams), headings, lists, block quotes, rules, paragraphs; inline code,
// bold, italic, links and bare URLs. Nested lists and tables are shown as their text.

const SAFE_PROTOCOLS = new Set(["http:", "https:", "mailto:"]);

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

export function safeUrl(url) {
  try {
    const u = new URL(url, window.location.href);
    return SAFE_PROTOCOLS.has(u.protocol) ? u.href : null;
  } catch {
    return null;
  }
}

const INLINE = new RegExp(
  [
    "(`+)([\\s\\S]*?[^`])\\1(?!`)", // 1, 2: code
    "\\*\\*(?=\\S)([\\s\\S]*?\\S)\\*\\*", // 3: bold
    "__(?=\\S)([\\s\\S]*?\\S)__", // 4: bold
    "\\*(?=[^\\s*])([^*]*?[^\\s*])\\*", // 5: italic
    "(?<![\\w])_(?=[^\\s_])([^_]*?[^\\s_])_(?![\\w])", // 6: italic
    "\\[([^\\]\\n]+)\\]\\(\\s*([^)\\s]+)\\s*\\)", // 7, 8: link
    "(https?:\\/\\/[^\\s<>()\\[\\]]*[^\\s<>()\\[\\].,;:!?'\"])", // 9: bare URL
  ].join("|"),
  "g",
);

export function inline(text, parent) {
  let last = 0;
  const re = new RegExp(INLINE.source, "g"); // its own: bold and links recurse into their text
  for (let m = re.exec(text); m !== null; m = re.exec(text)) {
    if (m.index > last) parent.append(document.createTextNode(text.slice(last, m.index)));
    if (m[2] !== undefined) {
      parent.append(el("code", null, m[2].replace(/^ (.*) $/s, "$1")));
    } else if (m[3] !== undefined || m[4] !== undefined) {
      const b = el("strong");
      inline(m[3] ?? m[4], b);
      parent.append(b);
    } else if (m[5] !== undefined || m[6] !== undefined) {
      const i = el("em");
      inline(m[5] ?? m[6], i);
      parent.append(i);
    } else if (m[7] !== undefined) {
      const href = safeUrl(m[8]);
      if (href) {
        const a = el("a");
        a.href = href;
        a.target = "_blank";
        a.rel = "noopener noreferrer";
        inline(m[7], a);
        parent.append(a);
      } else {
        parent.append(document.createTextNode(m[0])); // a javascript: or data: link stays text
      }
    } else if (m[9] !== undefined) {
      const a = el("a", null, m[9]);
      a.href = safeUrl(m[9]) ?? "#";
      a.target = "_blank";
      a.rel = "noopener noreferrer";
      parent.append(a);
    }
    last = re.lastIndex;
  }
  if (last < text.length) parent.append(document.createTextNode(text.slice(last)));
}

function codeBlock(lang, lines) {
  const wrap = el("div", "code-block");
  const bar = el("div", "code-bar");
  bar.append(el("span", "code-lang", lang || "text"));
  const copy = el("button", "code-copy", "copy");
  copy.type = "button";
  const code = el("code", lang && /^[\w+#.-]{1,32}$/.test(lang) ? `lang-${lang}` : null, lines.join("\n"));
  copy.addEventListener("click", () => {
    navigator.clipboard?.writeText(code.textContent).then(() => {
      copy.textContent = "copied";
      setTimeout(() => (copy.textContent = "copy"), 1200);
    });
  });
  bar.append(copy);
  const pre = el("pre");
  pre.append(code);
  wrap.append(bar, pre);
  return wrap;
}

function paragraph(lines) {
  const p = el("p");
  lines.forEach((line, k) => {
    if (k) p.append(el("br"));
    inline(line, p);
  });
  return p;
}

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^\s`]*)[^`]*$/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const RULE = /^ {0,3}([-*_])(\s*\1){2,}\s*$/;
const BULLET = /^\s*[-*+]\s+(.*)$/;
const ORDERED = /^\s*(\d{1,9})[.)]\s+(.*)$/;
const QUOTE = /^ {0,3}>\s?(.*)$/;

// The text as a DocumentFragment of safe nodes.
export function render(text) {
  const out = document.createDocumentFragment();
  const lines = String(text).replace(/\r\n?/g, "\n").split("\n");
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let m;
    if ((m = FENCE.exec(line))) {
      const fence = m[1];
      const body = [];
      i++;
      while (i < lines.length && !lines[i].trim().startsWith(fence)) body.push(lines[i++]);
      i++; // the closing fence (or the end of an answer still streaming)
      out.append(codeBlock(m[2], body));
    } else if ((m = HEADING.exec(line))) {
      const h = el(`h${Math.min(6, m[1].length + 2)}`, "md-heading");
      inline(m[2], h);
      out.append(h);
      i++;
    } else if (RULE.test(line)) {
      out.append(el("hr"));
      i++;
    } else if (QUOTE.test(line)) {
      const body = [];
      while (i < lines.length && (m = QUOTE.exec(lines[i]))) {
        body.push(m[1]);
        i++;
      }
      const q = el("blockquote");
      q.append(render(body.join("\n")));
      out.append(q);
    } else if (BULLET.test(line) || ORDERED.test(line)) {
      const ordered = !BULLET.test(line);
      const re = ordered ? ORDERED : BULLET;
      const list = el(ordered ? "ol" : "ul");
      if (ordered) list.start = Number(ORDERED.exec(line)[1]);
      while (i < lines.length && (m = re.exec(lines[i]))) {
        const item = el("li");
        inline(ordered ? m[2] : m[1], item);
        i++;
        while (i < lines.length && /^\s{2,}\S/.test(lines[i]) && !BULLET.test(lines[i]) && !ORDERED.test(lines[i])) {
          item.append(el("br"));
          inline(lines[i++].trim(), item);
        }
        list.append(item);
      }
      out.append(list);
    } else if (!line.trim()) {
      i++;
    } else {
      const body = [];
      while (
        i < lines.length && lines[i].trim() && !FENCE.test(lines[i]) && !HEADING.test(lines[i]) &&
        !QUOTE.test(lines[i]) && !BULLET.test(lines[i]) && !ORDERED.test(lines[i]) && !RULE.test(lines[i])
      ) {
        body.push(lines[i++]);
      }
      out.append(paragraph(body));
    }
  }
  return out;
}
