"""KNorm (Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression",
arXiv 2406.11430): keep the keys with the LOWEST L2 norm.

Key-norm scales differ by layer and head, so the norms are reduced with Z-MEAN
(docs/algorithms.md §0.2, §2.4): standardize each (layer, kv head) over the evictable positions,
average, keep the lowest. Sinks and the window are protected (kvpress protects nothing).
"""

from __future__ import annotations

import numpy as np

from page_local.evictors.base import EvictionInput, Evictor, aligned_layer_rows


class KNorm(Evictor):
    name = "knorm"
    needs = frozenset({"key_norms"})

    def score(self, inp: EvictionInput) -> np.ndarray:
        norms = aligned_layer_rows(inp.key_norms, inp.T, "key_norms", ndim=3)  # (n_layer, n_head_kv, T)
        comp = norms.reshape(-1, inp.T)  # one row per (layer, kv head)
        evictable = ~inp.protected()
        z = np.zeros_like(comp)
        if evictable.any():
            part = comp[:, evictable]
            std = part.std(axis=1, keepdims=True)
            # A constant component carries no ranking information: it contributes 0.
            z[:, evictable] = np.divide(part - part.mean(axis=1, keepdims=True), std,
                                        out=np.zeros_like(part), where=std > 0)
        return -z.mean(axis=0)  # low norm = high score
