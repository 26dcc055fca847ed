"""TOVA (Oren et al., "Transformers are Multi-State RNNs", arXiv 2401.06104).

Score = attention of the LAST prompt token (a window of one query), mean over heads then layers
(docs/algorithms.md §2.3). The last held position is forced kept, as in kvpress's TOVAPress; sinks
and the window are protected as for every evictor here. Prefill-time only.
"""

from __future__ import annotations

import numpy as np

from page_local.evictors.base import EvictionInput, Evictor, probe_scores


class TOVA(Evictor):
    name = "tova"
    needs = frozenset({"last_query"})

    def protected(self, inp: EvictionInput) -> np.ndarray:
        mask = inp.protected()
        if mask.sum() < inp.budget:  # normally the window holds it; never exceed B to force it
            mask[-1] = True
        return mask

    def score(self, inp: EvictionInput) -> np.ndarray:
        return probe_scores(inp.last_query, inp.held).mean(axis=0)
