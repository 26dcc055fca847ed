"""The conversation as the engine records it beside the cache: which token came when, where it sits.

The KV cache holds cells by position; eviction and room-making remove some of them and closing gaps
renumbers the rest. The Transcript keeps what the cache cannot tell: every token of sequence 0 in order
(evicted ones included), the position each was decoded at (its index until gaps are closed), and which of
them room-making evicted (as opposed to the speed budget). The Engine owns one; room-making (room.py) and
the decode loop (generation.py) are handed it explicitly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Transcript:
    history: list[int] = field(default_factory=list)  # tokens of sequence 0, in order
    pos: list[int] = field(default_factory=list)  # the position of each history token
    # history indices evicted to make room; None: not known (a conversation restored from a snapshot, which
    # does not record why its cells went)
    room_out: set[int] | None = field(default_factory=set)

    def __len__(self) -> int:
        return len(self.history)

    def clear(self) -> None:
        self.history, self.pos, self.room_out = [], [], set()

    def extend(self, toks: list[int], pos0: int) -> None:
        """toks decoded at pos0, pos0 + 1, ..."""
        self.history.extend(toks)
        self.pos.extend(range(pos0, pos0 + len(toks)))

    def append(self, tok: int, pos: int) -> None:
        self.history.append(tok)
        self.pos.append(pos)

    def truncate(self, n: int) -> None:
        """Forget everything after the first n tokens."""
        del self.history[n:], self.pos[n:]
        if self.room_out:
            self.room_out = {i for i in self.room_out if i < n}

    def tokens_at(self, held: np.ndarray) -> np.ndarray:
        """i64 (len(held),): the token each held position holds (held: ascending positions of the cache)."""
        if not held.size:
            return np.zeros(0, np.int64)
        return np.asarray(self.history, dtype=np.int64)[self.indices_of(held)]

    def indices_of(self, held) -> np.ndarray:
        """i64 (len(held),): the history index of each held position. After gaps are closed an evicted token
        shares the position of the next held one (room.renumber) and comes before it: the last index with
        that position is the held token."""
        return np.searchsorted(np.asarray(self.pos, dtype=np.int64), np.asarray(held, dtype=np.int64),
                               side="right") - 1

    def marks(self, held) -> np.ndarray:
        """bool (len(history),): the tokens at these cache positions (ascending)."""
        out = np.zeros(len(self.history), dtype=bool)
        if len(held):
            out[self.indices_of(held)] = True
        return out

    def room_marks(self) -> np.ndarray | None:
        """bool (len(history),): the tokens room-making evicted; None when that is not known."""
        if self.room_out is None:
            return None
        out = np.zeros(len(self.history), dtype=bool)
        out[[i for i in self.room_out if i < out.size]] = True
        return out
