"""`page-local serve` is safe from the browser and isolates its clients, against a live server on
127.0.0.1 (one for the module, the embedded SmolLM2, n_ctx 512, answers of a few tokens):

  1. Host: only the server's own names (DNS rebinding gets 403); Origin: only --cors-origin origins
     and the server's own (another site's page gets 403, also for its preflight and its
     `text/plain` "simple request", and the model does not run); a POST that declares another type
     than JSON gets 415; the openai SDK, httpx without Origin, an allowed origin's preflight and
     request, and a same-origin request still work;
  2. each API key is its own namespace of cached conversations: a second key gets cached_tokens 0
     for the first key's prompt, the first key resending it reuses it;
  3. 200 KB of nested brackets is a 400; a full queue refuses a request before its body is read;
     a request refused in its page_local overrides leaves the slot's bookkeeping as it was (a later
     unrelated request does not reuse the evicted cache), one that fails after its conversation was
     put in place leaves nothing to reuse.

The policies themselves (HostPolicy, OriginPolicy) and the command's checks of its options are
tested at the end, without a model.
"""

from __future__ import annotations

import socket
import threading

import pytest

httpx = pytest.importorskip("httpx", reason="the test extra (openai, httpx) is not installed")
openai = pytest.importorskip("openai", reason="the test extra (openai) is not installed")
pytest.importorskip("starlette", reason="the [serve] extra is not installed")
pytest.importorskip("uvicorn", reason="the [serve] extra is not installed")
pytest.importorskip("sse_starlette", reason="the [serve] extra is not installed")

from click.testing import CliRunner  # noqa: E402

from page_local.serve.bench import free_port  # noqa: E402
from page_local.engine.turn import W  # noqa: E402
from page_local.serve.guards import HostPolicy, OriginPolicy, host_name, origin_of  # noqa: E402
from tests.conftest import one_line_error  # noqa: E402
from tests.test_serve import PASSAGE, QUESTION, start_server, stop_server, wait_ready  # noqa: E402

KEYS = [f"safety-key-{i}" for i in range(6)]  # the first on the command line, the others in a file
OVERRIDE_KEY, FAILED_KEY = 4, 5  # the bookkeeping tests' own namespaces: nothing else cached there
ALLOWED_ORIGIN = "http://localhost:3000"
OTHER_NAME = "my-pc.lan"
CHAT = {"messages": QUESTION, "max_tokens": 2, "temperature": 0}
SYSTEM = {"role": "system", "content": "You are a careful assistant. Answer in one short sentence."}


@pytest.fixture(scope="module")
def server(smollm2_path, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text("# the other clients\n" + "\n".join(KEYS[1:]) + "\n\n")
    port = free_port()
    proc = start_server(port, "--model", str(smollm2_path), "--n-ctx", "512", "--threads", "1", "--parallel", "1",
                        "--queue", "1", "--gate", "never", "--max-body-kb", "256", "--cache-mb", "32",
                        "--no-park",  # a request's gate and budget evict for good: the slot's bookkeeping follows
                        "--api-key-file", str(keys), "--allow-host", OTHER_NAME, "--cors-origin", ALLOWED_ORIGIN,
                        key=KEYS[0])
    try:
        wait_ready(proc, port)
        yield {"port": port, "base": f"http://127.0.0.1:{port}"}
    finally:
        stop_server(proc)


def auth(i: int = 0) -> dict:
    return {"Authorization": f"Bearer {KEYS[i]}"}


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server["base"], headers=auth(0), timeout=120) as c:
        yield c


def requests_served(http) -> int:
    return http.get("/v1/page_local/stats").json()["counts"]["requests"]


