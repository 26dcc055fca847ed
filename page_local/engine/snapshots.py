"""A conversation's cache copied to host memory and put back: Engine.snapshot / Engine.restore, the save and load
of a chat (chat/session.py, store/persist.py: the file), and the point room-making returns to when a message it
was making room for is interrupted (room.RoomMaker.fit's save / back).

A snapshot holds sequence 0's cells (llama.cpp's sequence state) and the Transcript beside them (every token, the
position of each), the parked cells and their scores (engine/parking.py), and how far this conversation's answers
went past the check (selfcheck.Payback). A restore is all or nothing: a snapshot the cache cannot take leaves the
conversation as it was before the call (StateFileError says why).
"""

from __future__ import annotations

from typing import Callable

from page_local.engine.parking import Parking
from page_local.engine.selfcheck import Payback
from page_local.engine.transcript import Transcript
from page_local.errors import StateFileError
from page_local.store.persist import Snapshot


class Snapshots:
    """Snapshots of one engine's conversation: its context's sequence 0, the Transcript, the parked cells and the
    answers' payback, the objects the Engine owns and hands over here once. reset(): the Engine's own (it forgets
    the conversation in every part). cache_words: the engine's attention settings in words, told when llama.cpp
    refuses a state saved under others."""

    def __init__(self, ctx, conv: Transcript, parking: Parking, payback: Payback, model_id: str,
                 reset: Callable[[], None], cache_words: str):
        self.ctx, self.conv, self.parking, self.payback = ctx, conv, parking, payback
        self.model_id, self.reset, self.cache_words = model_id, reset, cache_words

    def take(self) -> Snapshot:
        """The conversation's cache and token history, copied to host memory."""
        conv = self.conv
        parked, scores, parked_state = self.parking.saved()
        return Snapshot(model_id=self.model_id, n_ctx=self.ctx.n_ctx, history=tuple(conv.history),
                        positions=tuple(int(p) for p in self.ctx.page.positions(0)), state=self.ctx.seq_state(0),
                        history_pos=None if conv.pos == list(range(len(conv.pos))) else tuple(conv.pos),
                        parked_state=parked_state, parked=parked, parked_scores=scores,
                        answers_after=tuple(self.payback.after))

    def check(self, snap: Snapshot) -> None:
        """StateFileError, before anything is touched, for a snapshot of another model or one too large for this
        context."""
        if snap.model_id != self.model_id:
            raise StateFileError(f"the cache was saved with another model ({snap.model_id}), not the loaded one "
                                 f"({self.model_id})")
        n_ctx = self.ctx.n_ctx
        if len(snap.positions) + len(snap.parked) > n_ctx:
            raise StateFileError(f"the cache holds {len(snap.positions) + len(snap.parked)} cells; this engine's "
                                 f"n_ctx is {n_ctx}")

    def restore(self, snap: Snapshot) -> None:
        """Replace the conversation with snap (checked). StateFileError if the cache cannot take it; the
        conversation is then the one before the call. In an engine that does not park, cells a parking engine set
        aside come back at once (no message here would bring them back)."""
        before = self.take() if self.conv.history else None
        why = None
        self.reset()
        try:
            self.ctx.set_seq_state(snap.state, 0)
            if tuple(int(p) for p in self.ctx.page.positions(0)) != snap.positions:
                why = "the restored cache does not hold the saved positions"
            elif not self.parking.load(snap.parked, snap.parked_scores, snap.parked_state):
                why = "the restored cache does not hold the saved parked positions"
        except Exception as e:  # noqa: BLE001 -- llama.cpp's refusal, told in the message
            why = (f"llama.cpp refused the cache: {e} ({self.cache_words}; a cache saved under another flash-attention "
                   "setting or cache type restores only under that one: --flash-attn / --cache-type)")
        if why is None:
            self._transcript(snap, None if len(snap.positions) < len(snap.history) else set())
            self.payback.after = list(snap.answers_after)[-Payback.RECENT:]
            if not self.parking.on and self.parking.count():
                self.parking.unpark(self.conv, 0)
            return
        self.reset()
        if before is not None:  # put the conversation back as it was
            self.ctx.set_seq_state(before.state, 0)
            self._transcript(before, set())
            self.parking.load(before.parked, before.parked_scores, before.parked_state)
        raise StateFileError(why)

    def point(self) -> tuple:
        """Where the conversation is now, to come back to with back() (room.RoomMaker.fit's save)."""
        conv = self.conv
        return self.take() if conv.history else None, None if conv.room_out is None else set(conv.room_out)

    def back(self, point: tuple) -> None:
        """The conversation as it was at point (room.RoomMaker.fit's back: a message that never happened)."""
        before, room_out = point
        self.reset()
        if before is not None:
            self.restore(before)
            self.conv.room_out = room_out

    def _transcript(self, snap: Snapshot, room_out: set | None) -> None:
        """The Transcript of snap, in place: the room-making, generation and pipeline parts hold this object."""
        conv = self.conv
        conv.history, conv.pos, conv.room_out = list(snap.history), positions(snap), room_out


def positions(snap: Snapshot) -> list[int]:
    """The position of each history token of a snapshot (its index unless gaps were closed)."""
    return list(snap.history_pos) if snap.history_pos else list(range(len(snap.history)))
