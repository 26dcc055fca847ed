"""SnapKV (Li et al., "SnapKV: LLM Knows What You Are Looking for Before Generation", arXiv 2404.14469).

Score of a position = attention it receives from the last W prompt queries (the observation
window), mean over window queries, query heads and layers: the shared-cell MEAN reduction, which is
exactly PAGE's shared-mask SnapKV (docs/algorithms.md §1.3, §5.3). No pooling by default (PAGE);
`pool="avg"|"max"` with an odd `kernel` smooths the mean score along positions, as the original does
per head, over the non-window positions only (SnapKV pools the prefix).
"""

from __future__ import annotations

import numpy as np

from page_local.evictors.base import EvictionInput, Evictor, pool1d, probe_scores


class SnapKV(Evictor):
    name = "snapkv"
    needs = frozenset({"probe"})

    def __init__(self, pool: str = "none", kernel: int = 5):
        pool1d(np.zeros(1), pool, kernel)  # validate the options now, not at the first eviction
        self.pool = pool
        self.kernel = kernel

    def score(self, inp: EvictionInput) -> np.ndarray:
        score = probe_scores(inp.probe, inp.held).mean(axis=0)  # f64 (T,)
        return pool_outside_window(score, inp, self.pool, self.kernel)


def pool_outside_window(score: np.ndarray, inp: EvictionInput, pool: str, kernel: int) -> np.ndarray:
    """f64 (..., T): `score` with the non-window positions pooled along the last axis."""
    if pool == "none" or kernel == 1:
        return score
    prefix = ~np.isin(inp.held, inp.window)
    out = np.array(score, dtype=np.float64)
    out[..., prefix] = pool1d(out[..., prefix], pool, kernel)
    return out