def refused(r, status: int, code: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["message"] and err["type"]
    return err


# --- 1. safe from the browser ------------------------------------------------------------------

@pytest.mark.parametrize("host, allowed", [
    ("evil.example", False), ("evil.example:{port}", False), ("127.0.0.1.evil.example", False),
    ("localhost.", True), ("localhost:{port}", True), ("LOCALHOST:1234", True), ("127.0.0.1", True),
    ("[::1]:{port}", True), (f"{OTHER_NAME}:{{port}}", True), ("192.168.1.20:{port}", False),
], ids=lambda v: str(v))
def test_the_host_header_must_name_this_server(server, http, host, allowed):
    r = http.get("/v1/models", headers={"Host": host.format(port=server["port"])})
    if allowed:
        assert r.status_code == 200 and r.json()["data"][0]["id"] == "smollm2"
    else:
        err = refused(r, 403, "host_not_allowed")
        assert "--allow-host" in err["message"]


def test_a_rebound_name_cannot_run_the_model(server, http):
    """DNS rebinding: the page's own origin, the attacker's name in Host; no route runs, /health neither."""
    before = requests_served(http)
    evil = f"evil.example:{server['port']}"
    r = http.post("/v1/chat/completions", json=CHAT, headers={"Host": evil, "Origin": f"http://{evil}"})
    refused(r, 403, "host_not_allowed")
    refused(httpx.get(server["base"] + "/health", headers={"Host": evil}), 403, "host_not_allowed")
    assert requests_served(http) == before


@pytest.mark.parametrize("origin", ["https://evil.example", "null", "http://127.0.0.1:1", "http://localhost:3001"])
def test_a_foreign_page_is_refused(server, http, origin):
    before = requests_served(http)
    # what any web page can send without a preflight: a text/plain POST
    r = http.post("/v1/chat/completions", content=b'{"messages": [{"role": "user", "content": "hi"}]}',
                  headers={"Origin": origin, "Content-Type": "text/plain"})
    err = refused(r, 403, "origin_not_allowed")
    assert f"--cors-origin {origin}" in err["message"]
    assert "access-control-allow-origin" not in r.headers
    refused(http.post("/v1/chat/completions", json=CHAT, headers={"Origin": origin}), 403, "origin_not_allowed")
    refused(http.get("/v1/models", headers={"Origin": origin}), 403, "origin_not_allowed")
    pre = httpx.options(server["base"] + "/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    refused(pre, 403, "origin_not_allowed")
    assert "access-control-allow-origin" not in pre.headers
    assert requests_served(http) == before  # the model never ran


def test_a_configured_origin_gets_cors(server, http):
    pre = httpx.options(server["base"] + "/v1/chat/completions", headers={
        "Origin": ALLOWED_ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os",
        "Access-Control-Request-Private-Network": "true"})
    assert pre.status_code == 200, pre.text
    h = pre.headers
    assert h["access-control-allow-origin"] == ALLOWED_ORIGIN and "POST" in h["access-control-allow-methods"]
    assert "x-stainless-os" in h["access-control-allow-headers"]  # the SDKs' own headers
    assert h["access-control-allow-private-network"] == "true"  # Chrome: a public site calling localhost
    r = http.post("/v1/chat/completions", json=CHAT, headers={"Origin": ALLOWED_ORIGIN})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    assert r.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    # the page can read why it was refused: errors carry the CORS headers too
    r = httpx.post(server["base"] + "/v1/chat/completions", json=CHAT, headers={"Origin": ALLOWED_ORIGIN})
    refused(r, 401, "invalid_api_key")
    assert r.headers["access-control-allow-origin"] == ALLOWED_ORIGIN


@pytest.mark.parametrize("host", ["127.0.0.1:{port}", "localhost:{port}", f"{OTHER_NAME}:{{port}}"])
def test_the_servers_own_origin_is_allowed(server, http, host):
    """A web UI served by this server (GET /, later) calls it from its own origin."""
    host = host.format(port=server["port"])
    r = http.post("/v1/chat/completions", json=CHAT, headers={"Host": host, "Origin": f"http://{host}"})
    assert r.status_code == 200, r.text
    # the same name on another port, or over https, is another origin
    name = host.rsplit(":", 1)[0]
    for origin in (f"http://{name}:{server['port'] + 1}", f"https://{host}"):
        refused(http.post("/v1/chat/completions", json=CHAT, headers={"Host": host, "Origin": origin}), 403,
                "origin_not_allowed")


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                                   "application/jsonx", "text/json"])
def test_a_post_that_is_not_json_is_415(http, ctype):
    before = requests_served(http)
    r = http.post("/v1/chat/completions", content=b'{"messages": [{"role": "user", "content": "hi"}]}',
                  headers={"Content-Type": ctype})
    err = refused(r, 415, "unsupported_media_type")
    assert "application/json" in err["message"]
    assert requests_served(http) == before


def test_json_posts_still_work(server, http):
    r = http.post("/v1/completions", content=b'{"prompt": "The capital of France is", "max_tokens": 2}',
                  headers={"Content-Type": "Application/JSON; charset=utf-8"})
    assert r.status_code == 200, r.text
    r = http.post("/v1/completions", content=b'{"prompt": "The capital of France is", "max_tokens": 2}')
    assert r.status_code == 200, r.text  # no Content-Type at all: read as JSON (see guards.JsonOnly)
    client = openai.OpenAI(base_url=server["base"] + "/v1", api_key=KEYS[0], max_retries=0, timeout=120)
    assert [m.id for m in client.models.list()][0] == "smollm2"  # then the other models on this machine, if any
    out = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=8, temperature=0)
    assert "Paris" in out.choices[0].message.content


