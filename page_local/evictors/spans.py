"""Span keeping: cells are kept a sentence at a time (issue 43; the idea of ChunkKV, Liu et al., "ChunkKV:
Semantic-Preserving KV Cache Compression for Efficient Long-Context LLM Inference", arXiv 2502.00299).

Per-cell scores keep the words a question's queries look at and lose the ones next to them that the
answer needs: room-making ranked by SnapKV pooled over 15 neighbours kept a fact's key ("The alarm code for
the crisp anchor warehouse is") and lost its value's last digits, because the digits receive little of the
question's attention (in 21 evictions of 7 questions at 4x n_ctx 512, ~395 candidates and 168 kept, the
last digit ranked 109-382, the key's best word 3-18 but once) and the centred window averages the value's
tail with the next sentence's (docs/design.md §5.1). Here the unit is the span: a sentence (what a reader
keeps of a document), at most `max_span` cells. Each span's score is the SnapKV score summed over its held
cells (the attention it receives in all); spans are kept whole, best first, while they fit in the budget;
what is left of it goes to the best single cells of the spans that did not fit. Sum rather than max or
mean: the highest single cells of every sentence are " the", "." and newlines, which every sentence has;
in 24 evictions of 8 questions at 4x n_ctx 512 the asked fact's sentence ranked 5th by sum (median), 9th
by max and 18th by mean. Measured (eval longdoc, 24 questions each, SmolLM2): 16/24 at 4x n_ctx 512 against
6/24 pooled, 20/24 at 4x n_ctx 1024 against 10/24 (the full cache 20/24).

Remembered scores (prior "max", the default): a message longer than the context is read in parts with a cut
between them, and each cut ranks every held cell again by the question's queries, decoded after the newest part.
A fact's sentence read early ranks lower at each cut as the question moves away from it (at 4x n_ctx 512 the
asked fact's sentence went from 3rd-6th at its first cut to 16th-17th at the seventh, and out, traced with
scripts/trace_room.py: SmolLM2's attention falls with distance), so 35 of 100 facts were lost by the last cut. With EvictionInput.prior (the
best score room-making saw for each cell at an earlier cut of the same message) a cell's score is the larger of
the two: every cell is judged at least as it was when its part was the newest, at the same distance from the
question as the last part's cells are at the last cut. prior "none" ranks by the current probe only (the
ranking before; the evaluation's "room-spans" rows).

Needs the probe and `spans` (EvictionInput.spans: the span of each held position, which room-making
computes from the conversation's token text: sentence_spans).
"""

from __future__ import annotations

import re
from typing import Callable, Sequence

import numpy as np

from page_local.evictors.base import EvictionInput, Evictor, probe_scores

AGGS = ("sum", "max", "mean")
PRIORS = ("max", "none")  # how a cell's remembered score (EvictionInput.prior) joins its current one
MAX_SPAN = 64  # a "sentence" longer than this (code, a list without stops) is cut into pieces of it
# a piece ending a sentence: a stop, possibly followed by closing quotes or brackets, then spaces
_END = re.compile(r"[.!?][\"')\]\u201d\u2019]*\s*$")


def sentence_spans(pieces: Sequence[str], is_control: Callable[[int], bool] | None = None,
                   max_span: int = MAX_SPAN) -> np.ndarray:
    """i64 (n,): the span of each token, counted from 0 in order. A span ends after a token whose text ends
    a sentence (".", "!" or "?", closing quotes allowed), holds a newline, or is a control token (index i
    for which is_control(i)); and after max_span tokens without such an end."""
    cut = SentenceCut(max_span)
    cut.extend(pieces, [bool(is_control(i)) for i in range(len(pieces))] if is_control is not None else None)
    return cut.ids


