"""What a forced chunk of the check costs per token, by batch size and attention path (issue 42's note).

The check teacher-forces the answer on the evicted copy in chunks of 4, 8, 16... tokens. With flash attention on
(page-local's default path, whose decode kernel serves one-token steps) a chunk of 2..63 tokens runs llama.cpp's
per-row flash-attention path (`one_chunk`: neither the split-KV decode kernel nor the tiled prompt kernel), which
at a few thousand cells, every one visible (as here: a copy of the whole sequence), costs more per token than a
one-token step; with flash attention off a chunk is cheaper per token than a step. (The check's own candidate sees
a quarter of the cells, and that path skips masked ones: docs/benchmarks.md, "Parking".) page-local now reads
2..63 rows with its own row kernel (docs/design.md, section 6.1); 40 and 63 at once are a short chat message read
over the conversation. To compare with an earlier library, run it with PAGE_LOCAL_LIB_DIR=DIR and
LD_LIBRARY_PATH=DIR (libllama finds ggml by its build tree's RUNPATH otherwise). Run alone:

    python scripts/forced_batch_cost.py [--cells 2800] [--threads 1] [--sizes 1,4,8,16,40,63] [--paths on,off]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from page_local.engine.engine import Engine
from page_local.store.models import resolve


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--cells", type=int, default=2800)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sizes", default="1,4,8,16,40,63", help="tokens at once, comma-separated")
    ap.add_argument("--paths", default="on,off", help="flash attention on, off or both")
    a = ap.parse_args()
    sizes = [int(x) for x in a.sizes.split(",")]
    for fa in a.paths.split(","):
        with Engine(resolve(a.model), n_ctx=a.cells + 256, budget=1.0, threads=a.threads, autotune=False,
                    flash_attn=fa) as eng:
            toks = np.random.default_rng(0).integers(100, 4000, size=a.cells).tolist()
            eng.pipeline.prefill(toks, 0, 0)
            per = {}
            for n in sizes:
                runs = []
                for _ in range(a.repeats):
                    eng.ctx.seq_cp(0, 1, -1, a.cells)  # a copy sharing the cells, as the check's candidate
                    t0 = time.perf_counter()
                    eng.pipeline.decode(toks[:n], a.cells, 1, logits="all")
                    runs.append((time.perf_counter() - t0) * 1e3 / n)
                    eng.ctx.seq_rm(1, -1, -1)
                per[n] = statistics.median(runs)
            print(f"flash attention {fa}, {a.cells} cells, {a.threads} thread(s): ms per token "
                  + ", ".join(f"{n} at once {v:.1f}" for n, v in per.items()))


if __name__ == "__main__":
    main()
