"""PAGE's head-agreement drop D (Kumar & Mishra, arXiv 2609.22157; docs/algorithms.md §5.1).

Per layer l, every query head h has a top-k set S_{l,h} of the positions its window attention
favours (ProbeResult.topk_pos). The layer agreement is the mean pairwise Jaccard

    alpha_l = mean over the H(H-1)/2 head pairs (a, b) of |S_a ∩ S_b| / |S_a ∪ S_b|

(0 for a pair of empty sets, as in PAGE's `jaccard`), and

    D = mean(alpha[:third]) - mean(alpha[L - third:]),   third = max(1, L // 3).

A large D (heads agree early, disagree late) marks a dilution-prone input where eviction is safe.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from page_local.probe import ProbeResult


@dataclass(frozen=True)
class Signal:
    agreement: np.ndarray  # f64 (n_layer,)  alpha_l
    D: float  # early-minus-late agreement drop


def _topk(x: ProbeResult | np.ndarray) -> np.ndarray:
    tp = x.topk_pos if isinstance(x, ProbeResult) else x
    tp = np.asarray(tp)
    if tp.ndim != 3:
        raise ValueError(f"topk_pos must have shape (n_layer, n_head, k), got {tp.shape}")
    L, H, k = tp.shape
    if L < 1 or H < 2 or k < 1:
        raise ValueError(f"topk_pos needs >= 1 layer, >= 2 heads and k >= 1, got shape {tp.shape}")
    if not np.issubdtype(tp.dtype, np.integer):
        raise ValueError(f"topk_pos must hold integer positions, got dtype {tp.dtype}")
    return tp


def layer_agreement(topk_pos: np.ndarray) -> np.ndarray:
    """f64 (n_layer,): mean pairwise Jaccard of the heads' top-k sets.

    topk_pos: i32 (n_layer, n_head, k), -1 = padding. ValueError for < 1 layer, < 2 heads or k < 1.
    """
    tp = _topk(topk_pos)
    L, H, k = tp.shape
    # Number the distinct positions of each layer 0..U_l-1 (sort, then count value changes), so
    # that each head's set becomes a one-hot row of width H*k and one batched matrix product gives
    # every pairwise intersection.
    flat = tp.reshape(L, H * k).astype(np.int64)
    valid = flat >= 0
    flat = np.where(valid, flat, np.iinfo(np.int64).max)  # padding sorts last and is dropped below
    order = np.argsort(flat, axis=1)
    srt = np.take_along_axis(flat, order, axis=1)
    change = np.ones_like(srt, dtype=np.int64)
    change[:, 1:] = srt[:, 1:] != srt[:, :-1]
    local = np.empty_like(order)
    np.put_along_axis(local, order, np.cumsum(change, axis=1) - 1, axis=1)  # (L, H*k)
    onehot = np.zeros((L, H, H * k), dtype=np.float32)  # duplicates collapse: set semantics
    rows = np.arange(L * H).repeat(k).reshape(L, H * k)  # (layer, head) row of each entry
    onehot.reshape(L * H, H * k)[rows[valid], local[valid]] = 1.0
    inter = (onehot @ onehot.transpose(0, 2, 1)).astype(np.float64)  # (L, H, H), exact small counts
    size = np.diagonal(inter, axis1=1, axis2=2)  # (L, H)
    union = size[:, :, None] + size[:, None, :] - inter
    a, b = np.triu_indices(H, 1)
    i, u = inter[:, a, b], union[:, a, b]  # (L, n_pairs)
    jac = np.divide(i, u, out=np.zeros_like(i), where=u > 0)
    return jac.mean(axis=1)


def drop_from_agreement(agreement: np.ndarray) -> float:
    """D from per-layer agreement f64 (n_layer,): first third minus last third (PAGE's gate script)."""
    alpha = np.asarray(agreement, dtype=np.float64)
    if alpha.ndim != 1 or alpha.size < 1:
        raise ValueError(f"agreement must be a non-empty 1-D array, got shape {alpha.shape}")
    L = alpha.size
    third = max(1, L // 3)
    return float(alpha[:third].mean() - alpha[L - third :].mean())


def compute_signal(topk_pos_or_probe: ProbeResult | np.ndarray) -> Signal:
    """Agreement per layer and D for one probe (or its topk_pos i32 (n_layer, n_head, k))."""
    alpha = layer_agreement(_topk(topk_pos_or_probe))
    return Signal(agreement=alpha, D=drop_from_agreement(alpha))


def drop(topk_pos_or_probe: ProbeResult | np.ndarray) -> float:
    """D for one probe (or its topk_pos i32 (n_layer, n_head, k)); -1 entries are padding."""
    return compute_signal(topk_pos_or_probe).D
