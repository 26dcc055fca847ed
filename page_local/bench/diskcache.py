"""The disk cache of prompt prefixes, measured (issue 56): the time to the first token of a question about a document
asked again after a restart, in a new conversation, side by side in one run:

  read        page-local reading the whole prompt (no disk cache)
  first       page-local's first read with the disk cache on (what writing costs: the copy to host memory, save_ms,
              timed on its own as well: the first read's ratio to `read` moves with the machine's noise)
  disk        a new engine on the same folder (a restart, a new chat), another question: the document restored
  memory      page-local's in-memory prompt cache (serve's slot cache: a snapshot restored and rewound)
  stock       stock llama-server reading the whole prompt (flash attention on and off, the better one)
  stock-slot  stock llama-server's manual slot restore (--slot-save-path, POST /slots/0?action=save|restore after a
              restart): the best its users can do today

Each is one prompt (a document of real prose from Debian's licences, then a question), greedy, one new token.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from page_local.errors import BenchError

LICENSES = ("GPL-3", "GPL-2", "LGPL-3", "Apache-2.0", "MPL-2.0", "GFDL-1.3", "Artistic", "LGPL-2.1")
Q1 = "\n\nQuestion: what is the name of the first licence above? Answer:"
Q2 = "\n\nQuestion: which licence above mentions patents first? Answer:"


def document(model, n_tokens: int) -> list[int]:
    """About n_tokens of real prose (Debian's licence texts), as token ids without the question."""
    text = ""
    for name in LICENSES:
        p = Path("/usr/share/common-licenses") / name
        if p.exists():
            text += p.read_text(encoding="utf-8", errors="replace") + "\n\n"
    toks = model.tokenize(text, add_special=True)
    if len(toks) < n_tokens:
        raise BenchError(f"the licence texts in /usr/share/common-licenses hold {len(toks)} tokens, fewer than "
                         f"{n_tokens}")
    return toks[:n_tokens]


def _ttft(eng, prompt: list[int]) -> tuple[float, list[int]]:
    t0 = time.perf_counter()
    stream = eng.stream(prompt, max_tokens=1)
    for _ in stream:
        break
    dt = time.perf_counter() - t0
    for _ in stream:
        pass
    return dt, stream.result


def measure(model_path: Path, lengths: list[int], threads: int, peer_bin: Path | None, repeats: int = 1,
            n_gpu_layers: int | str | None = None, rpc=None, attention_settings=None) -> list[dict]:
    """Per length, the median seconds of each way. The two engines' pairs (reading again then the in-memory cache;
    the first read with the cache then the restart from it) alternate which goes first, repeat by repeat.
    attention_settings' cache type is stock's too (f16 when none is given)."""
    from page_local import Engine
    from page_local.store.diskcache import DiskCache

    cache_type = attention_settings.cache_type if attention_settings is not None else "f16"
    rows = []
    for n in lengths:
        n_ctx = n + 256
        kw = dict(n_ctx=n_ctx, threads=threads, budget=1.0, gate="never", n_gpu_layers=n_gpu_layers, rpc=rpc,
                  attention_settings=attention_settings)
        row: dict = {"tokens": n, "cache_type": cache_type}
        with Engine(model_path, disk_cache=False, **kw) as e:
            doc = document(e.model, n)
            q1, q2 = e.model.tokenize(Q1, add_special=False), e.model.tokenize(Q2, add_special=False)

        def without():
            with Engine(model_path, disk_cache=False, **kw) as e:
                t, _ = _ttft(e, doc + q2)
                row.setdefault("read", []).append(t)
                e.reset()
                _ttft(e, doc + q1)
                snap = e.snapshot()
                e.reset()
                t0 = time.perf_counter()
                e.restore(snap)  # serve's slot cache: a conversation's snapshot back in the engine, rewound
                e.rewind(len(doc))
                _ttft(e, q2)
                row.setdefault("memory", []).append(time.perf_counter() - t0)

        def with_disk():
            folder = tempfile.mkdtemp(prefix="page-local-bench-kv-")
            disk = DiskCache(folder, max_bytes=1 << 40)
            with Engine(model_path, disk_cache=disk, **kw) as e:
                t, res = _ttft(e, doc + q1)
                row.setdefault("first", []).append(t)
                row.setdefault("save_ms", []).append(res.decision.disk_save_ms)  # what writing adds to it
            row["disk_bytes"] = disk.nbytes()
            with Engine(model_path, disk_cache=DiskCache(folder, max_bytes=1 << 40), **kw) as e:
                t, res = _ttft(e, doc + q2)
                if res.decision.disk_tokens < n - 64:
                    raise BenchError(f"the disk cache restored {res.decision.disk_tokens} of {n} tokens")
                row.setdefault("disk", []).append(t)
            disk.clear()

        for i in range(repeats):
            for step in ((without, with_disk) if i % 2 == 0 else (with_disk, without)):
                step()
        if peer_bin is not None:
            row.update(_stock(peer_bin, model_path, doc, q1, q2, n_ctx, threads, cache_type))
        rows.append({k: statistics.median(v) if isinstance(v, list) else v for k, v in row.items()})
    return rows


def _stock(peer_bin: Path, model_path: Path, doc, q1, q2, n_ctx: int, threads: int, cache_type: str) -> dict:
    from page_local.bench.stock import StockServer

    out = {}
    best = None
    for fa in ("on", "off") if cache_type == "f16" else ("on",):  # a quantized V cache needs flash attention
        with StockServer(peer_bin, model_path, n_ctx, threads, fa, cache_type=cache_type) as s:
            t0 = time.perf_counter()
            s.complete(doc + q2, 1)
            t = time.perf_counter() - t0
        best = t if best is None else min(best, t)
    out["stock"] = best
    slots = tempfile.mkdtemp(prefix="page-local-bench-slots-")
    with StockServer(peer_bin, model_path, n_ctx, threads, "on", cache_prompt=True, slot_save_path=slots,
                     cache_type=cache_type) as s:
        s._request("POST", "/completion", {"prompt": doc + q1, "n_predict": 1, "cache_prompt": True})
        status, _ = s._request("POST", "/slots/0?action=save", {"filename": "doc.bin"})
        if status != 200:
            raise BenchError(f"stock llama-server refused to save its slot (HTTP {status})")
    with StockServer(peer_bin, model_path, n_ctx, threads, "on", cache_prompt=True, slot_save_path=slots,
                     cache_type=cache_type) as s:
        t0 = time.perf_counter()  # after the restart: restore by file name, then the new question
        status, _ = s._request("POST", "/slots/0?action=restore", {"filename": "doc.bin"})
        if status != 200:
            raise BenchError(f"stock llama-server refused to restore its slot (HTTP {status})")
        _, r = s._request("POST", "/completion", {"prompt": doc + q2, "n_predict": 1, "cache_prompt": True})
        out["stock-slot"] = time.perf_counter() - t0
        out["stock-slot-read"] = (r.get("timings") or {}).get("prompt_n")
    return out
