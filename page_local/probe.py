"""What the attention probe returns: plain numpy data, no native handles.

The probe (csrc/page-probe.cpp) is armed for one decode of a window of W queries and reports, for
every layer l and query head h,

    s[l, h, p] = mean over the window's queries of softmax_p(q . k_p * scale + mask)

over the positions p the sequence can see. Positions are token positions (llama_pos), never KV
cell indices.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ProbeResult:
    positions: np.ndarray  # i32 (n_pos,)                visible positions, ascending
    queries: np.ndarray  # i32 (n_query,)                positions of the window's queries
    mean: np.ndarray  # f32 (n_layer, n_pos)             head-mean score of positions[i] in layer l
    topk_pos: np.ndarray  # i32 (n_layer, n_head, k)     by descending score; -1 = padding
    topk_score: np.ndarray  # f32 (n_layer, n_head, k)   their scores; 0 for padding
    rows: np.ndarray | None = None  # f32 (n_layer, n_head, n_pos) full per-head scores, if requested

    @property
    def n_layer(self) -> int:
        return int(self.topk_pos.shape[0])

    @property
    def n_head(self) -> int:
        return int(self.topk_pos.shape[1])

    @property
    def top_k(self) -> int:
        return int(self.topk_pos.shape[2])

    @property
    def n_query(self) -> int:
        return int(self.queries.shape[0])

    def column(self, pos: int) -> int:
        """Index of position `pos` in `positions` (ValueError if it is not visible)."""
        i = int(np.searchsorted(self.positions, pos))
        if i >= len(self.positions) or self.positions[i] != pos:
            raise ValueError(f"position {pos} is not among the probe's visible positions")
        return i