class SentenceCut:
    """sentence_spans kept up to date as a sequence grows: a token's span depends only on the tokens before it,
    so the pieces appended since the last call are cut from where the cut stopped (a chat's sentences at a
    message cost what the message added, not the whole conversation: 57 ms at 17.8K tokens before, AMD Zen 4)."""

    def __init__(self, max_span: int = MAX_SPAN):
        if isinstance(max_span, bool) or not isinstance(max_span, int) or max_span < 1:
            raise ValueError(f"max_span must be an int >= 1, got {max_span!r}")
        self.max_span = max_span
        self._ids = np.zeros(0, dtype=np.int64)
        self._ids.setflags(write=False)
        self._span, self._length = 0, 0
        self._done: list[str] = []  # the text of each ended span
        self._open: list[str] = []  # the pieces of the span not yet ended

    @property
    def ids(self) -> np.ndarray:
        """i64 (n,): the span of every token so far (read-only)."""
        return self._ids

    @property
    def texts(self) -> list[str]:
        """The text of each span so far, control tokens left out (a span of control tokens only is "")."""
        return self._done + ["".join(self._open)] if self._length else list(self._done)

    def extend(self, pieces: Sequence[str], control: Sequence[bool] | None = None) -> None:
        """Cut the next pieces (control[i]: whether piece i is a control token)."""
        if not len(pieces):
            return
        new = np.zeros(len(pieces), dtype=np.int64)
        span, length, done, open_ = self._span, self._length, self._done, self._open
        for i, p in enumerate(pieces):
            new[i] = span
            length += 1
            ctl = control is not None and control[i]
            if not ctl:
                open_.append(p)
            if length >= self.max_span or "\n" in p or _END.search(p) or ctl:
                span, length = span + 1, 0
                done.append("".join(open_))
                open_.clear()
        self._span, self._length = span, length
        self._ids = np.concatenate([self._ids, new])
        self._ids.setflags(write=False)


class SnapKVSpans(Evictor):
    """SnapKV's score (unpooled), kept a span at a time (see the module docstring)."""

    name = "snapkv-spans"
    needs = frozenset({"probe", "spans"})

    def __init__(self, agg: str = "sum", prior: str = "max"):
        if agg not in AGGS:
            raise ValueError(f"agg must be one of {', '.join(AGGS)}; got {agg!r}")
        if prior not in PRIORS:
            raise ValueError(f"prior must be one of {', '.join(PRIORS)}; got {prior!r}")
        self.agg, self.prior = agg, prior

    def score(self, inp: EvictionInput) -> np.ndarray:
        s = probe_scores(inp.probe, inp.held).mean(axis=0)  # f64 (T,)
        if self.prior == "max" and inp.prior is not None:
            s = np.maximum(s, inp.prior)
        return s

    def select(self, inp: EvictionInput) -> np.ndarray:
        if inp.T <= inp.budget:
            return inp.held.copy()
        self.check_needs(inp)
        keep = self.protected(inp)
        k = inp.budget - int(keep.sum())
        if k < 0:
            raise ValueError(f"budget {inp.budget} is smaller than the {int(keep.sum())} protected positions")
        return inp.held[keep_spans(self.score(inp), inp.spans, keep, k, self.agg)].astype(np.int32)


def keep_spans(score: np.ndarray, spans: np.ndarray, protected: np.ndarray, k: int, agg: str = "sum") -> np.ndarray:
    """bool (T,): `protected` plus exactly min(k, unprotected) more cells: whole spans by their aggregated
    score, best first, those that fit; then the best single cells of the rest. score f64 (T,), spans i64
    (T,) span ids (equal ids: one span, need not be contiguous), protected bool (T,). Ties go to the lower
    position (the first span, the first cell)."""
    keep = protected.copy()
    cand = np.flatnonzero(~protected)
    if k >= cand.size:
        keep[cand] = True
        return keep
    s, ids = score[cand], spans[cand]
    if np.isnan(s).any():
        raise ValueError("scores contain NaN")
    uniq, first, inv, size = np.unique(ids, return_index=True, return_inverse=True, return_counts=True)
    if agg == "sum":
        span_score = np.bincount(inv, weights=s, minlength=uniq.size)
    elif agg == "mean":
        span_score = np.bincount(inv, weights=s, minlength=uniq.size) / size
    else:
        span_score = np.full(uniq.size, -np.inf)
        np.maximum.at(span_score, inv, s)
    # best span first; equal scores: the span that starts first
    order = np.lexsort((first, -span_score))
    taken = np.zeros(uniq.size, dtype=bool)
    left = k
    for j in order:
        if size[j] <= left:
            taken[j] = True
            left -= int(size[j])
            if not left:
                break
    chosen = taken[inv]
    if left:  # the budget's remainder: the best cells of the spans that did not fit
        rest = np.flatnonzero(~chosen)
        best = rest[np.argsort(-s[rest], kind="stable")[:left]]
        chosen[best] = True
    keep[cand[chosen]] = True
    return keep
