"""Ollama's routes, /metrics and cancellation against a live `page-local serve` on 127.0.0.1 (a child
process on a free port, the embedded SmolLM2), through the official `ollama` client and httpx:

  1. /api/version, /api/tags, /api/show, /api/ps as the client reads them;
  2. /api/chat streamed and not, /api/generate templated and raw: greedy answers equal the OpenAI
     routes' for the same request (the same slots, cache and engine), the final line's counts;
  3. Ollama's errors ({"error": "..."}): an unknown model (404), an option page-local cannot honour and
     `think` (400, named), num_ctx ignored;
  4. /metrics parses as Prometheus text and its counters move by what a request did;
  5. a client that goes away during a long prefill frees the slot (the prefill stops between ubatches,
     counted as cancelled in the prefill), the next requests are served, and the half-prefilled prompt
     is not reused.

One server for the module (n_ctx 2048, no key: Ollama's clients send none), short answers.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

httpx = pytest.importorskip("httpx", reason="the test extra (httpx) is not installed")
ollama = pytest.importorskip("ollama", reason="the test extra (ollama) is not installed")
pytest.importorskip("prometheus_client", reason="the [serve] extra (prometheus_client) is not installed")
pytest.importorskip("starlette", reason="the [serve] extra is not installed")
pytest.importorskip("uvicorn", reason="the [serve] extra is not installed")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from page_local.serve.bench import free_port  # noqa: E402
from tests.test_serve import stop_server as stop  # noqa: E402

N_CTX = 2048
SERVER_ARGS = ["--n-ctx", str(N_CTX), "--threads", "2", "--parallel", "1", "--queue", "2", "--gate", "never",
               "--cache-mb", "64"]
MODEL = "smollm2"
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer briefly."}]
GREEDY = {"temperature": 0, "num_predict": 8}
# about 1500 tokens: three ubatches of prefill
LONG = " ".join(f"Box {i} holds {i % 7 + 2} red apples and {i % 5 + 1} green pears." for i in range(110))


def start(model_path) -> tuple[subprocess.Popen, int]:
    """A server on a free port, ready (its /health answers 200)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("PAGE_LOCAL_API_KEY", "PAGE_LOCAL_MODEL")}
    proc = subprocess.Popen([sys.executable, "-m", "page_local.cli", "serve", "--port", str(port), "--model",
                             str(model_path), *SERVER_ARGS], env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    t_end = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited {proc.returncode}: {proc.stdout.read()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return proc, port
        except httpx.TransportError:
            pass
        if time.monotonic() > t_end:
            stop(proc)
            raise RuntimeError("the server did not become ready")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def server(smollm2_path):
    proc, port = start(smollm2_path)
    try:
        yield {"port": port, "base": f"http://127.0.0.1:{port}"}
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server["base"], timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server["base"], timeout=120) as c:
        yield c


def scrape(http) -> dict:
    """{(sample name, ((label, value), ...)): value} from GET /metrics, parsed by prometheus_client."""
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def openai_chat(http, messages, max_tokens: int = 8) -> str:
    r = http.post("/v1/chat/completions", json={"messages": messages, "temperature": 0, "max_tokens": max_tokens})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


# --- 1. the model routes -------------------------------------------------------------------------

def test_version_tags_show_ps(client, http):
    r = http.get("/api/version")
    assert r.status_code == 200 and isinstance(r.json()["version"], str)

    models = client.list().models
    # the served model first; after it, other models on this machine (the registered ones installed, the stores
    # page-local reads), never the served one again
    assert models[0].model == f"{MODEL}:latest"
    assert f"{MODEL}:latest" not in [m.model for m in models[1:]]
    m = models[0]
    assert m.size > 0 and len(m.digest) == 64 and m.modified_at is not None
    assert m.details.format == "gguf" and m.details.family == "llama"
    assert m.details.quantization_level == "Q4_1"

    shown = client.show(MODEL)
    assert shown.modelinfo["general.architecture"] == "llama"
    assert shown.modelinfo["llama.context_length"] == 8192  # SmolLM2's trained context
    assert shown.capabilities == ["completion"] and "im_start" in shown.template
    assert client.show(f"{MODEL}:latest").details.quantization_level == "Q4_1"

    running = client.ps().models
    assert len(running) == 1 and running[0].model == f"{MODEL}:latest"
    assert running[0].context_length == N_CTX and running[0].size > 0


def test_embed(client, http):
    """/api/embed through the client: one vector per input, the same as /v1/embeddings' (one model, mean
    pooled); an input longer than an embedding reads is cut (Ollama's truncate, by default) or refused."""
    import numpy as np

    r = client.embed(model=MODEL, input=["The cat sat on the mat.", "Quantum chromodynamics of quarks."])
    assert len(r.embeddings) == 2 and len(r.embeddings[0]) == 576 and r.prompt_eval_count > 0
    same = http.post("/v1/embeddings", json={"input": "The cat sat on the mat."}).json()["data"][0]["embedding"]
    assert np.allclose(r.embeddings[0], same, atol=1e-5)
    long = "word " * 600
    assert len(client.embed(model=MODEL, input=long).embeddings) == 1
    r = http.post("/api/embed", json={"model": MODEL, "input": long, "truncate": False})
    assert r.status_code == 400 and "input" in r.json()["error"]


# --- 2. chat and generate --------------------------------------------------------------------------

def test_chat_not_streamed_equals_the_openai_route(client, http):
    r = client.chat(model=MODEL, messages=QUESTION, stream=False, options=GREEDY)
    assert r.done and r.done_reason in ("stop", "length") and r.message.role == "assistant"
    assert r.message.content == openai_chat(http, QUESTION)
    assert 0 < r.eval_count <= 8 and r.prompt_eval_count > 10
    assert r.total_duration >= r.prompt_eval_duration > 0 and r.eval_duration >= 0


def test_chat_streamed(client, http):
    whole = client.chat(model=MODEL, messages=QUESTION, stream=False, options=GREEDY)
    chunks = list(client.chat(model=MODEL, messages=QUESTION, stream=True, options=GREEDY))
    assert len(chunks) >= 2 and all(not c.done for c in chunks[:-1]) and chunks[-1].done
    assert "".join(c.message.content for c in chunks) == whole.message.content
    assert chunks[-1].eval_count == whole.eval_count and chunks[-1].done_reason == whole.done_reason
    # the wire format: NDJSON, streamed by default (no "stream" field)
    with http.stream("POST", "/api/chat", json={"model": MODEL, "messages": QUESTION, "options": GREEDY}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert lines[-1]["done"] is True and "page_local" in lines[-1]


def test_generate_templated_and_raw(client, http):
    g = client.generate(model=MODEL, prompt=QUESTION[0]["content"], options=GREEDY)
    assert g.done and g.response == openai_chat(http, QUESTION)  # the chat template, as Ollama applies its own
    streamed = "".join(c.response for c in client.generate(model=MODEL, prompt=QUESTION[0]["content"],
                                                           options=GREEDY, stream=True))
    assert streamed == g.response
    raw = client.generate(model=MODEL, prompt="1, 2, 3, 4,", raw=True, options={"temperature": 0, "num_predict": 6})
    r = http.post("/v1/completions", json={"prompt": "1, 2, 3, 4,", "temperature": 0, "max_tokens": 6})
    assert raw.response == r.json()["choices"][0]["text"] and raw.eval_count == 6 and raw.done_reason == "length"
    system = "You answer in French."
    with_system = client.generate(model=MODEL, prompt="Hi", system=system, options=GREEDY)
    assert with_system.response == openai_chat(http, [{"role": "system", "content": system},
                                                      {"role": "user", "content": "Hi"}])


def test_format_constrains_the_answer_to_a_schema(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
    r = client.chat(model=MODEL, messages=QUESTION, stream=False, format=schema,
                    options={"temperature": 0, "num_predict": 48})
    assert r.done_reason == "stop" and set(json.loads(r.message.content)) == {"city"}


def test_an_empty_request_reports_the_model_loaded(client):
    r = client.generate(model=MODEL, prompt="")
    assert r.done and r.done_reason == "load" and r.response == ""


# --- 3. errors -----------------------------------------------------------------------------------------

def test_errors_in_ollamas_shape(client, http):
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="nope", messages=QUESTION, stream=False)
    assert e.value.status_code == 404 and "model 'nope' not found" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=MODEL, messages=QUESTION, stream=False, options={"mirostat": 2})
    assert e.value.status_code == 400 and "options.mirostat" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=MODEL, messages=QUESTION, stream=False, think=True)
    assert e.value.status_code == 400 and "think" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model=MODEL, prompt="Hi", options={"num_predict": 99999})
    assert e.value.status_code == 400 and "options.num_predict" in e.value.error
    r = http.post("/api/chat", json={"model": MODEL, "messages": [{"role": "wizard", "content": "Hi"}]})
    assert r.status_code == 400 and r.json() == {"error": "messages[0].role must be one of system, developer, "
                                                          "user, assistant, tool, got 'wizard'"}
    for route, body in (("chat", {"messages": QUESTION}), ("generate", {"prompt": "Hi"})):  # unknown: not ignored
        r = http.post(f"/api/{route}", json={"model": MODEL, **body, "stream": False, "mystery": 1})
        assert r.status_code == 400 and r.json()["error"].startswith(f"field mystery is not supported by "
                                                                     f"page-local's /api/{route}")
    assert http.get("/api/nothing").json() == {"error": "no route GET /api/nothing; see /v1/models, "
                                                        "/v1/chat/completions, /v1/completions"}
    refused = http.get("/api/tags", headers={"Host": "evil.example"})  # the guards answer in Ollama's shape too
    assert refused.status_code == 403 and "evil.example" in refused.json()["error"]
    # a load-time option is ignored (the server's context is fixed), the answer is the same
    a = client.chat(model=MODEL, messages=QUESTION, stream=False,  # and Ollama's defaults of samplers it lacks
                    options={**GREEDY, "num_ctx": 8192, "typical_p": 1.0, "mirostat": 0, "seed": -1})
    b = client.chat(model=MODEL, messages=QUESTION, stream=False, options=GREEDY)
    assert a.message.content == b.message.content


