"""Benchmarks that print ratios measured side by side in one run (medians of alternated runs).

Run them alone on the machine: with 2 threads on 2 cores, any other busy process ruins llama.cpp's
thread synchronisation.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from .runtime import Context, ContextConfig, Model

W = 32


def probe_overhead(model_path, tokens: int = 4096, repeats: int = 3, threads: int = 2, seed: int = 0) -> dict:
    """Wall time of a `tokens`-token prefill with and without the probe armed on the last W positions."""
    if tokens <= W:
        raise ValueError(f"--tokens must exceed the probe window ({W}), got {tokens}")
    if repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {repeats}")
    prompt = np.random.default_rng(seed).integers(100, 4000, size=tokens).tolist()
    times: dict[bool, list[float]] = {False: [], True: []}
    with Model(model_path) as model, Context(model, ContextConfig(n_ctx=tokens + 64, threads=threads)) as ctx:
        ctx.decode(prompt[:64], 0, logits="none")  # warm-up: first graph build and allocation
        for i in range(2 * repeats):
            armed = bool(i % 2)
            ctx.clear()
            t0 = time.perf_counter()
            ctx.decode(prompt[: tokens - W], 0, logits="none")
            if armed:
                ctx.page.arm_probe(0, 32)
            ctx.decode(prompt[tokens - W :], tokens - W)
            if armed:
                ctx.page.read_probe()
            times[armed].append(time.perf_counter() - t0)
    armed_s, plain_s = statistics.median(times[True]), statistics.median(times[False])
    return {
        "bench": "probe",
        "tokens": tokens,
        "threads": threads,
        "repeats": repeats,
        "unarmed_s": round(plain_s, 4),
        "armed_s": round(armed_s, 4),
        "ratio": round(armed_s / plain_s, 4),
        "unarmed_runs": [round(t, 4) for t in times[False]],
        "armed_runs": [round(t, 4) for t in times[True]],
    }
