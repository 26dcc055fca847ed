"""The disk cache of prompt prefixes through `page-local serve` (engine/prefixes.py, serve/slots.py): a document one
server read is restored by the next server on the same folder (a restart), told in usage.prompt_tokens_details.
cached_tokens and page_local.cache.disk_tokens, through the OpenAI route (the official `openai` client) and the
Ollama one (/api/chat); the answer is the one a server without a disk cache gives; and an API key never gets
another key's document, whatever order the keys are given in after the restart.

Real servers on 127.0.0.1 (uvicorn in a thread over Backend(Settings(disk_cache=...))), the embedded SmolLM2, one
slot and no RAM snapshots (cache_bytes 0), so that a conversation comes back from the disk or from nowhere."""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx", reason="the test extra (openai, httpx) is not installed")
openai = pytest.importorskip("openai", reason="the test extra (openai) is not installed")
uvicorn = pytest.importorskip("uvicorn", reason="the [serve] extra is not installed")
pytest.importorskip("starlette", reason="the [serve] extra is not installed")

from page_local.serve.app import create_app  # noqa: E402
from page_local.serve.backend import Backend, Settings  # noqa: E402
from page_local.serve.bench import free_port  # noqa: E402
from page_local.store.diskcache import DiskCache  # noqa: E402

pytestmark = pytest.mark.slow

DOC = open("/usr/share/common-licenses/GPL-3", encoding="utf-8").read()[:7000]  # ~1.5K SmolLM2 tokens
Q1 = "\n\nQuestion: what is this license called? Answer briefly."
Q2 = "\n\nQuestion: which foundation published it? Answer briefly."
Q3 = "\n\nQuestion: may I copy it? Answer briefly."
KEY_A, KEY_B = "disk-key-alice-0123", "disk-key-bob-4567"
MAX_TOKENS = 12


@contextlib.contextmanager
def serving(model_path, disk: DiskCache | None, keys: list[str]):
    """A live server (one slot, no RAM snapshots) until the block ends; yields its base URL."""
    backend = Backend(Settings(model_path=Path(model_path), served_name="smollm2", n_ctx=4096, threads=1, gate="never",
                               parallel=1, cache_bytes=0, api_keys=keys, disk_cache=disk, host="127.0.0.1"))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(backend), host="127.0.0.1", port=port, log_level="warning",
                                           access_log=False, lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)  # not the main thread: uvicorn leaves signals alone
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        t_end = time.monotonic() + 120
        while True:
            assert thread.is_alive() and backend.error is None, backend.error or "the server stopped"
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(base + "/health", timeout=5).status_code == 200:
                    break
            assert time.monotonic() < t_end, "the server did not become ready"
            time.sleep(0.05)
        yield base
    finally:
        server.should_exit = True
        thread.join(60)
        assert not thread.is_alive(), "the server did not stop"


def ask(base: str, key: str, question: str):
    """(answer text, prompt tokens, cached_tokens, page_local.cache) of one chat completion by the openai client."""
    client = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=120)
    r = client.chat.completions.create(model="smollm2", temperature=0, max_tokens=MAX_TOKENS,
                                       messages=[{"role": "user", "content": DOC + question}])
    cache = r.model_extra["page_local"]["cache"]
    return r.choices[0].message.content, r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens, cache


def ask_ollama(base: str, key: str, question: str):
    """(answer text, prompt_eval_count, page_local.cache) of one /api/chat (Ollama's route), not streamed."""
    r = httpx.post(base + "/api/chat", headers={"Authorization": f"Bearer {key}"}, timeout=120, json={
        "model": "smollm2", "stream": False, "messages": [{"role": "user", "content": DOC + question}],
        "options": {"temperature": 0, "num_predict": MAX_TOKENS}})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["message"]["content"], body["prompt_eval_count"], body["page_local"]["cache"]


def test_a_restarted_server_restores_the_document_from_disk(smollm2_path, tmp_path):
    folder = tmp_path / "kv"
    with serving(smollm2_path, DiskCache(folder, max_bytes=1 << 30), [KEY_A, KEY_B]) as base:
        _, n_first, cached, cache = ask(base, KEY_A, Q1)
    assert cached == 0 and cache["disk_tokens"] == 0  # nothing on disk yet: read whole, then written
    assert n_first > 1200

    # the restart: a new process would see the same folder; the keys in another order (a key's documents
    # follow the key, not its place on the command line)
    with serving(smollm2_path, DiskCache(folder, max_bytes=1 << 30), [KEY_B, KEY_A]) as base:
        a_text, a_n, a_cached, a_cache = ask(base, KEY_A, Q2)
        b_text, _, b_cached, b_cache = ask(base, KEY_B, Q2)
        o_text, o_n, o_cache = ask_ollama(base, KEY_A, Q3)  # B's conversation replaced A's: A's comes from disk

    assert a_cache["disk_tokens"] >= 1000 and a_cached >= a_cache["disk_tokens"]
    assert a_cached < a_n  # the question after the document was read
    assert b_cached == 0 and b_cache["disk_tokens"] == 0  # key B does not get key A's document
    assert o_cache["disk_tokens"] >= 1000

    with serving(smollm2_path, None, [KEY_A]) as base:  # the same questions on a server without a disk cache
        fresh_text, fresh_n, fresh_cached, fresh_cache = ask(base, KEY_A, Q2)
        fresh_o_text, fresh_o_n, _ = ask_ollama(base, KEY_A, Q3)
    assert fresh_cached == 0 and fresh_cache["disk_tokens"] == 0
    assert (a_n, o_n) == (fresh_n, fresh_o_n)
    assert a_text == fresh_text == b_text  # restored or read whole: the same greedy answer
    assert o_text == fresh_o_text
