"""`page-local serve` against a live server on 127.0.0.1 (a child process on a free port, the embedded
SmolLM2), through the official `openai` client (max_retries=0) and raw httpx:

  1. chat completions streamed and not, models.list(), a BadRequestError for a conversation that does
     not fit when eviction is refused, 401 without the key;
  2. greedy answers through the server equal Engine answers for the same messages (gate never, verify);
  3. turns 2..6 of a chat prefill only the new tokens (cached_tokens covers the earlier turns), also
     after an eviction;
  5. a client that disconnects mid-stream stops its generation, and the next request starts at once;
     every error in the OpenAI envelope with its status (400, 401, 404, 405, 413, 503).

One server for the module; small n_ctx, short prompts, a few tokens per answer. The in-process tests
at the end (a Backend that is still loading, CORS, the SSE body's error frame, the request checks,
the conversation cache's bookkeeping) need no model.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from page_local import defaults

httpx = pytest.importorskip("httpx", reason="the test extra (openai, httpx) is not installed")
openai = pytest.importorskip("openai", reason="the test extra (openai) is not installed")
pytest.importorskip("starlette", reason="the [serve] extra is not installed")
pytest.importorskip("uvicorn", reason="the [serve] extra is not installed")
pytest.importorskip("sse_starlette", reason="the [serve] extra is not installed")

from page_local.serve.bench import free_port
from page_local.serve.errors import ApiError
from page_local.serve.protocol import StopScanner, parse_job
from page_local.serve.slots import Cached, SnapshotCache, common_prefix, usable_prefix

KEY = "test-key-0123456789"
N_CTX = 1024
MAX_TOKENS_LIMIT = 400
# This module holds the server to the engine's bits (greedy answers equal, reused prefixes included) on the plain
# attention path: with flash attention, llama.cpp's CPU kernels round a token's attention differently with the
# size of the batch it was read in (one kernel under 64 queries, a tiled one from 64), so a conversation that
# reuses cells another request read in other batches can part from a fresh prefill at the margin; llama-server
# says the same of its cache_prompt. The other serve modules run the default path (flash attention on).
SERVER_ARGS = ["--n-ctx", str(N_CTX), "--threads", "1", "--parallel", "1", "--queue", "1", "--gate", "never",
               "--max-body-kb", "64", "--max-tokens-limit", str(MAX_TOKENS_LIMIT), "--cache-mb", "64",
               "--flash-attn", "off",
               # the speed budget evicts for good (serve's default parks, from 2048 cells: test_web_ui's parking
               # server): these tests follow an evicted conversation through the slot's reuse and snapshots
               "--no-park"]
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer briefly."}]
# long enough for the verify gate to build an evicted candidate (T > B = max(40, T / 4))
PASSAGE = ("The harbour town of Elmsford has three bridges. The oldest, the Miller Bridge, was built in 1821 "
           "from grey granite. The second, the Rope Bridge, carries only walkers. The newest, the Tide Bridge, "
           "opened in 1998 and lifts for tall ships twice a day. The town's lighthouse stands north of the "
           "Tide Bridge and is painted red and white. Fishing boats leave before dawn and return at noon. ")
# a text completion that runs to max_tokens (SmolLM2 counts on): what holds a slot for a few seconds
COUNTING = {"prompt": "1, 2, 3, 4, 5, 6, 7, 8,", "max_tokens": MAX_TOKENS_LIMIT, "temperature": 0}


def start_server(port: int, *args: str, key: str | None = KEY) -> subprocess.Popen:
    env = dict(os.environ)
    env.pop("PAGE_LOCAL_API_KEY", None)
    env.pop("PAGE_LOCAL_MODEL", None)
    cmd = [sys.executable, "-m", "page_local.cli", "serve", "--port", str(port), *args]
    if key:
        cmd += ["--api-key", key]
    return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def wait_ready(proc: subprocess.Popen, port: int, timeout: float = 120.0) -> list[int]:
    """Poll /health (no key) until 200; the statuses seen on the way."""
    seen, t_end = [], time.monotonic() + timeout
    while time.monotonic() < t_end:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited {proc.returncode}: {proc.stdout.read()}")
        try:
            r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
            seen.append(r.status_code)
            if r.status_code == 200:
                return seen
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise RuntimeError("the server did not become ready")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def server(smollm2_path):
    port = free_port()
    proc = start_server(port, "--model", str(smollm2_path), *SERVER_ARGS)
    try:
        seen = wait_ready(proc, port)
        yield {"port": port, "base": f"http://127.0.0.1:{port}", "health_seen": seen, "proc": proc}
    finally:
        stop_server(proc)
    assert proc.returncode is not None


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server["base"] + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server["base"], headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as c:
        yield c


def ext(obj) -> dict:
    """The page_local extension of an openai response or chunk object."""
    return obj.model_extra["page_local"]


def sse_frames(text: str) -> list[str]:
    """The data of each SSE frame; fails on anything that is not a data line (comments, pings, events)."""
    frames = []
    for block in text.replace("\r\n", "\n").strip("\n").split("\n\n"):
        lines = block.split("\n")
        assert all(line.startswith("data: ") for line in lines), block
        frames.append("\n".join(line[len("data: "):] for line in lines))
    return frames


# --- 1. the openai client ----------------------------------------------------------------------

def test_models_list(client, server):
    ids = [m.id for m in client.models.list()]
    assert ids[0] == "smollm2" and "smollm2" not in ids[1:]  # then the other models on this machine, if any
    m = client.models.retrieve("smollm2")
    assert m.id == "smollm2"
    assert m.page_local["budget"] == 0.25 and m.page_local["park"] is False  # the server's --no-park, said
    assert server["health_seen"][-1] == 200 and set(server["health_seen"]) <= {200, 503}


def test_chat_not_streamed(client):
    r = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=8, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant" and "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0 and 0 < r.usage.completion_tokens <= 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens >= 0
    d = ext(r)["decision"]
    assert d["gate_mode"] == "never" and d["T"] >= r.usage.prompt_tokens - r.usage.prompt_tokens_details.cached_tokens
    assert d["summary"].startswith("full cache of ") and "finish: " in d["summary"]


def test_chat_streamed(client):
    chunks = list(client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason in ("stop", "length")
    assert ext(finals[0])["decision"]["summary"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens <= 8
    # the same request not streamed gives the same greedy text
    r = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=8, temperature=0)
    assert r.choices[0].message.content == text


def test_stream_frames_are_exactly_openai(http):
    """On the wire: data frames only (no keep-alive comments), the role first, [DONE] last, one id."""
    body = {"messages": QUESTION, "max_tokens": 4, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    frames = sse_frames(r.text)
    assert frames[-1] == "[DONE]"
    objs = [json.loads(f) for f in frames[:-1]]
    assert objs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert objs[-2]["choices"][0]["finish_reason"] and "page_local" in objs[-2]
    assert objs[-1]["choices"] == [] and objs[-1]["usage"]["completion_tokens"] <= 4
    assert len({o["id"] for o in objs}) == 1


def test_text_completions(client):
    r = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=4, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text.startswith(" Paris")
    chunks = list(client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=4,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text


def test_overflow_is_a_bad_request(client):
    long = [{"role": "user", "content": "word " * (N_CTX + 100)}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smollm2", messages=long, max_tokens=4,
                                       extra_body={"page_local": {"on_full": "refuse"}})
    err = e.value.body
    assert e.value.status_code == 400 and err["code"] == "context_length_exceeded"
    assert f"n_ctx is {N_CTX}" in err["message"] and "tokens" in err["message"]


def test_without_the_key(server):
    bad_client = openai.OpenAI(base_url=server["base"] + "/v1", api_key="wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError) as e:
        bad_client.models.list()
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    r = httpx.post(server["base"] + "/v1/chat/completions", json={"messages": QUESTION}, timeout=30)
    assert r.status_code == 401 and "no API key" in r.json()["error"]["message"]
    assert httpx.get(server["base"] + "/health", timeout=30).status_code == 200  # launchers poll it keyless


# --- 2. the server answers as the Engine does ---------------------------------------------------

@pytest.mark.parametrize("gate", ["never", "verify"])
def test_greedy_answers_equal_the_engine(client, smollm2_path, gate):
    from page_local.chat.template import ChatTemplate
    from page_local.engine.engine import Engine

    chats = [QUESTION, [{"role": "user", "content": PASSAGE + "\nWhat colour is the lighthouse?"}],
             [{"role": "system", "content": "Answer in one word."},
              {"role": "user", "content": "Name a primary colour."}]]
    checked = []
    with Engine(smollm2_path, n_ctx=N_CTX, threads=1, gate=gate, flash_attn="off") as eng:
        tpl = ChatTemplate(eng.model, fallback="-")
        for messages in chats:
            ref = eng.generate(eng.model.tokenize(tpl.render(messages), add_special=True), max_tokens=24)
            r = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=24, temperature=0,
                                               extra_body={"page_local": {"gate": gate, "budget": eng.budget}})
            assert r.choices[0].message.content == ref.text
            assert r.usage.completion_tokens == len(ref.tokens)
            d = ext(r)["decision"]
            assert (d["gate_mode"], d["evicted"], d["verify_m"]) == (gate, ref.decision.evicted, ref.decision.verify_m)
            checked.append(d["verify_m"])
    if gate == "verify":  # the passage is long enough for a candidate: self-verification ran on it
        assert checked[1]


# --- 3. conversations are not prefilled again ---------------------------------------------------

def six_turns(client, gate: str, budget=None) -> list:
    messages, out = [], []
    questions = ["Tell me about the moon.", "How far is it?", "Who walked on it?", "When?", "Why go back?",
                 "Thanks. One last fact?"]
    extension = {"gate": gate} | ({"budget": budget} if budget is not None else {})
    for i, q in enumerate(questions):
        content = (PASSAGE + q) if i == 0 else q
        messages.append({"role": "user", "content": content})
        r = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=16, temperature=0,
                                           extra_body={"page_local": extension})
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
        out.append(r)
    return out


@pytest.mark.parametrize("gate", ["never", "always"])
def test_later_turns_reuse_the_earlier_ones(client, gate):
    turns = six_turns(client, gate, budget=0.25 if gate == "always" else None)
    for prev, r in itertools.pairwise(turns):
        cached = r.usage.prompt_tokens_details.cached_tokens
        # everything the previous request sent is reused; only the new message (and the answer's
        # retokenized end, if it differs) is prefilled
        assert prev.usage.prompt_tokens <= cached <= prev.usage.total_tokens < r.usage.prompt_tokens
        assert ext(r)["cache"]["source"] == "live"
    if gate == "always":
        assert any(ext(r)["decision"]["evicted"] for r in turns[:-1])  # an eviction, then reuse after it
        assert any(ext(r)["cache"]["reused_evicted"] for r in turns[1:])


def test_other_conversations_between_turns(client):
    """A conversation pushed out of the slot by others comes back from its snapshot, also when one of
    them shared a longer prefix with it ("Name three") and started from a copy of it."""
    a = [{"role": "user", "content": "Name three fruits."}]
    r1 = client.chat.completions.create(model="smollm2", messages=a, max_tokens=8, temperature=0)
    for other in ("Count to five.", "Name three colours."):
        r = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": other}],
                                           max_tokens=8, temperature=0)
    assert ext(r)["cache"]["source"] == "snapshot"  # the third began on a copy of the first one's prefix
    a += [{"role": "assistant", "content": r1.choices[0].message.content}, {"role": "user", "content": "One more?"}]
    r2 = client.chat.completions.create(model="smollm2", messages=a, max_tokens=8, temperature=0)
    assert ext(r2)["cache"]["source"] == "snapshot"
    assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens


def test_per_request_settings_do_not_stick(client, http):
    r = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=4, temperature=0,
                                       extra_body={"page_local": {"gate": "always", "budget": 48,
                                                                  "evictor": "knorm", "verify_tokens": 8}})
    assert ext(r)["settings"] == {"gate": "always", "budget": 48, "evictor": "knorm", "verify_tokens": 8,
                                  "on_full": "evict", "park": False}
    assert ext(r)["decision"]["evictor"] == "knorm"
    r = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=4, temperature=0)
    assert ext(r)["settings"]["gate"] == "never" and ext(r)["settings"]["evictor"] == defaults.CHAT_EVICTOR
    # the server's default budget is chat's (here evicting for good: --no-park)
    assert ext(r)["settings"]["budget"] == defaults.CHAT_BUDGET == 0.25 and ext(r)["settings"]["park"] is False
    # gate and evictor are set together: lorekv-answer needs a gate that has the answer before evicting
    r = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=4, temperature=0,
                                       extra_body={"page_local": {"gate": "search", "evictor": "lorekv-answer"}})
    assert ext(r)["settings"]["evictor"] == "lorekv-answer" and ext(r)["settings"]["gate"] == "search"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=4, temperature=0,
                                       extra_body={"page_local": {"evictor": "lorekv-answer"}})
    assert "page_local.evictor" in str(e.value) and "only the verify and search gates" in str(e.value)
    r = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=4, temperature=0)
    assert ext(r)["settings"]["gate"] == "never" and ext(r)["settings"]["evictor"] == defaults.CHAT_EVICTOR


def test_sampling_fields(client):
    kw = {"model": "smollm2", "messages": [{"role": "user", "content": "Write a short poem about rain."}],
          "max_tokens": 24, "temperature": 0.9, "top_p": 0.9, "seed": 7}
    a = client.chat.completions.create(**kw).choices[0].message.content
    assert client.chat.completions.create(**kw).choices[0].message.content == a  # seeded: reproducible
    full = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=12, temperature=0)
    text = full.choices[0].message.content
    stop = text[4:7]
    r = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=12, temperature=0, stop=[stop])
    assert r.choices[0].message.content == text[: text.index(stop)] and r.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=12, temperature=0,
                                                 stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text[: text.index(stop)]


# --- 5. disconnects and errors -----------------------------------------------------------------

def stats(http) -> dict:
    return http.get("/v1/page_local/stats").json()


def test_a_client_that_disconnects_stops_its_generation(server, http):
    before = stats(http)["counts"]
    with httpx.Client(base_url=server["base"], headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c, \
            c.stream("POST", "/v1/completions", json=COUNTING | {"stream": True}) as r:
        got = 0
        for line in r.iter_lines():
            got += line.startswith("data: ")
            if got >= 3:
                break  # and the connection is closed here, mid-stream
    t0 = time.perf_counter()
    nxt = http.post("/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 1, "temperature": 0})
    waited = time.perf_counter() - t0
    assert nxt.status_code == 200
    after = stats(http)["counts"]
    assert after["cancelled"] == before["cancelled"] + 1
    generated = after["completion_tokens"] - before["completion_tokens"] - 1
    # the abandoned answer stopped long before max_tokens: the disconnect reached the slot's thread
    # within a few tokens, and the next request did not wait for the rest of the story
    assert generated < MAX_TOKENS_LIMIT // 4, generated
    assert waited < 30


def test_a_non_streamed_request_whose_client_gives_up(server, http):
    before = stats(http)["counts"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server["base"] + "/v1/completions", json=COUNTING, headers={"Authorization": f"Bearer {KEY}"},
                   timeout=httpx.Timeout(30, read=0.5))
    for _ in range(200):  # the slot's thread notices within a token of the disconnect
        after = stats(http)["counts"]
        if after["requests"] > before["requests"]:
            break
        time.sleep(0.05)
    assert after["cancelled"] == before["cancelled"] + 1
    assert after["completion_tokens"] - before["completion_tokens"] < MAX_TOKENS_LIMIT


def test_queue_full_is_503_with_retry_after(server, http):
    """--parallel 1 --queue 1: one request running, one waiting, the third is refused."""
    headers = {"Authorization": f"Bearer {KEY}"}
    first_chunk = threading.Event()

    release = threading.Event()

    def long_stream():  # holds the slot until the third request has been answered
        with httpx.Client(base_url=server["base"], headers=headers, timeout=60) as c, \
                c.stream("POST", "/v1/completions", json=COUNTING | {"stream": True}) as r:
            lines = r.iter_lines()  # held: closing this iterator would close the connection
            while not next(lines).startswith("data: "):
                pass
            first_chunk.set()
            release.wait(60)

    def waiter(out):
        out.append(httpx.post(server["base"] + "/v1/chat/completions", headers=headers, timeout=60,
                              json={"messages": QUESTION, "max_tokens": 1, "temperature": 0}).status_code)

    t1 = threading.Thread(target=long_stream)
    waited: list[int] = []
    t2 = threading.Thread(target=waiter, args=(waited,))
    t1.start()
    try:
        assert first_chunk.wait(60)
        t2.start()
        for _ in range(200):
            queue = stats(http)["queue"]
            if queue["waiting"] == 1:
                break
            time.sleep(0.02)
        assert queue == {"waiting": 1, "max": 1}
        r = http.post("/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 1})
    finally:
        release.set()
        t1.join()
        if t2.is_alive() or t2.ident:
            t2.join()
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "server_busy"
    assert waited == [200]


BAD_REQUESTS = [
    ("not-json", b"{nope", 400, "invalid_json"),
    ("not-an-object", b"[1, 2]", 400, "invalid_json"),
    ("no-messages", {"max_tokens": 4}, 400, "missing_required_parameter"),
    ("bad-role", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "invalid_value"),
    ("bad-temperature", {"messages": QUESTION, "temperature": "hot"}, 400, "invalid_value"),
    ("max-tokens-over-limit", {"messages": QUESTION, "max_tokens": MAX_TOKENS_LIMIT + 1}, 400, "invalid_value"),
    ("max-tokens-zero", {"messages": QUESTION, "max_tokens": 0}, 400, "invalid_value"),
    ("n-2", {"messages": QUESTION, "n": 2}, 400, "unsupported_parameter"),
    ("unknown-field", {"messages": QUESTION, "something_new": {"a": 1}}, 400, "unsupported_parameter"),
    ("tools", {"messages": QUESTION, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
     "tools_not_supported"),  # SmolLM2's template has no tools (test_serve_api.py has the message)
    ("tool-message", {"messages": [{"role": "tool", "content": "x", "tool_call_id": "1"}]}, 400,
     "tools_not_supported"),
    ("functions", {"messages": QUESTION, "functions": [{"name": "f"}]}, 400, "unsupported_parameter"),
    ("image", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "unsupported_parameter"),
    ("bad-gate", {"messages": QUESTION, "page_local": {"gate": "sometimes"}}, 400, "invalid_value"),
    ("bad-evictor", {"messages": QUESTION, "page_local": {"evictor": "nope"}}, 400, "invalid_value"),
    ("bad-budget", {"messages": QUESTION, "page_local": {"budget": 7.5}}, 400, "invalid_value"),
    ("extension-typo", {"messages": QUESTION, "page_local": {"gates": "never"}}, 400, "invalid_value"),
    ("unknown-model", {"model": "gpt-4o", "messages": QUESTION}, 404, "model_not_found"),
    ("model-as-a-file", {"model": "/etc/passwd", "messages": QUESTION}, 404, "model_not_found"),
    ("body-too-large", {"messages": [{"role": "user", "content": "x" * (65 * 1024)}]}, 413, "request_too_large"),
]


@pytest.mark.parametrize("name, body, status, code", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_requests_in_the_openai_envelope(http, name, body, status, code):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = http.post("/v1/chat/completions", **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["message"] and err["type"]
    if name == "bad-evictor":
        assert "snapkv" in err["message"]  # the engine's own message lists the valid names


def test_informational_fields_are_accepted(http):
    r = http.post("/chat/completions", json={"messages": QUESTION, "max_tokens": 2, "temperature": 0,
                                            "user": "someone", "frequency_penalty": 0})
    assert r.status_code == 200  # and the route works without the /v1 prefix (unknown fields: test_serve_api.py)


@pytest.mark.parametrize("method, path, status, code", [
    ("GET", "/v1/nothing-here", 404, "not_found"),
    ("GET", "/v1/chat/completions", 405, "method_not_allowed"),
    ("GET", "/v1/models/llama-3", 404, "model_not_found"),
], ids=["unknown-route", "wrong-method", "unknown-model-card"])
def test_routes_in_the_openai_envelope(http, method, path, status, code):
    r = http.request(method, path)
    assert r.status_code == status and r.json()["error"]["code"] == code


def test_cors_is_off_by_default(http):
    r = http.options("/v1/chat/completions", headers={"Origin": "http://evil.example",
                                                       "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in r.headers


def test_a_public_host_needs_a_key(smollm2_path):
    proc = start_server(free_port(), "--host", "0.0.0.0", "--model", str(smollm2_path), key=None)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "--api-key" in out and "Traceback" not in out


# --- in process, without a model -----------------------------------------------------------------

def _app(**settings):
    from starlette.testclient import TestClient

    from page_local.serve.app import create_app
    from page_local.serve.backend import Backend, Settings

    backend = Backend(Settings(model_path=Path("model.gguf"), served_name="m", **settings))
    return TestClient(create_app(backend))  # not entered: the lifespan (loading) never starts


def test_loading_is_503():
    c = _app()
    r = c.get("/health")
    assert r.status_code == 503 and r.json() == {"status": "loading"}
    r = c.post("/v1/chat/completions", json={"messages": QUESTION})
    assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading" and r.headers["retry-after"]


def test_cors_when_asked_for():
    c = _app(cors_origins=["http://localhost:3000"], api_key="k")
    r = c.options("/v1/models", headers={"Origin": "http://localhost:3000", "Access-Control-Request-Method": "GET",
                                         "Access-Control-Request-Headers": "authorization"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
    r = c.options("/v1/models", headers={"Origin": "http://other", "Access-Control-Request-Method": "GET"})
    assert r.headers.get("access-control-allow-origin") != "http://other"


def test_a_mid_stream_error_is_a_frame_then_done():
    from page_local.serve.openai import sse
    from page_local.serve.protocol import Job

    class FakeTurn:
        def __init__(self, events):
            self.events, self.closed = list(events), False

        async def next(self):
            return self.events.pop(0)

        def close(self):
            self.closed = True

    async def frames():
        turn = FakeTurn([("error", ApiError(500, "llama_decode failed", "internal_error"))])
        out = [e.data async for e in sse(turn, ("text", "Hel"), Job("chat", "m"), "chat", "chatcmpl-1", 0, "m")]
        return out, turn.closed

    out, closed = asyncio.run(frames())
    assert json.loads(out[0])["choices"][0]["delta"]["role"] == "assistant"
    assert json.loads(out[1])["choices"][0]["delta"]["content"] == "Hel"
    assert json.loads(out[2]) == {"error": {"message": "llama_decode failed", "type": "server_error",
                                            "code": "internal_error", "param": None}}
    assert out[3] == "[DONE]" and closed


@pytest.mark.parametrize("stops, pieces, shown", [
    (["END"], ["Hello E", "N", "D more"], "Hello "),
    (["\n\n"], ["a\n", "\nb"], "a"),
    (["xyz"], ["ab", "cx", "y"], "abcxy"),  # never completed: all of it shown at the end
    ([], ["a", "b"], "ab"),
], ids=["across-pieces", "newlines", "prefix-only", "none"])
def test_stop_strings(stops, pieces, shown):
    s = StopScanner(stops)
    assert "".join(s.feed(p) for p in pieces) + s.flush() == shown


def test_defaults_and_limits_of_a_request():
    job = parse_job({"messages": QUESTION}, "chat", max_tokens_limit=300)
    assert (job.max_tokens, job.temperature, job.top_p, job.stream) == (300, 1.0, 1.0, False)
    assert 0 <= job.seed < 2**32
    with pytest.raises(ApiError) as e:
        parse_job({"prompt": ["a", "b"]}, "text", 300)
    assert e.value.status == 400 and e.value.param == "prompt"


def test_prefix_and_cache_bookkeeping():
    assert common_prefix([1, 2, 3, 4], [1, 2, 9]) == 2 and common_prefix([], [1]) == 0
    assert common_prefix(list(range(1000)), list(range(1000))) == 1000
    # an evicted cache is reused only by a request that contains its last prompt
    assert usable_prefix([1, 2, 3, 4, 5], [1, 2, 3, 4, 9], answer_from=3, evicted=True) == 4
    assert usable_prefix([1, 2, 3, 4, 5], [1, 2, 9], answer_from=3, evicted=True) == 0
    assert usable_prefix([1, 2, 3, 4, 5], [1, 2, 9], answer_from=3, evicted=False) == 2

    class Snap:
        def __init__(self, history, n):
            self.history, self.positions, self.state = tuple(history), tuple(history), b"x" * n

        @property
        def nbytes(self):
            return len(self.state)

    cache = SnapshotCache(cap_bytes=100)
    cache.put(Cached(Snap([1, 2, 3], 60), 2))
    cache.put(Cached(Snap([1, 5, 6], 30), 2))
    assert cache.best([1, 2, 3, 7])[0] == 3
    cache.put(Cached(Snap([7, 8], 30), 1))  # over the cap: the least recently stored goes
    assert len(cache) == 2 and cache.nbytes == 60 and cache.best([1, 2, 3, 7])[0] == 1
    n, key = cache.best([7, 8, 9])
    assert n == 2 and cache.take(key).snap.history == (7, 8) and len(cache) == 1
    cache.put(Cached(Snap([1], 101), 0))  # larger than the cap: not kept
    assert len(cache) == 1