# --- 4. /metrics -----------------------------------------------------------------------------------

def test_metrics_move_with_a_request(client, http):
    before = scrape(http)
    r = client.chat(model=MODEL, messages=[{"role": "user", "content": "Name a colour."}], stream=False,
                    options=GREEDY)
    after = scrape(http)

    def moved(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    assert moved("page_local_http_requests_total", route="/api/chat", status="200") == 1
    assert moved("page_local_http_requests_total", route="/metrics", status="200") == 1  # the first scrape
    assert moved("page_local_prompt_tokens_total") == r.prompt_eval_count
    assert moved("page_local_generated_tokens_total") == r.eval_count
    assert moved("page_local_gate_decisions_total", verdict="closed") == 1  # --gate never
    assert moved("page_local_http_request_seconds_count", route="/api/chat") == 1
    assert after[("page_local_queue_waiting", ())] == 0 and after[("page_local_slots", ())] == 1
    assert after[("page_local_up", ())] == 1
    # a resent conversation reuses its prefix: counted as a cache hit
    client.chat(model=MODEL, messages=[{"role": "user", "content": "Name a colour."}], stream=False, options=GREEDY)
    again = scrape(http)
    assert again[("page_local_cache_hits_total", ())] > after[("page_local_cache_hits_total", ())]
    assert again[("page_local_cached_tokens_total", ())] > after[("page_local_cached_tokens_total", ())]


# --- 5. cancellation ------------------------------------------------------------------------------

def slot(http) -> dict:
    return http.get("/v1/page_local/stats").json()["slots"][0]


def send_long(port: int) -> socket.socket:
    """The long prompt to /api/generate (streamed), on a raw socket; returned once its prefill runs."""
    body = json.dumps({"model": MODEL, "prompt": LONG, "raw": True, "options": {"temperature": 0, "num_predict": 4}})
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall((f"POST /api/generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(body.encode())}\r\n\r\n{body}").encode())
    t_end = time.monotonic() + 30
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
        while not slot(http)["busy"]:  # the request has its slot: its prefill is running
            assert time.monotonic() < t_end, "the request never got its slot"
            time.sleep(0.01)
    return sock


def test_a_client_gone_during_the_prefill_frees_the_slot(client, http, server):
    reference = client.chat(model=MODEL, messages=QUESTION, stream=False, options=GREEDY).message.content
    before = scrape(http)
    sock = send_long(server["port"])
    sock.close()  # before any byte of the answer: the status line waits for the first token
    t_closed = time.monotonic()
    while slot(http)["busy"]:
        assert time.monotonic() - t_closed < 60, "the slot was not freed"
        time.sleep(0.02)
    after = scrape(http)
    assert after[("page_local_cancelled_total", (("stage", "prefill"),))] \
        == before[("page_local_cancelled_total", (("stage", "prefill"),))] + 1
    assert after[("page_local_prompt_tokens_total", ())] == before[("page_local_prompt_tokens_total", ())]
    assert slot(http)["history_tokens"] == 0  # the slot forgot the half-prefilled prompt

    # the prompt's beginning (what the cancelled prefill had decoded) is prefilled again, not reused
    r = http.post("/api/generate", json={"model": MODEL, "prompt": LONG[:400], "raw": True, "stream": False,
                                         "options": {"temperature": 0, "num_predict": 2}})
    assert r.status_code == 200, r.text
    done = r.json()
    assert done["prompt_eval_count"] > 64 and done["page_local"]["cache"]["reused_tokens"] == 0
    t0 = time.monotonic()
    assert client.chat(model=MODEL, messages=QUESTION, stream=False, options=GREEDY).message.content == reference
    assert time.monotonic() - t0 < 60


def test_ctrl_c_stops_a_running_prefill(smollm2_path):
    """SIGINT while a prefill runs: the request is answered 503 "cancelled" (its prefill stopped, not
    finished), and the server exits."""
    proc, port = start(smollm2_path)
    try:
        sock = send_long(port)
        proc.send_signal(signal.SIGINT)
        sock.settimeout(60)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
        sock.close()
        assert answer.startswith(b"HTTP/1.1 503"), answer[:200]
        assert b"cancelled during its prefill" in answer
        assert proc.wait(timeout=60) == 0
    finally:
        stop(proc)
