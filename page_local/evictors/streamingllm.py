"""StreamingLLM (Xiao et al., "Efficient Streaming Language Models with Attention Sinks", arXiv 2309.17453).

Keep the n_sink attention sinks and the most recent B - n_sink held positions (the budget-filling
definition of kvpress's StreamingLLMPress, docs/algorithms.md §2.1). Positions are not re-indexed.
"""

from __future__ import annotations

import numpy as np

from page_local.evictors.base import EvictionInput, Evictor


class StreamingLLM(Evictor):
    name = "streamingllm"
    needs = frozenset()

    def score(self, inp: EvictionInput) -> np.ndarray:
        return inp.held.astype(np.float64)  # later = more recent = kept first
