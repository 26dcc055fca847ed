"""Time one prompt's reading through page-local's Context and print a digest of the last logits.

    .venv/bin/python scripts/prefill_time.py TOKENS on|off [REPEATS]

N random token ids are read in 512-token batches (n_ctx = N + 64, 2 threads); prints each run's seconds, the
median, tokens per second and the first 12 hex digits of the last logits' SHA-1. Run it alone, alternating
PAGE_LOCAL_MATMUL=llama.cpp / PAGE_LOCAL_FA_KERNEL=llama.cpp with page-local's default to compare the prefill
kernels (docs/design.md section 6.2): the digests must match. $M selects another GGUF (default: the embedded
SmolLM2), $TYPE_KV the cache type (f16, q8_0, q4_0; default f16).
"""

import hashlib
import os
import sys
import time

import numpy as np

from page_local.native.runtime import Context, ContextConfig, Model
from page_local.store import models

n, fa = int(sys.argv[1]), sys.argv[2]
reps = int(sys.argv[3]) if len(sys.argv) > 3 else 1
toks = np.random.default_rng(0).integers(100, 4000, size=n).tolist()
with Model(os.environ.get("M") or models.smollm2_path()) as m, \
        Context(m, ContextConfig(n_ctx=n + 64, threads=2, flash_attn=fa,
                                 type_kv=os.environ.get("TYPE_KV", "f16"))) as c:
    ts = []
    for _ in range(reps):
        c.clear()
        t = time.perf_counter()
        for i in range(0, n, 512):
            c.decode(toks[i:i + 512], i, logits="last" if i + 512 >= n else "none")
        ts.append(time.perf_counter() - t)
    digest = hashlib.sha1(c.logits(-1).tobytes()).hexdigest()[:12]
    print(f"n={n} fa={fa} kv={os.environ.get('TYPE_KV', 'f16')} s={[round(x, 2) for x in ts]} median={np.median(ts):.2f} "
          f"tok/s={n / np.median(ts):.1f} logits={digest}")