# --- 2. isolated between clients ---------------------------------------------------------------

def chat(server, key: int, messages: list[dict], **extra) -> dict:
    r = httpx.post(server["base"] + "/v1/chat/completions", headers=auth(key), timeout=120,
                   json={"messages": messages, "max_tokens": 4, "temperature": 0} | extra)
    assert r.status_code == 200, r.text
    return r.json()


def cached(res: dict) -> int:
    return res["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_each_key_has_its_own_conversation_cache(server):
    secret = [SYSTEM, {"role": "user", "content": "My locker code is 4471. Say OK."}]
    first = chat(server, 1, secret)
    other = chat(server, 2, secret)  # the same guess from another key: nothing of key 1's is reused
    assert cached(other) == 0 and other["page_local"]["cache"]["source"] == "none"
    again = chat(server, 1, secret)  # key 1 resending: its conversation comes back (from its snapshot)
    assert cached(again) == first["usage"]["prompt_tokens"] - W > 0  # the last W are read again (slots.prepare)
    assert again["page_local"]["cache"]["source"] == "snapshot"
    # and a shared prefix (the system prompt) is not reused across keys either
    third = chat(server, 2, [SYSTEM, {"role": "user", "content": "Say OK."}])
    assert 0 < cached(third) < third["usage"]["prompt_tokens"]  # key 2's own earlier request
    assert cached(chat(server, 3, [SYSTEM, {"role": "user", "content": "Say OK."}])) == 0
    # the stats show a slot's conversation length only to its own key
    slot_for = {k: httpx.get(server["base"] + "/v1/page_local/stats", headers=auth(k)).json()["slots"][0]
                for k in (1, 3)}
    assert slot_for[3]["history_tokens"] > 0 and slot_for[1]["history_tokens"] is None


def test_a_keys_conversation_is_snapshotted_after_its_request_not_in_the_next_keys(server):
    """With keys, a finished request's conversation goes to the cache at once, as its key's: another key's
    request that takes the slot next does not snapshot it inside its own turn (its time to the first token
    would grow with this key's conversation; docs/serve.md, "What a client can learn about another")."""
    def stats(key: int) -> dict:
        return httpx.get(server["base"] + "/v1/page_local/stats", headers=auth(key)).json()

    before = stats(3)["cache"]["snapshots"]
    chat(server, 3, [SYSTEM, {"role": "user", "content": PASSAGE + "How many bridges are there?"}])
    for _ in range(500):  # the slot is busy until the snapshot is written
        now = stats(3)
        if not now["slots"][0]["busy"]:
            break
        threading.Event().wait(0.02)
    assert now["cache"]["snapshots"] == before + 1
    other = chat(server, 2, [{"role": "user", "content": "Say OK."}])  # takes the slot: nothing left to save
    assert stats(2)["cache"]["snapshots"] >= before + 1 and other["page_local"]["cache"]["source"] in ("none",
                                                                                                       "snapshot")


def test_requests_reading_their_bodies_count_against_the_queue(server, http):
    """--parallel 1 --queue 1, the slot busy: a request still sending its body holds the one place in line,
    so the next request is refused at once (503), not let in to refuse the first later."""
    first_chunk, release, sent, slow = threading.Event(), threading.Event(), threading.Event(), []

    def long_stream():
        with httpx.Client(base_url=server["base"], headers=auth(0), timeout=60) as c, \
                c.stream("POST", "/v1/completions", json={"prompt": "1, 2, 3, 4, 5,", "max_tokens": 400,
                                                         "temperature": 0, "stream": True}) as r:
            lines = r.iter_lines()
            while not next(lines).startswith("data: "):
                pass
            first_chunk.set()
            release.wait(60)

    def slow_body():  # its body in two parts, the second once the test has tried the next request
        def parts():
            yield b'{"messages": [{"role": "user", "content": "Say OK."}], '
            sent.set()
            release.wait(60)
            yield b'"max_tokens": 2, "temperature": 0}'
        slow.append(httpx.post(server["base"] + "/v1/chat/completions", headers=auth(0) |
                               {"Content-Type": "application/json"}, content=parts(), timeout=60).status_code)

    t1, t2 = threading.Thread(target=long_stream), threading.Thread(target=slow_body)
    t1.start()
    try:
        assert first_chunk.wait(60)
        t2.start()
        assert sent.wait(60)
        threading.Event().wait(0.2)  # the first part has reached the server
        r = http.post("/v1/chat/completions", json=CHAT)
    finally:
        release.set()
        t1.join()
        t2.join()
    refused(r, 503, "server_busy")
    assert slow == [200]


def test_a_wrong_key_is_401(server):
    r = httpx.get(server["base"] + "/v1/models", headers={"Authorization": "Bearer safety-key-6"})
    refused(r, 401, "invalid_api_key")
    assert httpx.get(server["base"] + "/health").status_code == 200


# --- 3. limits in the right order --------------------------------------------------------------

def test_deeply_nested_json_is_400(http):
    before = requests_served(http)
    for raw in (b"[" * 100_000 + b"]" * 100_000, b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}",
                b'{"max_tokens": ' + b"9" * 5000 + b"}"):
        err = refused(http.post("/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"}),
                      400, "invalid_json")
        assert "Traceback" not in err["message"] and len(err["message"]) < 300
    assert "too deeply" in refused(http.post("/v1/completions", content=b"[" * 200_000), 400, "invalid_json")["message"]
    assert requests_served(http) == before
    assert http.post("/v1/chat/completions", json=CHAT).status_code == 200  # and the server goes on


