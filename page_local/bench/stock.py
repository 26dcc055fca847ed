"""Stock llama.cpp as the peer of the speed benchmarks: its own `llama-server`, built *unpatched* from the
same pinned upstream tree page-local patches (`make peer-server`, scripts/build-peer.sh), on the same GGUF,
thread count and n_ctx, greedy.

`measure()` starts one server per flash-attention setting ("auto" is llama.cpp's default; "on" and "off"
are the two paths "auto" chooses between), sends the prompt as token ids with `cache_prompt` off (so each
repeat reads the whole prompt), and reads the server's own timings: prompt_ms (the time to first token,
less HTTP) and predicted_per_second (decode). The best configuration is the faster of on and off, per
figure. The server's tokens are returned so that the caller can compare greedy tokens.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import statistics
import subprocess
import threading
import time
from pathlib import Path

from page_local.errors import BenchError

SETTINGS = ("on", "off")


def find_bin(peer_bin: str | os.PathLike | None = None) -> Path | None:
    """The folder holding stock llama-server: peer_bin (an error if it has none), else $PAGE_LOCAL_PEER_BIN
    when set (None if it has none: no peer), else the checkout's build-peer/bin (make peer-server) if built."""
    if peer_bin:
        if not (Path(peer_bin) / "llama-server").is_file():
            raise BenchError(f"--peer-bin {peer_bin}: no llama-server there; `make peer-server` builds it into "
                             "build-peer/bin")
        return Path(peer_bin)
    env = os.environ.get("PAGE_LOCAL_PEER_BIN")
    folder = Path(env) if env is not None else Path(__file__).resolve().parents[2] / "build-peer" / "bin"
    return folder if (folder / "llama-server").is_file() else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class StockServer:
    """llama-server in a child process on a free loopback port, one slot, no web UI."""

    def __init__(self, bin_dir: Path, model: Path, n_ctx: int, threads: int, flash_attn: str,
                 cache_prompt: bool = False, slot_save_path: str | None = None, cache_type: str = "f16"):
        self.port = _free_port()
        cmd = [str(bin_dir / "llama-server"), "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port),
               "-c", str(n_ctx), "-t", str(threads), "-tb", str(threads), "-fa", flash_attn, "-np", "1",
               "--no-webui", "-ctk", cache_type, "-ctv", cache_type] + ([] if cache_prompt else ["--no-cache-prompt"])
        if slot_save_path:  # POST /slots/0?action=save|restore by file name (llama-server's manual slot files)
            cmd += ["--slot-save-path", str(slot_save_path)]
        # (llama.cpp's warm-up stays on: page-local's benches warm up too)
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        self._err: list[str] = []
        threading.Thread(target=lambda: self._err.extend(line.rstrip() for line in self.proc.stderr),
                         daemon=True).start()

    def _request(self, method: str, path: str, body: dict | None = None, timeout: float = 900) -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(method, path, json.dumps(body) if body is not None else None,
                         {"Content-Type": "application/json"})
            r = conn.getresponse()
            data = r.read()
            return r.status, json.loads(data) if data else {}
        finally:
            conn.close()

    def wait_ready(self, timeout: float = 180.0) -> None:
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end:
            if self.proc.poll() is not None:
                raise BenchError(f"stock llama-server exited ({self.proc.returncode}): "
                                 f"{' | '.join(self._err[-3:])}")
            try:
                if self._request("GET", "/health", timeout=5)[0] == 200:
                    return
            except (OSError, ValueError):
                pass
            time.sleep(0.2)
        raise BenchError(f"stock llama-server was not ready within {timeout:.0f} s")

    def complete(self, tokens: list[int], n_predict: int, cache_prompt: bool = False) -> dict:
        """Greedy completion of the token ids: the server's timings and the generated token ids. cache_prompt: the
        slot's cache reused (only what it does not hold is read)."""
        status, out = self._request("POST", "/completion", {
            "prompt": tokens, "n_predict": n_predict, "temperature": 0, "top_k": 1, "cache_prompt": cache_prompt,
            "return_tokens": True, "ignore_eos": True})
        if status != 200:
            raise BenchError(f"stock llama-server: HTTP {status}: {str(out)[:300]}")
        t = out["timings"]
        return {"prompt_n": t["prompt_n"], "prompt_ms": t["prompt_ms"], "decode_tok_s": t["predicted_per_second"],
                "tokens": out.get("tokens", [])}

    def restore_slot(self, filename: str) -> None:
        """POST /slots/0?action=restore of a file in --slot-save-path."""
        status, out = self._request("POST", "/slots/0?action=restore", {"filename": filename})
        if status != 200:
            raise BenchError(f"stock llama-server refused to restore slot file {filename} (HTTP {status}: "
                             f"{str(out)[:200]})")

    def rss_mb(self) -> float | None:
        import psutil

        try:
            return round(psutil.Process(self.proc.pid).memory_info().rss / 2**20, 1)
        except psutil.Error:
            return None

    def chat(self, messages: list[dict], max_tokens: int, cache_prompt: bool = True) -> dict:
        """One greedy chat turn through /v1/chat/completions (the GGUF's own chat template), as a chat app
        sends it: the whole conversation, the slot reusing the prefix it holds when cache_prompt. The server's
        timings: prompt_n (tokens read), prompt_ms (the time to first token, less HTTP), decode tok/s."""
        status, out = self._request("POST", "/v1/chat/completions", {
            "messages": messages, "max_tokens": max_tokens, "temperature": 0, "top_k": 1,
            "cache_prompt": cache_prompt})
        if status != 200:
            raise BenchError(f"stock llama-server: HTTP {status}: {str(out)[:300]}")
        t = out["timings"]
        return {"prompt_n": t["prompt_n"], "prompt_ms": t["prompt_ms"], "decode_tok_s": t["predicted_per_second"],
                "gen_tokens": t["predicted_n"], "content": out["choices"][0]["message"]["content"]}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> StockServer:
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def measure(bin_dir: Path, model: Path, prompt: list[int], n_ctx: int, new_tokens: int, repeats: int,
            threads: int) -> dict:
    """Stock llama.cpp on both flash-attention paths, {"on": ..., "off": ...}: per path the medians of TTFT
    (prompt_ms) and decode tok/s over `repeats` completions. llama.cpp's "auto" (its default) resolves to on wherever the backend
    has the flash-attention op (the CPU backend and GPUs); the caller picks the best path per figure."""
    paths: dict[str, dict] = {}
    for setting in SETTINGS:
        with StockServer(bin_dir, model, n_ctx, threads, setting) as srv:
            runs = [srv.complete(prompt, new_tokens) for _ in range(repeats)]
            rss = srv.rss_mb()
        if any(r["prompt_n"] != len(prompt) for r in runs):
            raise BenchError(f"stock llama-server read {runs[0]['prompt_n']} of {len(prompt)} prompt tokens "
                             "(cache_prompt off should read them all)")
        paths[setting] = {
            "ttft_s": round(statistics.median(r["prompt_ms"] for r in runs) / 1e3, 3),
            "decode_tok_s": round(statistics.median(r["decode_tok_s"] for r in runs), 2),
            "ttft_runs_s": [round(r["prompt_ms"] / 1e3, 3) for r in runs],
            "decode_runs": [round(r["decode_tok_s"], 2) for r in runs],
            "rss_mb": rss, "_tokens": runs[0]["tokens"],
        }
    return paths


