"""The web UI (GET /, page_local/serve/web/) and the `cache_map` it draws (page_local/serve/held.py).

  1. held.py's mapping from tokens to characters, on pieces written here (no model);
  2. the page and its files are served without a key, with a Content-Security-Policy; the API is not;
  3. in headless Chromium (Debian's chromium + chromium-driver, selenium: `make browser`) against a live
     server on 127.0.0.1 with an API key: the page asks for the key once and keeps it; a message streams its
     answer; a document longer than the context (n_ctx 512) shows held and evicted marks that are exactly
     the server's spans for that conversation, on the document's own characters, and the engine's count
     of held prompt tokens; stop and regenerate; a reload finds the conversation; an answer holding
     <script> and <img onerror> is shown as text and runs nothing.

Screenshots go to tests/output/ (ignored by git); PAGE_LOCAL_DOCS_SCREENSHOT=1 also writes docs/web-ui.png
(the README's). One server and one browser for the module; answers of a few tokens.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from page_local.serve import held
from tests.test_serve import stop_server

OUT = Path(__file__).parent / "output"
DOCS_PNG = Path(__file__).parent.parent / "docs" / "web-ui.png"
KEY = "web-ui-test-key"
N_CTX = 512
WORDS = ["red", "blue", "green", "amber", "violet"]
# about 700 tokens of SmolLM2: longer than the context, so reading it makes room
DOCUMENT = " ".join(f"Shelf {i}: the {WORDS[i % 5]} jar number {i} holds {i * 7 + 3} beads." for i in range(44))
QUESTION = "How many beads does jar 12 hold?"
SYSTEM = ("You are a careful assistant. You answer in plain words, keep to the point, and never make up facts "
          "you do not know. When you are asked to count, you count.")


# --- 1. held.py, without a model ----------------------------------------------------------------

def test_token_spans_cover_the_text_in_characters():
    text = "<|s|>héllo wörld"
    pieces = [b"BOS", "<|s|>".encode(), b"h", "\u00e9".encode()[:1], "\u00e9".encode()[1:] + b"llo", " w".encode(),
              "\u00f6rld".encode()]
    spans, aligned = held.token_spans(pieces, text)
    assert aligned
    assert spans[0] == (0, 0)  # a BOS the text does not show: empty at the cursor
    assert [text[a:b] for a, b in spans[1:]] == ["<|s|>", "h", "\u00e9", "llo", " w", "\u00f6rld"]


def test_a_leading_space_the_text_lacks_is_matched_without_it():
    spans, aligned = held.token_spans([b" Hello", b" there"], "Hello there")
    assert aligned and spans == [(0, 5), (5, 11)]
    _, aligned = held.token_spans([b"Hello", b" you"], "Hello there")
    assert not aligned


def test_cache_map_places_tokens_in_messages_and_the_answer():
    # rendered: "[S]sys[U]doc one[A]" with the answer "ok!"
    text = "[S]sys[U]doc one[A]"
    pieces = [b"[S]", b"sys", b"[U]", b"doc", b" one", b"[A]"]
    answer = [b"ok", b"!"]
    mask = np.array([1, 1, 1, 0, 1, 1, 1, 0], dtype=bool)
    room = np.array([0, 0, 0, 1, 0, 0, 0, 0], dtype=bool)
    cm = held.cache_map(mask, room, pieces, text, ["sys", "doc one"], answer, "ok!", 16)
    assert cm["cells"] == 6 and cm["tokens"] == 8 and cm["prompt_tokens"] == 6 and cm["aligned"]
    assert cm["held"] == [[0, 3], [4, 7]]
    assert cm["evicted"] == [{"from": 3, "to": 4, "why": "room"}, {"from": 7, "to": 8, "why": "speed"}]
    assert cm["spans"] == [
        {"message": 0, "start": 0, "end": 3, "state": "held"},
        {"message": 1, "start": 0, "end": 3, "state": "room"},
        {"message": 1, "start": 3, "end": 7, "state": "held"},
        {"message": 2, "start": 0, "end": 2, "state": "held"},
        {"message": 2, "start": 2, "end": 3, "state": "speed"},
    ]
    unknown = held.cache_map(mask, None, pieces, text, ["sys", "doc one"], answer, "ok!", 16)
    assert {e["why"] for e in unknown["evicted"]} == {"evicted"}
    with pytest.raises(ValueError, match="covers 8 tokens"):
        held.cache_map(mask, room, pieces, text, ["sys"], answer[:1], "ok", 16)


def test_parked_tokens_are_their_own_class():
    """Parked tokens (engine/parking.py: in memory, out of the attention) are neither held nor deleted."""
    text = "[S]sys[U]doc one[A]"
    pieces = [b"[S]", b"sys", b"[U]", b"doc", b" one", b"[A]"]
    mask = np.array([1, 1, 1, 0, 0, 1, 1, 0], dtype=bool)
    room = np.array([0, 0, 0, 1, 0, 0, 0, 0], dtype=bool)
    parked = np.array([0, 0, 0, 0, 1, 0, 0, 0], dtype=bool)
    cm = held.cache_map(mask, room, pieces, text, ["sys", "doc one"], [b"ok", b"!"], "ok!", 16, parked=parked)
    assert cm["parked_cells"] == 1 and cm["parked"] == [[4, 5]] and cm["cells"] == 5
    assert cm["evicted"] == [{"from": 3, "to": 4, "why": "room"}, {"from": 7, "to": 8, "why": "speed"}]
    assert {"message": 1, "start": 3, "end": 7, "state": "parked"} in cm["spans"]
    assert held.states(mask, room, parked)[3:5] == ["room", "parked"]


def test_a_message_the_template_changed_is_not_marked():
    assert held.message_ranges("[U]abc[U]x y", ["abc", "zzz", "x y"]) == [(3, 6), None, (9, 12)]


# --- 2 and 3: a live server -------------------------------------------------------------------------

httpx = pytest.importorskip("httpx", reason="the test extra (httpx) is not installed")
pytest.importorskip("starlette", reason="the [serve] extra is not installed")
pytest.importorskip("uvicorn", reason="the [serve] extra is not installed")
pytest.importorskip("sse_starlette", reason="the [serve] extra is not installed")


@pytest.fixture(scope="module")
def server(smollm2_path):
    # --no-park: a chat's own budget evicts for good at once (the parking server below sets tokens aside)
    yield from _serve(smollm2_path, "--n-ctx", str(N_CTX), "--gate", "never", "--no-park")


def _serve(smollm2_path, *args: str):
    from page_local.serve.bench import free_port

    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("PAGE_LOCAL_API_KEY", "PAGE_LOCAL_MODEL")}
    proc = subprocess.Popen([sys.executable, "-m", "page_local.cli", "serve", "--port", str(port), "--model",
                             str(smollm2_path), "--threads", "2", *args, "--api-key", KEY], env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        t_end = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited {proc.returncode}: {proc.stdout.read()}")
            try:
                if httpx.get(base + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > t_end:
                raise RuntimeError("the server did not become ready")
            time.sleep(0.05)
        yield base
    finally:
        stop_server(proc)


def raw_get(base: str, path: str) -> tuple[int, bytes]:
    """GET `path` exactly as written (no client normalises it): (status, body)."""
    import socket

    port = int(base.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while part := s.recv(65536):
            data += part
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def test_the_page_is_served_without_a_key_the_api_is_not(server):
    r = httpx.get(server + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "default-src 'none'" in csp and "unsafe-inline" not in csp
    assert '<script type="module" src="/ui/app.js">' in r.text
    for name, kind in (("app.js", "text/javascript"), ("markdown.js", "text/javascript"), ("style.css", "text/css")):
        r = httpx.get(f"{server}/ui/{name}")
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind), name
    cfg = httpx.get(server + "/ui/config.json").json()
    assert "verify" in cfg["gates"] and "snapkv" in cfg["evictors"] and cfg["on_full"] == ["evict", "refuse"]
    for path in ("/ui/../backend.py", "/ui/..%2fbackend.py", "/ui/%2e%2e%2fweb.py", "/ui/%2e%2e", "/ui/..%5cweb.py"):
        status, body = raw_get(server, path)  # as sent: httpx would remove the ".." before sending
        assert status in (401, 404) and b"import" not in body, path  # no file outside the page's own
    assert httpx.get(server + "/ui/nothing.js").status_code == 404
    assert httpx.get(server + "/v1/models").status_code == 401
    assert httpx.post(server + "/", json={}).status_code in (401, 405)  # only GET is open


def test_cache_map_is_sent_when_asked_for(server):
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}
    plain = httpx.post(server + "/v1/chat/completions", json=body, headers=auth, timeout=60).json()
    assert "cache_map" not in plain["page_local"]
    asked = httpx.post(server + "/v1/chat/completions", json=body | {"page_local": {"cache_map": True}},
                       headers=auth, timeout=60).json()
    cm = asked["page_local"]["cache_map"]
    assert cm["tokens"] == asked["usage"]["prompt_tokens"] + asked["usage"]["completion_tokens"]
    assert cm["spans"][0] == {"message": 0, "start": 0, "end": 2, "state": "held"}  # "Hi", all held
    r = httpx.post(server + "/v1/chat/completions", json=body | {"page_local": {"cache_map": "yes"}}, headers=auth)
    assert r.status_code == 400 and r.json()["error"]["param"] == "page_local.cache_map"


def test_a_parking_server_marks_set_aside_tokens_and_brings_them_back(smollm2_path):
    """serve --park: the speed budget parks (gate always, from the first cell on); the response's cache_map marks
    the parked tokens as their own class, and the next message of the conversation gets them back."""
    gen = _serve(smollm2_path, "--n-ctx", "2048", "--park", "--park-from", "0", "--budget", "0.25", "--gate",
                 "always")
    base = next(gen)
    try:
        auth = {"Authorization": f"Bearer {KEY}"}
        msgs = [{"role": "user", "content": DOCUMENT + "\n" + QUESTION}]
        first = httpx.post(base + "/v1/chat/completions", headers=auth, timeout=120,
                           json={"messages": msgs, "max_tokens": 8, "temperature": 0,
                                 "page_local": {"cache_map": True}}).json()
        cm = first["page_local"]["cache_map"]
        assert cm["parked_cells"] > cm["cells"] > 0 and cm["parked"]
        assert any(sp["state"] == "parked" for sp in cm["spans"]) and not cm["evicted"]  # set aside, none deleted
        assert "set aside" in first["page_local"]["decision"]["summary"]
        msgs += [first["choices"][0]["message"], {"role": "user", "content": "And jar 13?"}]
        second = httpx.post(base + "/v1/chat/completions", headers=auth, timeout=120,
                            json={"messages": msgs, "max_tokens": 8, "temperature": 0}).json()
        assert f"{cm['parked_cells']} set-aside tokens back for this message" in second["page_local"]["decision"]["summary"]
    finally:
        gen.close()


# --- the browser ----------------------------------------------------------------------------------

def _browser_missing() -> str | None:
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (make browser)"
    for exe in ("chromium", "chromedriver"):
        if shutil.which(exe) is None:
            return f"{exe} is not installed (make browser: Debian's chromium and chromium-driver)"
    return None


@pytest.fixture(scope="module")
def browser(server):
    why = _browser_missing()
    if why:
        pytest.skip(why)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1360,900", "--no-first-run", "--disable-extensions", "--lang=en-US"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(options=opts, service=Service(shutil.which("chromedriver")))
    driver.set_page_load_timeout(30)
    OUT.mkdir(exist_ok=True)
    try:
        yield driver
    finally:
        driver.quit()


def wait(driver, cond, timeout: float = 60.0, what: str = ""):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(cond, message=what)


def by_id(driver, name):
    from selenium.webdriver.common.by import By

    return driver.find_element(By.ID, name)


def chats(driver) -> list[dict]:
    return json.loads(driver.execute_script("return localStorage.getItem('page-local/chats') || '[]'"))


def open_page(driver, server, key: str | None = None):
    """Load the page (with `key` already in the browser's storage, as a visit after the first finds it)."""
    driver.get(server + "/ui/config.json")  # the origin's storage, before the page runs
    driver.execute_script("localStorage.removeItem('page-local/key');" if key is None else
                          "localStorage.setItem('page-local/key', arguments[0]);", key)
    driver.get(server + "/")
    wait(driver, lambda d: d.execute_script("return document.body.dataset.ready") == "1", 15, "the page's script")


def set_chat(driver, **fields):
    """Fill the chat's settings (set-max-tokens=..., set-temperature=...) as a user does."""
    if not by_id(driver, "settings").is_displayed():
        by_id(driver, "toggle-settings").click()
    from selenium.webdriver.support.ui import Select

    for name, value in fields.items():
        box = by_id(driver, name.replace("_", "-"))
        if box.tag_name == "select":
            Select(box).select_by_value(str(value))
            continue
        box.clear()
        box.send_keys(str(value), "\t")  # the change event saves it in the chat
    by_id(driver, "toggle-settings").click()


def new_chat(driver, max_tokens: int):
    by_id(driver, "new-chat").click()
    set_chat(driver, set_max_tokens=max_tokens, set_temperature=0)  # greedy: the same answer every run


def say(driver, text: str):
    from selenium.webdriver.common.keys import Keys

    box = by_id(driver, "input")
    # a long text is set as the value (send_keys types it key by key), then Enter sends it
    driver.execute_script("arguments[0].value = arguments[1];", box, text)
    box.send_keys(Keys.END, Keys.ENTER)


def last_answer_done(driver) -> bool:
    return driver.execute_script(
        "const m = document.querySelector('#messages .msg.assistant:last-child');"
        "return !!m && !!m.querySelector('.meta') && document.getElementById('stop').hidden;")


def test_the_page_asks_for_the_key_once_and_streams_an_answer(server, browser):
    d = browser
    open_page(d, server)
    wait(d, lambda d: by_id(d, "key-dialog").is_displayed(), 15, "the key dialog after /v1/models said 401")
    by_id(d, "key-input").send_keys(KEY)
    by_id(d, "key-save").click()
    wait(d, lambda d: "n_ctx 512" in by_id(d, "server-name").text, 15, "the model card, fetched with the key")
    assert d.execute_script("return localStorage.getItem('page-local/key')") == KEY
    new_chat(d, 24)
    say(d, "Say hello in one short sentence.")
    # the answer streams: text appears while the Stop button is shown
    wait(d, lambda d: d.execute_script(
        "const b = document.querySelector('#messages .msg.assistant:last-child .body');"
        "return !!b && b.textContent.length > 0 && !document.getElementById('stop').hidden;"), 60,
        "streamed text while the answer runs")
    wait(d, last_answer_done, 60, "the end of the answer and its page_local extension")
    meta = chats(d)[0]["messages"][-1]["meta"]
    assert not by_id(d, "key-dialog").is_displayed()  # asked once
    assert meta["ext"]["decision"]["summary"] and meta["ttft_ms"] > 0 and meta["finish"] in ("stop", "length")
    stats = d.find_element("css selector", "#messages .msg.assistant:last-child .stats").text
    assert "tok/s" in stats and "TTFT" in stats and "D" in stats
    d.save_screenshot(str(OUT / "web-ui-first-answer.png"))
    # a reload finds the conversation, and the key: not asked again
    before = chats(d)
    d.refresh()
    wait(d, lambda d: d.execute_script("return document.body.dataset.ready") == "1", 15)
    assert [b.text for b in d.find_elements("css selector", "#chat-list .chat-item")] == [c["title"] for c in before]
    shown = d.find_elements("css selector", "#messages .msg")
    assert [e.get_attribute("class") for e in shown] == ["msg user", "msg assistant"]
    assert shown[1].find_element("css selector", ".body").text.strip() == before[0]["messages"][1]["content"].strip()
    time.sleep(0.5)
    assert not by_id(d, "key-dialog").is_displayed()


def test_marks_after_a_document_longer_than_the_context_agree_with_the_server(server, browser):
    d = browser
    open_page(d, server, key=KEY)
    new_chat(d, 16)
    say(d, DOCUMENT + "\n\n" + QUESTION)
    wait(d, last_answer_done, 80, "the answer to the long document")
    chat = chats(d)[0]
    answer = chat["messages"][-1]
    cm = answer["meta"]["ext"]["cache_map"]
    dec = answer["meta"]["ext"]["decision"]
    assert cm["n_ctx"] == N_CTX and cm["cells"] <= N_CTX < cm["prompt_tokens"]  # longer than the context
    assert cm["aligned"] and all(cm["placed"])
    # the engine's own counts: the cells held, and the prompt tokens held after the prefill
    assert sum(b - a for a, b in cm["held"]) == cm["cells"]
    # (the decision counts the tokens this request prefilled: those after the ones reused from the cache)
    lo, hi = answer["meta"]["ext"]["cache"]["reused_tokens"], cm["prompt_tokens"]
    held_prompt = sum(max(0, min(b, hi) - max(a, lo)) for a, b in cm["held"])
    assert dec["prompt_tokens"] == hi - lo and held_prompt == dec["prompt_held"], (held_prompt, dec)
    assert dec["room_evicted"] > 0 and {e["why"] for e in cm["evicted"]} == {"room"}  # gate never: no speed
    assert sum(e["to"] - e["from"] for e in cm["evicted"]) == cm["tokens"] - cm["cells"]

    from selenium.webdriver.common.by import By

    last = d.find_element(By.CSS_SELECTOR, "#messages .msg.assistant:last-child")
    last.find_element(By.CSS_SELECTOR, "details.cache-view summary").click()
    marks = wait(d, lambda d: last.find_elements(By.CSS_SELECTOR, ".cache-map .mark[data-state]"), 10, "the marks")
    page = d.execute_script(
        "return Array.from(arguments[0].querySelectorAll('.cache-map .mark[data-state]')).map(s => "
        "({message: +s.dataset.message, start: +s.dataset.start, end: +s.dataset.end, state: s.dataset.state, "
        "text: s.textContent}))", last)
    assert len(page) == len(marks)
    assert [{k: s[k] for k in ("message", "start", "end", "state")} for s in page] == cm["spans"]
    # each mark holds exactly the characters the server named, of the message the server named
    sent = [m["content"] for m in chat["messages"]]  # no system prompt in this chat: message i is sent[i]
    for s in page:
        assert s["text"] == sent[s["message"]][s["start"]:s["end"]]
    states = {s["state"] for s in page if s["message"] == 0}
    assert states == {"held", "room"}  # the document: parts held, parts evicted to make room
    doc_marked = sum(s["end"] - s["start"] for s in page if s["message"] == 0)
    assert doc_marked == len(sent[0])  # every character of the document is marked, once
    d.execute_script("arguments[0].scrollIntoView()", last)
    d.save_screenshot(str(OUT / "web-ui-cache-view.png"))
    if os.environ.get("PAGE_LOCAL_DOCS_SCREENSHOT") == "1":
        d.save_screenshot(str(DOCS_PNG))


def test_stop_and_regenerate(server, browser):
    d = browser
    open_page(d, server, key=KEY)
    new_chat(d, 400)
    say(d, "Count from 1 to 300, separated by commas.")
    wait(d, lambda d: d.execute_script(
        "const b = document.querySelector('#messages .msg.assistant:last-child .body');"
        "return !!b && b.textContent.length > 20;"), 60, "some of the answer")
    by_id(d, "stop").click()  # (greedy, this answer runs to max_tokens: 400 tokens, several seconds)
    wait(d, last_answer_done, 30, "the stopped answer")
    stopped = chats(d)[0]["messages"][-1]
    assert stopped["meta"].get("stopped") and 0 < len(stopped["content"]) < 1000
    # the chat's own settings: a system prompt, and page_local overrides that evict for speed (StreamingLLM
    # keeps the sinks and the newest tokens: the middle, the system prompt, goes)
    set_chat(d, set_system=SYSTEM, set_max_tokens=8, set_gate="always", set_budget="0.25",
             set_evictor="streamingllm")
    by_id(d, "regenerate").click()  # the server is free again at once: a new answer replaces the stopped one
    wait(d, lambda d: chats(d)[0]["messages"][-1]["meta"].get("ext") is not None, 60, "the regenerated answer")
    msgs = chats(d)[0]["messages"]
    assert [m["role"] for m in msgs] == ["user", "assistant"] and not msgs[-1]["meta"].get("stopped")
    ext = msgs[-1]["meta"]["ext"]
    assert ext["answer"]["tokens"] <= 8
    assert ext["settings"]["gate"] == "always" and ext["settings"]["budget"] == 0.25
    assert ext["settings"]["evictor"] == "streamingllm" and ext["decision"]["evicted"]
    assert {e["why"] for e in ext["cache_map"]["evicted"]} == {"speed"}
    from selenium.webdriver.common.by import By

    last = d.find_element(By.CSS_SELECTOR, "#messages .msg.assistant:last-child")
    last.find_element(By.CSS_SELECTOR, "details.cache-view summary").click()
    wait(d, lambda d: last.find_elements(By.CSS_SELECTOR, ".cache-map .mark.s-speed"), 10, "marks of a speed eviction")
    page = d.execute_script(
        "return Array.from(arguments[0].querySelectorAll('.cache-map .mark[data-state]')).map(s => "
        "({message: +s.dataset.message, start: +s.dataset.start, end: +s.dataset.end, state: s.dataset.state}))", last)
    assert page == ext["cache_map"]["spans"]
    assert {s["state"] for s in page if s["message"] == 0} >= {"speed"}  # message 0: the system prompt


def test_an_answer_with_html_is_shown_as_text(server, browser):
    d = browser
    evil = ('<script>window.pwned = 1</script> and <img src="x" onerror="window.pwned = 2"> '
            '[a link](javascript:window.pwned=3) **<b>bold</b>**\n\n```html\n<img src=x onerror="window.pwned=4">\n```')
    chat = {"id": "evil", "title": "<img src=x onerror=window.pwned=5>", "messages": [
        {"role": "user", "content": "<script>window.pwned = 6</script>"},
        {"role": "assistant", "content": evil, "meta": {"sent": 1, "system": None, "ext": {
            "decision": {"D": 0.1, "open": False, "summary": "<img src=x onerror=window.pwned=7>"},
            "cache_map": {"n_ctx": 512, "cells": 10, "tokens": 10, "aligned": True,
                          "spans": [{"message": 1, "start": 0, "end": 40, "state": "held"}]}}}}]}
    open_page(d, server, key=KEY)
    d.execute_script("localStorage.setItem('page-local/chats', arguments[0]);"
                     "localStorage.setItem('page-local/current', 'evil');", json.dumps([chat]))
    open_page(d, server, key=KEY)
    from selenium.webdriver.common.by import By

    answer = d.find_element(By.CSS_SELECTOR, "#messages .msg.assistant")
    answer.find_element(By.CSS_SELECTOR, "details.cache-view summary").click()
    time.sleep(0.3)  # an onerror, had an <img> been made, fires on its failed load
    assert d.execute_script("return window.pwned === undefined")
    assert d.find_elements(By.CSS_SELECTOR, "#messages img, #messages script, #chat-list img") == []
    text = answer.find_element(By.CSS_SELECTOR, ".body").text
    assert "<script>window.pwned = 1</script>" in text and 'onerror="window.pwned = 2"' in text
    assert "<b>bold</b>" in text and '<img src=x onerror="window.pwned=4">' in text
    assert d.execute_script("return Array.from(document.querySelectorAll('#messages a'))"
                            ".filter(a => a.href.startsWith('javascript:')).length") == 0
    assert "<img src=x onerror=window.pwned=7>" in answer.find_element(By.CSS_SELECTOR, ".summary").text
    assert "<script>" in d.find_element(By.CSS_SELECTOR, "#messages .msg.user").text
    d.save_screenshot(str(OUT / "web-ui-html-as-text.png"))


def test_import_rename_export_and_delete(server, browser, tmp_path):
    from selenium.webdriver.common.by import By

    d = browser
    open_page(d, server, key=KEY)
    d.execute_script("localStorage.removeItem('page-local/chats')")
    open_page(d, server, key=KEY)
    bad = tmp_path / "bad.json"
    bad.write_text('{"chats": [{"title": "x", "messages": [{"role": "robot", "content": "hi"}]}]}')
    by_id(d, "import").send_keys(str(bad))
    wait(d, lambda d: "could not be imported" in by_id(d, "status").text, 10, "the refusal of a bad file")
    assert "role user or assistant" in by_id(d, "status").text and chats(d) == []
    good = tmp_path / "chats.json"
    good.write_text(json.dumps({"format": "page-local-chats", "version": 1, "chats": [
        {"id": "a", "title": "Imported", "messages": [{"role": "user", "content": "Hi **there**"},
                                                       {"role": "assistant", "content": "Hello `code`"}]}]}))
    by_id(d, "import").send_keys(str(good))
    wait(d, lambda d: "Imported 1 chat" in by_id(d, "status").text, 10, "the import")
    assert d.find_element(By.CSS_SELECTOR, "#messages .msg.assistant .body code").text == "code"
    by_id(d, "rename").click()
    alert = d.switch_to.alert
    alert.send_keys("Renamed")
    alert.accept()
    assert by_id(d, "chat-title").text == "Renamed" and chats(d)[0]["title"] == "Renamed"
    exported = d.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "URL.createObjectURL = (blob) => { blob.text().then(done); return 'about:blank'; };"
        "HTMLAnchorElement.prototype.click = () => {};"
        "document.getElementById('export').click();")
    data = json.loads(exported)
    assert data["format"] == "page-local-chats" and [c["title"] for c in data["chats"]] == ["Renamed"]
    assert data["chats"][0]["messages"][1]["content"] == "Hello `code`"
    by_id(d, "delete").click()
    d.switch_to.alert.accept()
    assert chats(d) == [] and d.find_elements(By.CSS_SELECTOR, "#chat-list .chat-item") == []
