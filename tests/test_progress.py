"""A long message's reading is visible: Engine.set_progress reports each batch of a turn's prefill (the
room-making parts of a message longer than the context included), and the REPL draws it as a bar with
the tokens read and the time left, gone once the answer begins. On the embedded SmolLM2, greedy."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from page_local.cli.repl import Repl, _Reading
from page_local.engine.engine import Engine

# about 650 tokens: five batches of n_batch 128 (the test counts at least 4 progress calls); what is counted is
# batches, so a smaller batch shows them on a shorter message (was ~1 600 tokens in batches of 512)
N_BATCH = 128
LONG = " ".join(f"Shelf {i} holds {i % 7 + 2} blue jars and {i % 5 + 1} brown bottles." for i in range(40))


def test_progress_counts_every_batch_of_the_message_and_the_repl_shows_it(smollm2_path, monkeypatch):
    # the REPL draws its bar from READING_SHOWN tokens on (1 024): lowered below this message's length, so the
    # same drawing path runs on it; a short message still draws none (below)
    monkeypatch.setattr(_Reading, "READING_SHOWN", 4 * N_BATCH)
    with Engine(smollm2_path, n_ctx=2048, threads=2, gate="never", n_batch=N_BATCH) as eng:
        calls: list[tuple[int, int]] = []
        eng.set_progress(lambda done, total: calls.append((done, total)))
        before = len(eng.history)
        s = eng.stream(LONG + " How many shelves?", max_tokens=2)
        list(s)
        read = calls[-1][1]  # the message's tokens: the history grew by them and by the answer's decoded ones
        assert len(eng.history) - before - len(s.result.tokens) <= read <= len(eng.history) - before
        assert read > 4 * N_BATCH and len(calls) >= 4 and {t for _, t in calls} == {read}
        assert [d for d, _ in calls] == sorted(d for d, _ in calls) and calls[-1][0] == read
        eng.set_progress(None)
        list(eng.stream(" Thanks.", max_tokens=1))
        assert calls[-1][0] == read  # no callback once unset

        buf = io.StringIO()
        repl = Repl(eng, Console(file=buf, force_terminal=True, width=120))
        repl.handle(LONG + " Which shelf holds the most jars?")
        out = buf.getvalue()
        assert "reading the message" in out and "tokens" in out
        assert eng._progress_fn is None  # the REPL unsets it after the turn
        buf.truncate(0)
        repl.handle("Thanks.")  # a short message draws no bar
        assert "reading the message" not in buf.getvalue()


@pytest.mark.parametrize("bad", [0, 63, 100.0, True, "512"])
def test_a_bad_batch_size_is_refused_before_the_model_loads(bad):
    with pytest.raises(ValueError, match="n_batch must be an int of at least 64"):
        Engine("/nonexistent/model.gguf", n_batch=bad)