def test_a_full_queue_refuses_before_reading_the_body(server, http):
    """--parallel 1 --queue 1: one request running, one waiting; the third is refused as soon as its
    headers arrive, though it announced 200 KB and sent none of it."""
    first_chunk, release, waited = threading.Event(), threading.Event(), []

    def long_stream():
        with httpx.Client(base_url=server["base"], headers=auth(0), timeout=60) as c, \
                c.stream("POST", "/v1/completions", json={"prompt": "1, 2, 3, 4, 5,", "max_tokens": 400,
                                                         "temperature": 0, "stream": True}) as r:
            lines = r.iter_lines()
            while not next(lines).startswith("data: "):
                pass
            first_chunk.set()
            release.wait(60)

    def waiter():
        waited.append(httpx.post(server["base"] + "/v1/chat/completions", headers=auth(0), json=CHAT,
                                 timeout=60).status_code)

    t1, t2 = threading.Thread(target=long_stream), threading.Thread(target=waiter)
    t1.start()
    try:
        assert first_chunk.wait(60)
        t2.start()
        for _ in range(500):
            if http.get("/v1/page_local/stats").json()["queue"]["waiting"] == 1:
                break
            threading.Event().wait(0.02)
        with socket.create_connection(("127.0.0.1", server["port"]), timeout=30) as s:
            s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{server['port']}\r\n"
                      f"Authorization: Bearer {KEYS[0]}\r\nContent-Type: application/json\r\n"
                      "Content-Length: 200000\r\n\r\n{\"messages\": ".encode())
            head = b""
            while b"server_busy" not in head:  # times out (and fails) if the server waits for the body
                part = s.recv(4096)
                if not part:
                    break
                head += part
            head = head.decode("latin-1")
    finally:
        release.set()
        t1.join()
        if t2.ident:
            t2.join()
    assert head.startswith("HTTP/1.1 503"), head
    assert "retry-after: 1" in head.lower() and "server_busy" in head
    assert waited == [200]


def test_a_refused_override_leaves_the_slot_as_it_was(server):
    """A key's conversation is evicted for speed (gate always); a request of the same key refused in
    its overrides must not change the slot's bookkeeping: an unrelated chat sharing only the system
    prompt still may not reuse that evicted cache, and the conversation itself goes on from it."""
    conv = [SYSTEM, {"role": "user", "content": PASSAGE + "What colour is the lighthouse?"}]
    a = chat(server, OVERRIDE_KEY, conv, page_local={"gate": "always", "budget": 48})
    assert a["page_local"]["decision"]["evicted"]
    r = httpx.post(server["base"] + "/v1/completions", headers=auth(OVERRIDE_KEY), timeout=60,
                   json={"prompt": "Hi", "max_tokens": 2, "page_local": {"evictor": "nope"}})
    refused(r, 400, "invalid_value")
    unrelated = chat(server, OVERRIDE_KEY, [SYSTEM, {"role": "user", "content": "Name a colour."}])
    assert cached(unrelated) == 0 and not unrelated["page_local"]["cache"]["reused_evicted"]
    conv += [{"role": "assistant", "content": a["choices"][0]["message"]["content"]},
             {"role": "user", "content": "And the bridges?"}]
    goes_on = chat(server, OVERRIDE_KEY, conv)
    assert cached(goes_on) >= a["usage"]["prompt_tokens"] and goes_on["page_local"]["cache"]["reused_evicted"]


