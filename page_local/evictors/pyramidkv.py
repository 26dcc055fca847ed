"""PyramidKV (Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information
Funneling", arXiv 2406.02069): lower layers get larger budgets than upper layers.

A per-layer budget cannot be realised when one KV cell serves every layer, so (docs/algorithms.md
§0.2, §2.5) the per-layer SnapKV scores are combined into one order:

* reduce="rankunion" (default): with K = B - |protected| slots and the linear schedule b_l
  (beta = 20, layer 0 largest, mean K), order positions by min_l rank_l(j) / b_l and keep the
  first K: the union of every layer's top picks, proportionally to its budget.
* reduce="weighted": PAGE's `pyramidkv` policy, a layer-weighted mean of the per-layer scores with
  weights linspace(2.0, 0.5, L).
"""

from __future__ import annotations

import numpy as np

from page_local.evictors.base import EvictionInput, Evictor, pool1d, probe_scores
from page_local.evictors.snapkv import pool_outside_window

REDUCES = ("rankunion", "weighted")


def layer_budgets(K: int, n_evictable: int, n_layer: int, beta: float = 20.0) -> np.ndarray:
    """f64 (n_layer,): PyramidKV's linear schedule with mean K, capped by the evictable count."""
    min_num = K / beta
    max_num = 2 * K - min_num
    if max_num >= n_evictable:
        max_num = float(n_evictable)
        min_num = 2 * K - max_num
    if n_layer == 1:
        return np.array([float(K)])
    return max_num - np.arange(n_layer) * (max_num - min_num) / (n_layer - 1)


class PyramidKV(Evictor):
    name = "pyramidkv"
    needs = frozenset({"probe"})

    def __init__(self, reduce: str = "rankunion", beta: float = 20.0, pool: str = "none", kernel: int = 5):
        if reduce not in REDUCES:
            raise ValueError(f"reduce must be one of {', '.join(REDUCES)}; got {reduce!r}")
        if not np.isfinite(beta) or beta < 1:
            raise ValueError(f"beta must be a finite number >= 1, got {beta!r}")
        pool1d(np.zeros(1), pool, kernel)
        self.reduce, self.beta, self.pool, self.kernel = reduce, float(beta), pool, kernel

    def layer_scores(self, inp: EvictionInput) -> np.ndarray:
        """f64 (n_layer, T): per-layer SnapKV scores (head-mean window attention), pooled if asked."""
        return pool_outside_window(probe_scores(inp.probe, inp.held), inp, self.pool, self.kernel)

    def score(self, inp: EvictionInput) -> np.ndarray:
        per_layer = self.layer_scores(inp)
        L = per_layer.shape[0]
        if self.reduce == "weighted":
            w = np.linspace(2.0, 0.5, L)
            return w @ per_layer / w.sum()
        protected = self.protected(inp)
        evictable = np.flatnonzero(~protected)
        K = inp.budget - int(protected.sum())
        b = layer_budgets(max(K, 1), evictable.size, L, self.beta)  # (L,)
        # 1-based rank of every evictable position in every layer; ties go to the lower position.
        order = np.argsort(-per_layer[:, evictable], axis=1, kind="stable")
        rank = np.empty_like(order)
        np.put_along_axis(rank, order, np.arange(1, evictable.size + 1)[None, :], axis=1)
        kappa = (rank / b[:, None]).min(axis=0)  # (n_evictable,) smaller = kept earlier
        score = np.zeros(inp.T)
        score[evictable] = -kappa
        return score
