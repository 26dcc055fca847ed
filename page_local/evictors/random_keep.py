"""Random keep: protected positions + a uniform sample without replacement of the rest.

The prompt-compression baseline of docs/algorithms.md §3.3 (cf. Random Attention, arXiv 2609.03430,
and kvpress's RandomPress). One sample shared by all layers and heads; deterministic for a seed.
"""

from __future__ import annotations

import numpy as np

from page_local.evictors.base import EvictionInput, Evictor


class RandomKeep(Evictor):
    name = "random"
    needs = frozenset()

    def select(self, inp: EvictionInput) -> np.ndarray:
        if inp.T <= inp.budget:
            return inp.held.copy()
        keep = inp.protected()
        k = inp.budget - int(keep.sum())
        if k < 0:
            raise ValueError(f"budget {inp.budget} is smaller than the {int(keep.sum())} protected positions")
        candidates = np.flatnonzero(~keep)
        rng = np.random.default_rng(inp.seed)
        keep[rng.choice(candidates, size=k, replace=False)] = True
        return inp.held[keep].astype(np.int32)