def measure_filled(bin_dir: Path, model: Path, prompt: list[int], cells: int, seed_state, n_ctx: int,
                   new_tokens: int, repeats: int, threads: int) -> dict:
    """measure() from a cache filled from a state (bench/fill.py): per path a slot file of prompt[:cells] whose
    cells repeat seed_state's (V transposed for flash attention off, as llama.cpp lays it out there), restored
    before every completion of the whole prompt, which then reads the len(prompt) - cells tokens left. TTFT is
    not measured (None); decode tok/s and the server's RSS are."""
    import tempfile

    from page_local.bench import fill

    paths: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="page-local-bench-fill-") as slots:
        for setting in SETTINGS:
            fill.write_slot_file(Path(slots) / "filled.bin", prompt[:cells],
                                 fill.repeat_to(seed_state, cells, v_trans=setting == "off"))
            with StockServer(bin_dir, model, n_ctx, threads, setting, cache_prompt=True, slot_save_path=slots) as srv:
                runs = []
                for _ in range(repeats):
                    srv.restore_slot("filled.bin")
                    runs.append(srv.complete(prompt, new_tokens, cache_prompt=True))
                rss = srv.rss_mb()
            read = {r["prompt_n"] for r in runs}
            if read != {len(prompt) - cells}:
                raise BenchError(f"stock llama-server read {sorted(read)} prompt tokens after restoring {cells} cells "
                                 f"of {len(prompt)} (expected {len(prompt) - cells}): the slot file was not used")
            paths[setting] = {
                "ttft_s": None,
                "decode_tok_s": round(statistics.median(r["decode_tok_s"] for r in runs), 2),
                "ttft_runs_s": [], "decode_runs": [round(r["decode_tok_s"], 2) for r in runs],
                "rss_mb": rss, "_tokens": runs[0]["tokens"],
            }
    return paths
