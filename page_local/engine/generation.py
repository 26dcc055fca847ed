"""The decode loop of one answer, as its own object (as mlx-lm's generate_step is): sample, hand the piece
out, decode it, until the end of generation, max_tokens or a full context.

Two hooks plug the rest of the engine in, and the loop knows nothing else of it:
- `check`, the verify cap (selfcheck.SelfCheck): while it is pending the loop keeps the full cache's logits
  of each step; it is called once, when the answer ends inside the span (with the end token), when the
  answer reaches check.cap tokens, or when the loop ends first ("length");
- `room`, room for a growing answer: called when the next token would not fit (cells or the trained
  context); True when room was made, False to end the answer (finish "context"). Never while a check is
  pending: its candidate shares these cells. `parked()`: how many cells parking holds besides the answer's
  sequence (they fill the cache too).

The piece goes out before its token is decoded (as llama-server sends it): the first token is not held back
by a decode step. A loop closed at a piece's yield decodes that token then, so what the caller has seen is
in the cache (finish "interrupted").
"""

from __future__ import annotations

import codecs
import time
from typing import Callable, Iterator

import numpy as np

from page_local.engine.transcript import Transcript
from page_local.native.sampler import sample


def token_logprobs(logits: np.ndarray, tok: int, n: int) -> tuple[int, float, list[tuple[int, float]]]:
    """(tok, log p(tok), the n most likely tokens with theirs, most likely first) under f32 (n_vocab,)
    logits, in f64."""
    z = logits.astype(np.float64)
    z -= z.max()
    lp = z - np.log(np.exp(z).sum())
    top = np.argpartition(-lp, n)[:n] if 0 < n < lp.size else np.arange(lp.size if n else 0)
    top = top[np.argsort(-lp[top], kind="stable")]
    return int(tok), float(lp[tok]), [(int(t), float(lp[t])) for t in top]


class AnswerLoop:
    """One answer on sequence 0 of ctx. Iterate it for text pieces; then .out (token ids), .finish
    ("stop" | "length" | "context" | "interrupted"), .seconds, and .logprobs (one entry per token handed
    out, when logprobs is set: token_logprobs' triple)."""

    def __init__(self, ctx, model, conv: Transcript, sampler, max_tokens: int, pos_limit: int,
                 logprobs: int | None = None, check=None, room: Callable[[], bool] | None = None,
                 record: list | None = None, parked: Callable[[], int] | None = None):
        self.ctx, self.model, self.conv, self.sampler = ctx, model, conv, sampler
        self.max_tokens, self.pos_limit, self.n_logprobs = max_tokens, pos_limit, logprobs
        self.check, self.room = check, room
        self.parked = parked or (lambda: 0)
        self.out: list[int] = []
        self.logprobs: list = [] if record is None else record  # record: a list the caller reads as it grows
        self.finish = "length"
        self.seconds = 0.0
        self.times: list[float] = []  # the loop's clock after each token decoded (selfcheck.Payback times a step)

    def _checked(self, full_logits: list[np.ndarray], **how) -> None:
        self.check(self.out, full_logits, **how)
        self.check = None

    def __iter__(self) -> Iterator[str]:
        ctx, model, out = self.ctx, self.model, self.out
        full_logits: list[np.ndarray] = []  # f32 (n_vocab,) of the full cache at each step, while checking
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        t0 = time.perf_counter()
        used = ctx.cells_used(0) + self.parked()  # kept up to date below: no native scan of the cells per token
        pending = None  # (token, position) handed out but not decoded yet
        try:
            for _ in range(self.max_tokens):
                if self.check is not None:
                    full_logits.append(ctx.logits())
                want_lp = self.n_logprobs is not None
                logits = (full_logits[-1] if self.check is not None else ctx.logits()) if want_lp else None
                tok = sample(self.sampler, ctx)
                if model.is_eog(tok):
                    self.finish = "stop"
                    if self.check is not None and out:  # the answer ended inside the span: checked, end included
                        self._checked(full_logits, end=tok)
                    break
                pos = ctx.seq_pos_max(0) + 1
                if used + 1 > ctx.n_ctx or pos >= self.pos_limit:
                    # the answer outgrew the context: room from earlier turns, or the answer ends here
                    if self.check is not None or self.room is None or not self.room():
                        self.finish = "context"
                        break
                    used, pos = ctx.cells_used(0) + self.parked(), ctx.seq_pos_max(0) + 1
                if want_lp:
                    self.logprobs.append(token_logprobs(logits, tok, self.n_logprobs))
                piece = decoder.decode(model.token_to_piece(tok))
                pending = (tok, pos)
                if piece:
                    yield piece
                pending = None
                ctx.decode([tok], pos, 0)
                self.times.append(time.perf_counter() - t0)
                used += 1
                self.conv.append(tok, pos)
                out.append(tok)
                if self.check is not None and len(out) == self.check.cap:  # the cap: decide on what there is
                    self._checked(full_logits, until="cap")
                    used = ctx.cells_used(0) + self.parked()
            if self.check is not None and out:  # max_tokens or a full context before the cap: what there is
                self._checked(full_logits[: len(out)], until="length")
            tail = decoder.decode(b"", final=True)
            if tail:
                yield tail
        except (GeneratorExit, KeyboardInterrupt):
            self.finish = "interrupted"
            if pending is not None:  # closed at a piece's yield: what the caller has seen goes in the cache
                tok, pos = pending
                ctx.decode([tok], pos, 0)
                self.conv.append(tok, pos)
                out.append(tok)
            raise
        finally:
            self.seconds = time.perf_counter() - t0
