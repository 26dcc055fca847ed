"""H2O (Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language
Models", arXiv 2306.14048).

Heavy hitters = positions with the largest attention accumulated over ALL prompt queries
(column sums during prefill, head-mean, then mean over layers). The keep set is the H2O 50/50 split
(docs/algorithms.md §2.2): n_sink sinks + the most recent floor((B - n_sink) / 2) held positions
(never fewer than the window, which is always kept) + heavy hitters for the rest.
"""

from __future__ import annotations

import numpy as np

from page_local.evictors.base import EvictionInput, Evictor, aligned_layer_rows


class H2O(Evictor):
    name = "h2o"
    needs = frozenset({"prefill_attention"})

    def protected(self, inp: EvictionInput) -> np.ndarray:
        mask = inp.protected()
        n_recent = (inp.budget - inp.n_sink) // 2
        if n_recent > 0:
            mask[-n_recent:] = True
        return mask  # the recent tail contains the window, so |mask| = n_sink + max(W, n_recent) <= B

    def score(self, inp: EvictionInput) -> np.ndarray:
        acc = aligned_layer_rows(inp.prefill_attention, inp.T, "prefill_attention", ndim=2)
        return acc.mean(axis=0)
