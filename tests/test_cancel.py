"""A prefill stopped by its cancel flag (Engine.set_cancel, what the server sets when a client goes away):
it stops between batches, raises Cancelled, and leaves the conversation as it was, so that the next
turn answers as if the cancelled one had never been sent. On the embedded SmolLM2, greedy."""

from __future__ import annotations

import threading

import pytest

from page_local.engine.engine import Engine
from page_local.errors import Cancelled

FIRST = "The sky over the harbour was grey. Say one word about it."
NEXT = " And the sea?"
# about 600 tokens: two batches of n_batch 512 before the probe window
LONG = " ".join(f"Shelf {i} holds {i % 7 + 2} blue jars and {i % 5 + 1} brown bottles." for i in range(45))


class SetAfter:
    """A flag that reads as set from its (n + 1)-th question on."""

    def __init__(self, n: int):
        self.n, self.calls = n, 0

    def is_set(self) -> bool:
        self.calls += 1
        return self.calls > self.n


def test_a_cancelled_prefill_leaves_the_conversation_as_it_was(smollm2_path):
    with Engine(smollm2_path, n_ctx=1024, threads=2, gate="never") as eng:
        list(eng.stream(FIRST, max_tokens=4))
        snap = eng.snapshot()
        history, positions = list(eng.history), eng.ctx.page.positions(0).tolist()
        ref = eng.stream(NEXT, max_tokens=6, add_special=False)
        ref_text = "".join(ref)

        eng.restore(snap)
        flag = SetAfter(1)
        eng.set_cancel(flag)
        stream = eng.stream(LONG, max_tokens=4, add_special=False)
        with pytest.raises(Cancelled):
            next(stream)
        assert flag.calls == 2  # one batch (n_batch tokens of the message) decoded, stopped before the second
        assert eng.history == history and eng.ctx.page.positions(0).tolist() == positions  # nothing of it is left
        with pytest.raises(Cancelled):  # the flag still reads as set: the next prefill stops before its first batch
            next(eng.stream(NEXT, max_tokens=6, add_special=False))

        eng.set_cancel(threading.Event())  # a flag that is not set changes nothing
        after = eng.stream(NEXT, max_tokens=6, add_special=False)
        assert "".join(after) == ref_text and after.result.tokens == ref.result.tokens
        eng.set_cancel(None)
