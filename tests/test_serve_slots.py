"""One loaded model for every slot of `page-local serve --parallel N` (issue 29, item 4):

  1. Engines built on a loaded Model borrow it: each has its own context, closing one leaves the Model (and
     the other engine) working, and a closed Model is refused with a clear error;
  2. the Backend loads the model once: every slot's engine holds the same Model, closed once with the slots;
  2b. the slots take turns on the CPU (native/runtime.Turns): a prefill alone, decode steps together;
  3. a live server with --parallel 2 maps the GGUF file once (one copy of the weights, not one per slot),
     and two concurrent requests, one per slot, give the greedy answers a single engine gives.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest

from page_local.engine.engine import Engine
from page_local.native.runtime import Model, Turns

N_CTX = 512


# --- 1. engines on a shared Model ------------------------------------------------------------------

def test_engines_borrow_a_shared_model(smollm2):
    prompt = "The capital of France is"
    with Engine(smollm2, n_ctx=N_CTX, threads=1, gate="never", flash_attn="off") as a, \
            Engine(smollm2, n_ctx=N_CTX, threads=1, gate="never", flash_attn="off") as b:
        assert a.model is smollm2 and b.model is smollm2
        assert a.ctx.ptr != b.ctx.ptr  # a context (and KV cache) each
        ref = a.generate(prompt, max_tokens=8)
        a.close()
        assert not smollm2.closed  # borrowed: the engine left it to its owner
        out = b.generate(prompt, max_tokens=8)
        assert out.tokens == ref.tokens and out.text == ref.text
    assert not smollm2.closed
    assert smollm2.tokenize("still usable")


def test_an_engine_on_a_closed_model_is_refused(smollm2_path):
    m = Model(smollm2_path)
    m.close()
    assert m.closed
    with pytest.raises(ValueError, match="the shared Model is closed"):
        Engine(m, n_ctx=N_CTX, threads=1)


# --- 2. the backend loads the model once -----------------------------------------------------------

def test_the_backend_loads_one_model_for_its_slots(smollm2_path):
    pytest.importorskip("starlette", reason="the [serve] extra is not installed")
    from page_local.serve.backend import Backend, Settings

    backend = Backend(Settings(model_path=Path(smollm2_path), served_name="smollm2", n_ctx=N_CTX, threads=1,
                               parallel=2))
    done = threading.Event()
    errors: list[str] = []
    backend.start_loading(on_ready=done.set, on_error=lambda e: (errors.append(e), done.set()))
    assert done.wait(120) and not errors, errors
    try:
        model = backend.model
        assert [s.engine.model for s in backend.slots] == [model, model]
        assert all(s.engine.model is model for s in backend.slots)
        assert backend.slots[0].engine.ctx.ptr != backend.slots[1].engine.ctx.ptr
        assert isinstance(model.compute_turns, Turns)  # the slots' prefills take turns on the cores
    finally:
        backend.close()
    assert model.closed and backend.model is None  # closed once, after the slots' engines


# --- 2b. the slots' turns on the CPU: prefills alone, decode steps together --------------------------

def _holder(turns: Turns, alone: bool, inside: threading.Event, leave: threading.Event) -> threading.Thread:
    def run():
        with turns.take(alone=alone):
            inside.set()
            leave.wait(10)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_decode_steps_share_the_cores():
    turns = Turns()
    a_in, b_in, leave = threading.Event(), threading.Event(), threading.Event()
    workers = [_holder(turns, False, a_in, leave), _holder(turns, False, b_in, leave)]
    assert a_in.wait(5) and b_in.wait(5)  # both inside at once
    leave.set()
    for w in workers:
        w.join(5)


def test_a_prefill_runs_alone_and_is_not_starved_by_decode_steps():
    turns = Turns()
    d_in, d_leave = threading.Event(), threading.Event()
    decode = _holder(turns, False, d_in, d_leave)
    assert d_in.wait(5)
    p_in, p_leave = threading.Event(), threading.Event()
    prefill = _holder(turns, True, p_in, p_leave)
    assert not p_in.wait(0.3)  # it waits for the running decode step
    late_in, late_leave = threading.Event(), threading.Event()
    late = _holder(turns, False, late_in, late_leave)
    assert not late_in.wait(0.3)  # a new decode step waits behind the waiting prefill
    d_leave.set()
    assert p_in.wait(5)  # the prefill goes first ...
    assert not late_in.wait(0.3)  # ... alone
    p_leave.set()
    assert late_in.wait(5)  # then the decode step
    late_leave.set()
    for w in (decode, prefill, late):
        w.join(5)


def test_two_prefills_do_not_overlap():
    turns = Turns()
    a_in, a_leave, b_in, b_leave = (threading.Event() for _ in range(4))
    a = _holder(turns, True, a_in, a_leave)
    assert a_in.wait(5)
    b = _holder(turns, True, b_in, b_leave)
    assert not b_in.wait(0.3)
    a_leave.set()
    assert b_in.wait(5)
    b_leave.set()
    for w in (a, b):
        w.join(5)


# --- 3. a live server with two slots ----------------------------------------------------------------

def gguf_mappings(pid: int, path: Path) -> int:
    """How many mappings of the file process pid has: llama.cpp mmaps a GGUF once per llama_model it loads
    (from the tensor data's offset; measured: one line per load, two after two loads)."""
    target = str(Path(path).resolve())
    with open(f"/proc/{pid}/maps") as f:
        return sum(1 for line in f if (parts := line.split(maxsplit=5)) and len(parts) == 6
                   and parts[5].strip() == target)


def test_two_slots_one_model_and_the_engines_answers(smollm2_path):
    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc/PID/maps (Linux)")
    httpx = pytest.importorskip("httpx", reason="the test extra (httpx) is not installed")
    openai = pytest.importorskip("openai", reason="the test extra (openai) is not installed")
    pytest.importorskip("uvicorn", reason="the [serve] extra is not installed")
    from page_local.chat.template import ChatTemplate
    from page_local.serve.bench import free_port
    from tests.test_serve import KEY, start_server, stop_server, wait_ready

    chats = [[{"role": "user", "content": "What is the capital of France? Answer briefly."}],
             [{"role": "user", "content": "Name three colours of the rainbow."}]]
    with Engine(smollm2_path, n_ctx=N_CTX, threads=1, gate="never", flash_attn="off") as eng:
        tpl = ChatTemplate(eng.model, fallback="-")
        refs = [eng.generate(eng.model.tokenize(tpl.render(m), add_special=True), max_tokens=24) for m in chats]
        with_engine = gguf_mappings(os.getpid(), smollm2_path)
    per_model = with_engine - gguf_mappings(os.getpid(), smollm2_path)  # 1; 0 where the weights are read, not mapped

    port = free_port()
    proc = start_server(port, "--model", str(smollm2_path), "--n-ctx", str(N_CTX), "--threads", "1",
                        "--parallel", "2", "--gate", "never", "--flash-attn", "off")
    try:
        wait_ready(proc, port)
        assert gguf_mappings(proc.pid, smollm2_path) == per_model  # one llama_model for both slots
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=120)
        start = threading.Barrier(len(chats))
        out: list = [None] * len(chats)
        spans: list = [None] * len(chats)

        def ask(i: int) -> None:
            start.wait()
            t0 = time.monotonic()
            try:
                out[i] = client.chat.completions.create(model="smollm2", messages=chats[i], max_tokens=24,
                                                        temperature=0)
            except Exception as e:  # noqa: BLE001 -- reported by the assertion below
                out[i] = e
            spans[i] = (t0, time.monotonic())

        workers = [threading.Thread(target=ask, args=(i,)) for i in range(len(chats))]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        for r, ref in zip(out, refs):
            assert not isinstance(r, Exception), r
            assert r.choices[0].message.content == ref.text
            assert r.usage.completion_tokens == len(ref.tokens)
        assert spans[1][0] < spans[0][1] and spans[0][0] < spans[1][1]  # the two requests overlapped
        stats = httpx.get(f"http://127.0.0.1:{port}/v1/page_local/stats",
                          headers={"Authorization": f"Bearer {KEY}"}, timeout=10).json()
        assert [s["history_tokens"] > 0 for s in stats["slots"]] == [True, True]  # a request in each slot
        assert gguf_mappings(proc.pid, smollm2_path) == per_model
    finally:
        stop_server(proc)
