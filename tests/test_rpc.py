"""page-local over llama.cpp's RPC backend, on 127.0.0.1 only (issue 19, docs/rpc.md).

Two ggml-rpc-server processes (CPU devices) on free loopback ports hold most of SmolLM2's layers and
their KV cache; the rest stays local. Everything page-local does must give what a local run gives:
the probe (head-means and top-k, 1e-3 relative), eviction + compaction, greedy tokens with the gate
closed, and self-verification's decisions. A server that is down is one clear error naming its
address; a server killed mid-run is told in one line naming its address (llama.cpp's RPC client then
ends the process: see test_killed_remote_mid_run). The servers are stopped however the tests end.

Every context here uses 1 thread and the servers 1 each: ggml's CPU flash attention splits the keys
between threads, so equal thread counts on both sides are what make the comparison exact.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from page_local.engine import Engine
from page_local.errors import ModelError
from page_local.native import rpc, runtime
from page_local.native.runtime import Context, ContextConfig
from tests.conftest import one_line_error, random_tokens
from tests.test_engine import NOISE, PROMPTS as ENGINE_PROMPTS, needle_prompt

N_GPU = 20  # of SmolLM2's 30 layers + output: 11 stay local, the other 19 and the output go to the servers
PREFIX, W, TOP_K = 200, 32, 32  # 232 cells: what crosses the wire does not depend on the length
THREADS = 1


def _require_rpc():
    try:
        ok = rpc.has_rpc()
    except Exception as e:  # noqa: BLE001  (no library at all: every other test says so too)
        pytest.skip(f"the patched library does not load: {e}")
    if not ok:
        pytest.skip("the library was built without ggml's RPC backend (PAGE_RPC=OFF): `make setup RPC=1`, or "
                    "PAGE_LOCAL_LIB_DIR pointing at a -DPAGE_RPC=ON build")
    exe = rpc.rpc_server_path()
    if exe is None:
        pytest.skip("the library has the RPC backend but no ggml-rpc-server beside it")
    return exe


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the server's process before exec: on Linux, SIGTERM when pytest itself dies (even by SIGKILL),
    so that no server outlives the tests; the fixtures stop them in every other case."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Server:
    """One ggml-rpc-server on a free loopback port, stopped by stop() (idempotent)."""

    def __init__(self, exe):
        for _ in range(5):  # a free port can be taken between the probe and the bind: try another
            self.port = _free_port()
            self.endpoint = f"127.0.0.1:{self.port}"
            self.proc = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(self.port), "-t", str(THREADS)],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                         preexec_fn=_die_with_parent)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    rpc.check_rpc_server(self.endpoint, timeout=2)
                    return
                except ModelError:
                    time.sleep(0.1)
            self.stop()
        raise RuntimeError(f"ggml-rpc-server ({exe}) did not start on a loopback port")

    def bytes_sent(self) -> int:
        """Bytes the server has sent on its open connections so far (the kernel's tcp_info, through ss)."""
        out = subprocess.run(["ss", "-tinH", "state", "established", f"( sport = :{self.port} )"],
                             capture_output=True, text=True, check=True).stdout
        return sum(int(n) for n in re.findall(r"bytes_sent:(\d+)", out))

    def settled_bytes_sent(self, others=()) -> int:
        """bytes_sent summed over this server and `others` once it stops moving (two reads 50 ms apart agree):
        a batch's replies can still be in the socket buffers when the client moves on (under load the full
        suite once read 8 KB short)."""
        read = lambda: sum(s.bytes_sent() for s in (self, *others))
        last = read()
        for _ in range(40):
            time.sleep(0.05)
            now = read()
            if now == last:
                return now
            last = now
        return last

    def stop(self, sig=signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def server_exe():
    return _require_rpc()


@pytest.fixture(scope="module")
def servers(server_exe):
    started = []
    try:
        for _ in range(2):
            started.append(Server(server_exe))
        yield started
    finally:
        for s in started:
            s.stop()


@pytest.fixture(scope="module")
def endpoints(servers):
    return [s.endpoint for s in servers]


def _engine(path, rpc=(), **kw):
    """rpc=() is local whatever $PAGE_LOCAL_RPC says."""
    kw.setdefault("n_ctx", 2048)
    return Engine(path, threads=THREADS, n_gpu_layers=N_GPU if rpc else 0, rpc=list(rpc), **kw)


@pytest.fixture(scope="module")
def pair(smollm2_path, endpoints):
    """(local engine, engine split between local and the two servers), the same settings otherwise."""
    local = _engine(smollm2_path, gate="never")
    try:
        remote = _engine(smollm2_path, rpc=endpoints, gate="never")
    except BaseException:
        local.close()
        raise
    try:
        yield local, remote
    finally:
        remote.close()
        local.close()


def _contexts(pair, **kw):
    cfg = ContextConfig(n_ctx=1024, threads=THREADS, **kw)
    return Context(pair[0].model, cfg), Context(pair[1].model, cfg)


def test_layers_are_split_between_local_and_both_servers(pair, endpoints):
    local, remote = pair
    assert remote.model.rpc == tuple(endpoints)
    split = remote.model.split  # the device of each layer and the output layer (-1: local CPU)
    assert len(split) == 31 and split[:11] == [-1] * 11 and split[-1] == 1
    assert split[11:30].count(0) >= 9 and split[11:30].count(1) >= 9
    p = remote.placement
    assert p["rpc"] == endpoints and p["n_gpu_layers"] == N_GPU
    assert p["layers"].startswith("CPU (11 of 30 layers), RPC") and endpoints[1] in p["layers"]
    assert "+ output" in p["layers"] and "+ output" not in p["kv_cache"]
    assert local.placement["layers"] == "CPU" and "rpc" not in local.placement


def test_llama_cpp_puts_weights_on_both_servers(smollm2_path, endpoints, caplog):
    """Not only our description: llama.cpp's own load log names a model buffer on each server."""
    import logging

    with caplog.at_level(logging.INFO, logger="page_local.llama"):
        with runtime.Model(smollm2_path, n_gpu_layers=N_GPU, rpc=endpoints):
            pass
    lines = [r.getMessage() for r in caplog.records if "model buffer size" in r.getMessage()]
    for ep in endpoints:
        assert any(ep in line for line in lines), lines
    assert any("CPU" in line for line in lines), lines


@pytest.mark.parametrize("flash_attn", ["off", "on"], ids=["flash-off", "flash-on"])
def test_probe_equals_a_local_run(pair, flash_attn):
    tokens = random_tokens(PREFIX + W, seed=3)
    got = []
    for ctx in _contexts(pair, flash_attn=flash_attn):
        with ctx:
            ctx.decode(tokens[:PREFIX], 0, logits="none")
            ctx.page.arm_probe(0, top_k=TOP_K)
            ctx.decode(tokens[PREFIX:], PREFIX)
            got.append(ctx.page.read_probe())
    a, b = got
    assert a.positions.tolist() == b.positions.tolist() == list(range(PREFIX + W))
    assert a.queries.tolist() == b.queries.tolist()
    big = a.mean > 1e-6  # f32 (n_layer, n_pos)
    rel = np.abs(b.mean.astype(np.float64) - a.mean)[big] / a.mean[big]
    assert rel.max() <= 1e-3, f"head-means: max relative error {rel.max():.2e}"
    np.testing.assert_allclose(b.topk_score, a.topk_score, rtol=1e-3, atol=1e-7)
    # the same top-k sets, ties aside: a position that scores clearly above a head's k-th score
    # locally is in the remote run's top-k too, and the other way round
    for (l, h) in np.ndindex(a.topk_pos.shape[:2]):
        for x, y in ((a, b), (b, a)):
            kth = x.topk_score[l, h, -1]
            sure = set(x.topk_pos[l, h][x.topk_score[l, h] > kth * (1 + 2e-3) + 1e-7].tolist())
            assert sure <= set(y.topk_pos[l, h].tolist()), (l, h)


def test_probe_read_back_over_the_wire_is_top_k_and_head_means(pair, servers):
    """A layer on a server is reduced there (ggml_top_k, get_rows, sum_rows: ops RPC sends): the probe
    reads back per layer its per-head top-k cells and scores and one row of head sums, never the
    (n_kv, n_head) sums, let alone the (W, n_kv, n_head) scores. Measured as what the servers send (the
    kernel's byte counters), an armed batch against the same batch unarmed."""
    if shutil.which("ss") is None:
        pytest.skip("needs ss (iproute2) to read the bytes the servers sent from the kernel's tcp_info")
    tokens = random_tokens(PREFIX + W, seed=4)
    _, ctx = _contexts(pair)
    with ctx:
        ctx.decode(tokens[:PREFIX], 0, logits="none")
        sent = []
        for armed in (False, True):
            ctx.seq_rm(0, PREFIX, -1)
            if armed:
                ctx.page.arm_probe(0, top_k=TOP_K)
            before = servers[0].settled_bytes_sent(servers[1:])
            ctx.decode(tokens[PREFIX:], PREFIX)
            ctx.logits()  # llama.cpp reads the logits back lazily: make the batch's traffic complete
            sent.append(servers[0].settled_bytes_sent(servers[1:]) - before)
        ctx.page.read_probe()
    model = pair[1].model
    n_kv = -(-(PREFIX + W) // 256) * 256  # the cells, padded to 256
    remote_layers = sum(1 for d in model.split[:-1] if d >= 0)
    reduced = remote_layers * (model.n_head * TOP_K * (4 + 4) + n_kv * 4)
    rows = remote_layers * model.n_head * n_kv * 4  # what the host-side reduction would read
    extra = sent[1] - sent[0]
    print(f"\nprobe read-back over the wire: {extra} bytes per armed batch ({remote_layers} remote layers x "
          f"({model.n_head} heads x {TOP_K} x 8 B + {n_kv} cells x 4 B) = {reduced}; one row per head would be "
          f"{rows}); unarmed batch: {sent[0]} bytes")
    assert reduced <= extra <= reduced + 4096  # the reductions and a few RPC headers


def test_probe_rows_kept_over_the_wire_equal_a_local_run(pair):
    """Asked for its per-head rows (keep_rows), the probe reads the sums back as before, remote or not."""
    tokens = random_tokens(PREFIX + W, seed=6)
    got = []
    for ctx in _contexts(pair):
        with ctx:
            ctx.decode(tokens[:PREFIX], 0, logits="none")
            ctx.page.arm_probe(0, top_k=TOP_K, keep_rows=True)
            ctx.decode(tokens[PREFIX:], PREFIX)
            got.append(ctx.page.read_probe())
    a, b = got
    assert a.rows is not None and b.rows is not None and a.rows.shape == b.rows.shape
    np.testing.assert_allclose(b.rows, a.rows, rtol=1e-3, atol=1e-7)
    np.testing.assert_allclose(b.mean, a.mean, rtol=1e-3, atol=1e-7)


def test_evict_and_compact_give_a_local_runs_outputs(pair):
    tokens = random_tokens(PREFIX + W, seed=5)
    drop = np.arange(8, PREFIX, 3, dtype=np.int32)  # a third of the middle
    out = []
    for ctx in _contexts(pair):
        with ctx:
            ctx.decode(tokens, 0)
            ctx.page.evict(0, drop)
            ctx.page.compact(0)  # moves the remote layers' K/V with tensor reads and writes over the wire
            last = PREFIX + W - 1
            ctx.seq_rm(0, last, -1)
            ctx.decode(tokens[-1:], last)
            norms = ctx.page.key_norms(0, ctx.model.n_layer, ctx.model.n_head_kv)
            out.append((ctx.page.positions(0), ctx.logits(), norms))
    (pa, la, na), (pb, lb, nb) = out
    assert pa.tolist() == pb.tolist() and len(pa) == PREFIX + W - len(drop)
    assert int(np.argmax(la)) == int(np.argmax(lb))
    np.testing.assert_allclose(lb, la, rtol=1e-3, atol=1e-3 * float(np.abs(la).max()))
    np.testing.assert_allclose(nb, na, rtol=1e-3, atol=1e-6)


PROMPTS = {
    "capital": "The capital of France is",
    "history": "The Industrial Revolution began in Great Britain in the late eighteenth century and spread to "
               "other parts of Europe and North America. Historians still debate why it started in Britain "
               "first; the most common explanations are",
}


@pytest.mark.parametrize("name", list(PROMPTS))
def test_gate_never_greedy_tokens_equal_a_local_run(pair, name):
    local, remote = pair
    for eng in pair:
        eng.reset()
        eng.set_gate("never")
    a = local.generate(PROMPTS[name], max_tokens=24)
    b = remote.generate(PROMPTS[name], max_tokens=24)
    assert b.tokens == a.tokens and b.text == a.text


# one that commits the eviction and two that keep the full cache (the answer ends in the checked span;
# the span reaches the cap), locally
VERIFY_PROMPTS = {"history": (ENGINE_PROMPTS["history"], True), "needle": (needle_prompt(12), False),
                  "summary": (NOISE * 6 + "\nSummarise the text above in one sentence:", False)}


@pytest.mark.parametrize(("prompt", "commits"), list(VERIFY_PROMPTS.values()), ids=list(VERIFY_PROMPTS))
def test_gate_verify_decides_as_a_local_run(pair, prompt, commits):
    got = []
    for eng in pair:
        eng.reset()
        eng.set_gate("verify")
        got.append(eng.generate(prompt, max_tokens=16))
    a, b = got
    da, db = a.decision, b.decision
    assert da.evicted == commits  # the three prompts cover both outcomes
    for field in ("T", "B", "open", "evicted", "kept", "verify_m", "verify_until", "verify_changed"):
        assert getattr(db, field) == getattr(da, field), field
    assert db.D == pytest.approx(da.D, rel=1e-3, abs=1e-6)
    assert db.verify_score == pytest.approx(da.verify_score, rel=1e-3, abs=1e-4)
    assert b.tokens == a.tokens


def test_cli_run_with_rpc_answers_as_locally(cli, endpoints, monkeypatch):
    import json

    monkeypatch.delenv(rpc.RPC_ENV, raising=False)
    common = ["--prompt", PROMPTS["capital"], "--max-tokens", "8", "--gate", "never", "--n-ctx", "512",
              "--threads", str(THREADS), "--json"]
    loc = cli("run", *common, "--n-gpu-layers", "0")
    rem = cli("run", *common, "--rpc", ",".join(endpoints), "--n-gpu-layers", str(N_GPU))
    assert loc.exit_code == 0 and rem.exit_code == 0, rem.output
    a, b = json.loads(loc.stdout), json.loads(rem.stdout)
    assert b["text"] == a["text"] and b["device"]["rpc"] == endpoints
    assert rpc.RPC_ENV not in os.environ  # --rpc is passed down as a value, never written to the environment


def test_cli_chat_with_rpc_answers_as_locally(smollm2_path, endpoints, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from page_local.cli import main

    monkeypatch.setenv("PAGE_LOCAL_HOME", str(tmp_path / "home"))
    monkeypatch.delenv(rpc.RPC_ENV, raising=False)
    args = ["chat", "--model", str(smollm2_path), "--n-ctx", "512", "--threads", str(THREADS), "--max-tokens", "12",
            "--gate", "never"]
    said = []
    for extra in (["--n-gpu-layers", "0"], ["--rpc", ",".join(endpoints), "--n-gpu-layers", str(N_GPU)]):
        res = CliRunner().invoke(main, args + extra, input="What is the capital of France?\n/exit\n")
        assert res.exit_code == 0, res.output
        said.append(res.stdout.splitlines())
    assert all(ep in said[1][0] for ep in endpoints)  # the banner says where the layers are
    # the answer and its status line, the speed aside
    assert [re.sub(r"[\d.]+ tok/s", "", line) for line in said[1][1:]] == \
        [re.sub(r"[\d.]+ tok/s", "", line) for line in said[0][1:]]


def test_cli_rpc_usage_errors(cli):
    res = cli("run", "--prompt", "hi", "--rpc", "localhost")
    assert res.exit_code == 2 and "'localhost' is not HOST:PORT" in res.stderr, res.stderr


def test_rpc_on_a_library_without_it_says_how_to_build_it(cli):
    try:
        has = rpc.has_rpc()
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"the patched library does not load: {e}")
    if has:
        pytest.skip("this library has the RPC backend (the other tests here cover it)")
    one_line_error(cli("run", "--prompt", "hi", "--rpc", "127.0.0.1:50052"), 1, "no RPC backend", "RPC=1")


def test_a_server_that_is_down_is_one_clear_error(smollm2_path, server_exe, cli):
    port = _free_port()  # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(ModelError, match=rf"cannot reach the RPC server at 127\.0\.0\.1:{port}"):
        _engine(smollm2_path, rpc=[f"127.0.0.1:{port}"])
    assert time.monotonic() - t0 < 5
    one_line_error(cli("run", "--prompt", "hi", "--rpc", f"127.0.0.1:{port}"), 1, f"127.0.0.1:{port}")


def test_a_server_that_does_not_answer_times_out_naming_it(smollm2_path, server_exe, monkeypatch):
    """A listening socket that never answers HELLO (a hung host, or a server busy with another client)."""
    monkeypatch.setenv(rpc.RPC_TIMEOUT_ENV, "0.5")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        ep = "127.0.0.1:%d" % s.getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(ModelError, match=rf"the RPC server at {ep} did not answer within 0.5 s"):
            _engine(smollm2_path, rpc=[ep])
        assert time.monotonic() - t0 < 3


_CHILD = textwrap.dedent("""
    import sys
    from page_local.engine import Engine
    from page_local.errors import RemoteLost
    eng = Engine(sys.argv[1], n_ctx=1024, threads=1, gate="never", n_gpu_layers=20, rpc=[sys.argv[2]])
    stream = eng.stream("The Industrial Revolution began in", max_tokens=40)
    try:
        for i, piece in enumerate(stream):
            if i == 3:
                print("MID", flush=True)
                sys.stdin.readline()  # the parent kills the server now
        print("FINISHED", stream.result.finish_reason, flush=True)
    except RemoteLost as e:
        print("RAISED", e, flush=True)
    try:
        eng.generate("more", max_tokens=4)
        print("AGAIN ANSWERED", flush=True)
    except RemoteLost as e:
        print("AGAIN RAISED", e, flush=True)
    eng.close()
    with Engine(sys.argv[1], n_ctx=256, threads=1, gate="never", n_gpu_layers=0, rpc=[]) as local:
        print("LOCAL OK", local.generate("The capital of France is", max_tokens=2).text, flush=True)
""")


def _kill_mid_run(server_exe, argv, started, stdin=False):
    """Start a child on one fresh server (argv(endpoint) -> its command line), SIGKILL the server once
    started(child) has returned what the child printed first, then let the child finish (60 s at most).
    The server and the child are stopped however this ends. Returns (endpoint, returncode, out, err)."""
    srv = Server(server_exe)
    try:
        child = subprocess.Popen(argv(srv.endpoint), stdin=subprocess.PIPE if stdin else None,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            first = started(child)
            srv.stop(signal.SIGKILL)
            if stdin:
                child.stdin.write("go\n")
                child.stdin.flush()
            out, err = child.communicate(timeout=60)
        finally:
            if child.poll() is None:
                child.kill()
                child.communicate()
    finally:
        srv.stop()
    return srv.endpoint, child.returncode, first + out, err


def test_killed_remote_mid_run(smollm2_path, server_exe):
    """A server killed while an answer is being generated: the answer stops with one RemoteLost naming
    the server's address (ggml's RPC client, as csrc/patches/03-rpc.patch leaves it, no longer aborts the
    process), the engine keeps refusing with the same error, closing it works, and a local engine in the
    same process loads and answers."""
    def started(child):
        line = child.stdout.readline()
        if line.strip() != "MID":
            child.kill()
            pytest.fail(f"the child did not reach the middle of its answer: {line!r} {child.communicate()}")
        return ""

    endpoint, rc, out, err = _kill_mid_run(
        server_exe, lambda ep: [sys.executable, "-c", _CHILD, str(smollm2_path), ep], started, stdin=True)
    assert rc == 0, (rc, out, err)
    lines = out.splitlines()
    want = f"lost the RPC server at {endpoint} mid-run"
    assert lines and lines[0].startswith("RAISED") and want in lines[0], out
    assert any(line.startswith("AGAIN RAISED") and want in line for line in lines), out
    assert any(line.startswith("LOCAL OK") and "Paris" in line for line in lines), out
    assert "Traceback" not in err, err


def test_a_lost_server_is_one_line_from_the_cli(smollm2_path, server_exe):
    """`page-local run --rpc` with the server killed during the answer: exit 1, one 'Error:' line naming
    the address, no traceback and no abort."""
    def started(child):
        first = child.stdout.read(8)  # the answer has begun: the server is in use
        assert first, child.communicate()
        return first

    endpoint, rc, out, err = _kill_mid_run(server_exe, lambda ep: [
        sys.executable, "-m", "page_local.cli", "run", "--model", str(smollm2_path), "--rpc", ep, "--gate", "never",
        "--threads", "1", "--n-ctx", "512", "--max-tokens", "400", "--prompt", "The history of the lighthouse begins"],
        started)
    assert rc == 1, (rc, out, err)
    errors = [line for line in err.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1 and f"lost the RPC server at {endpoint} mid-run" in errors[0], err
    assert "Traceback" not in err and "GGML" not in err, err


def test_this_process_stays_local_after_the_servers(smollm2_path, servers, pair):
    """The remote devices belonged to the RPC models only (llama_model_params.devices, never the
    process-wide list): with every server gone, a new engine here loads and answers locally."""
    pair[1].close()
    assert not rpc.in_use
    for s in servers:
        s.stop()
    with _engine(smollm2_path, n_ctx=256, gate="never") as eng:
        assert eng.placement["layers"] == "CPU"
        assert eng.generate(PROMPTS["capital"], max_tokens=2).text.startswith(" Paris")


def test_rpc_server_command_starts_the_built_server(server_exe):
    """`page-local rpc-server --port P` runs the ggml-rpc-server of this build on loopback: it answers
    page-local's HELLO, and SIGTERM stops it (the command execs the server, so the signal reaches it)."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "page_local.cli", "rpc-server", "--port", str(port), "--threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_die_with_parent)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                rpc.check_rpc_server(f"127.0.0.1:{port}", timeout=2)
                break
            except ModelError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
                time.sleep(0.2)
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=20)
    assert f"page-local rpc-server: 127.0.0.1:{port}" in err and f"--rpc 127.0.0.1:{port}" in err, err
    assert "warning" not in err  # loopback: no network warning


def test_serve_answers_a_lost_server_with_an_error_and_keeps_running(smollm2_path, server_exe):
    """`page-local serve --rpc`: with its server killed, a request gets one 503 naming the address (no
    traceback in the log), and the HTTP server itself stays up."""
    httpx = pytest.importorskip("httpx", reason="the test extra (httpx) is not installed")
    from page_local.serve.bench import free_port
    from tests.test_serve import start_server, stop_server, wait_ready

    srv = Server(server_exe)
    port = free_port()
    proc = start_server(port, "--model", str(smollm2_path), "--rpc", srv.endpoint, "--n-ctx", "512",
                        "--threads", "1", "--gate", "never", key=None)
    try:
        wait_ready(proc, port)
        ask = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 4, "temperature": 0}
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        assert httpx.post(url, json=ask, timeout=60).status_code == 200
        srv.stop(signal.SIGKILL)
        r = httpx.post(url, json=ask, timeout=60)
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["code"] == "rpc_server_lost" and f"lost the RPC server at {srv.endpoint}" in err["message"]
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
        assert proc.poll() is None
    finally:
        srv.stop()
        stop_server(proc)
    log = proc.stdout.read()
    assert "Traceback" not in log, log