def test_a_request_that_fails_after_its_conversation_was_placed_leaves_nothing(server):
    """A conversation refused for not fitting (on_full refuse) fails inside the engine's turn: the slot
    forgets what it held, so no later request reuses a half-prefilled prompt."""
    convo = [{"role": "user", "content": "Tell me a fact about owls."}]
    first = chat(server, FAILED_KEY, convo)  # (with keys, snapshotted as it ends: Slot.park)
    said = [{"role": "assistant", "content": "Owls can turn their heads far."}]
    long = convo + said + [{"role": "user", "content": "word " * 600}]
    r = httpx.post(server["base"] + "/v1/chat/completions", headers=auth(FAILED_KEY), timeout=60,
                   json={"messages": long, "max_tokens": 2, "page_local": {"on_full": "refuse"}})
    refused(r, 400, "context_length_exceeded")
    slot = httpx.get(server["base"] + "/v1/page_local/stats", headers=auth(FAILED_KEY)).json()["slots"][0]
    assert slot["history_tokens"] == 0
    # what the failed request put in the cache is gone: a request sharing its prefix past the first
    # conversation's prompt reuses no more than that prompt (from the first request's own snapshot)
    assert cached(chat(server, FAILED_KEY, convo + said + [{"role": "user", "content": "Say OK."}])) \
        <= first["usage"]["prompt_tokens"]


# --- without a model ---------------------------------------------------------------------------

def test_host_policy():
    p = HostPolicy("127.0.0.1", ["My-PC.lan", "10.0.0.7"])
    assert all(p.allows(h) for h in ["localhost", "localhost:80", "127.0.0.1:8080", "[::1]:1", "my-pc.lan:9",
                                      "MY-PC.LAN.", "10.0.0.7"])
    assert not any(p.allows(h) for h in [None, "", "evil.example", "localhost.evil.example", "10.0.0.8",
                                          "127.0.0.2", "user@localhost", "localhost/x", "localhost:port"])
    wildcard = HostPolicy("0.0.0.0")  # every IP address it listens on; names still only the listed ones
    assert wildcard.allows("192.168.1.20:8080") and wildcard.allows("[fe80::1]") and not wildcard.allows("nas.lan")
    assert HostPolicy("::", ["*"]).allows("anything.example") and HostPolicy(None).allows("testserver")
    assert HostPolicy("my-box").allows("my-box:8080") and HostPolicy("[::1]").allows("[::1]:80")
    with pytest.raises(ValueError, match="not a host name"):
        HostPolicy("127.0.0.1", ["http://x/"])
    assert host_name("[::1]:8080") == "::1" and host_name("::1") == "::1" and host_name("a.b:x") is None


def test_origin_policy():
    hosts = HostPolicy("127.0.0.1")
    p = OriginPolicy(["http://localhost:3000"], hosts)
    assert p.allows("http://localhost:3000", "evil.example")  # configured: whatever the Host
    assert p.allows("http://127.0.0.1:8080", "127.0.0.1:8080") and p.allows("http://localhost", "localhost:80")
    assert not p.allows("http://127.0.0.1:8081", "127.0.0.1:8080")
    assert not p.allows("https://127.0.0.1:8080", "127.0.0.1:8080")
    assert not p.allows("http://evil.example:8080", "evil.example:8080")  # a rebound name is not "own"
    assert not p.allows("null", "127.0.0.1:8080")
    assert not OriginPolicy([], HostPolicy(None)).allows("http://testserver", "testserver")
    assert OriginPolicy(["*"], hosts).allows("https://anything.example", "127.0.0.1")
    assert origin_of("HTTP://LocalHost:3000/") == "http://localhost:3000" and origin_of("localhost:3000") is None
    assert origin_of("http://x/path") is None and origin_of("*") == "*"


@pytest.mark.parametrize("args, needle", [
    (["--allow-host", "http://my-pc.lan/"], "--allow-host"),
    (["--cors-origin", "localhost:3000"], "--cors-origin"),
    (["--api-key", "has space"], "printable ASCII"),
    (["--api-key-file", "{empty}"], "holds no key"),
    (["--api-key-file", "{missing}"], "cannot read --api-key-file"),
    (["--host", "0.0.0.0"], "--api-key"),
], ids=["allow-host-url", "cors-origin-no-scheme", "key-with-space", "empty-key-file", "missing-key-file",
        "public-bind-without-key"])
def test_bad_options_are_one_line(tmp_path, monkeypatch, args, needle):
    from page_local.cli import main

    monkeypatch.delenv("PAGE_LOCAL_API_KEY", raising=False)
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing here\n\n")
    args = [a.format(empty=empty, missing=tmp_path / "missing.txt") for a in args]
    res = CliRunner().invoke(main, ["serve", "--model", "fake.gguf", *args])
    one_line_error(res, 2, needle)
    assert "Traceback" not in res.output
