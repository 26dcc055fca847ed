"""Room that keeps what the question needs (issue 28): a message longer than the context is read in parts
whose evictions are ranked by the message's own question; an answer never evicts the message it answers;
a prompt that fits with its answer is never evicted upfront. Real SmolLM2 for what the model answers, a
tiny random model for the cell bookkeeping of long prompts and answers that run to the wall."""

from __future__ import annotations

import numpy as np
import pytest

import tiny_model as tm
from page_local import ChatSession, Engine
from page_local.engine import room
from page_local.eval.conversations import _prose

THREADS = 1  # a shared CPU: two threads that wait on each other are slower
FACT = "The vault combination for the north archive is 8841."
QUESTION = "What is the vault combination for the north archive?"


def message_positions(eng: Engine, start: int, n: int) -> np.ndarray:
    return np.asarray(eng.conv.pos[start: start + n], dtype=np.int64)


# --- the REPL example: /read doc.txt What is the vault combination ...? -------------------------------------

@pytest.fixture(scope="module")
def smol(smollm2_path):
    # 512 cells (a ~560-token document): reading in parts and the question's ranking do not depend on the size
    with Engine(smollm2_path, n_ctx=512, threads=THREADS) as eng:  # chat's defaults otherwise
        yield eng


@pytest.fixture(scope="module")
def vault_message(smol):
    """A document of ~1.1 x n_ctx with the fact at 18 % of its depth, then the question (as /read sends it)."""
    count = lambda t: len(smol.model.tokenize(t))  # noqa: E731
    sents = _prose(int(smol.n_ctx * 1.1), 0, count, 0)
    k = int(len(sents) * 0.18)
    return " ".join(sents[:k] + [FACT] + sents[k:]) + "\n\n" + QUESTION


@pytest.mark.parametrize("ranking", ["question", "recent"], ids=["question-ranks-the-room", "todays-ranking"])
def test_a_document_longer_than_the_context_keeps_what_its_question_asks(smol, vault_message, ranking):
    """The document is read in parts; ranked by its question the fact survives and is answered, ranked by
    the previous part's own text (the earlier ranking) it is evicted on this input. The question's probe
    cells are temporary: the message sits at the positions it would have had, and nothing else is held."""
    smol.set_room_ranking(ranking)
    try:
        chat = ChatSession(smol)
        turn = chat.send(vault_message, max_tokens=16)
        answer = "".join(turn)
    finally:
        smol.set_room_ranking(room.ROOM_RANKING)
    d = turn.decision
    assert d.chunks >= 2 and d.room_evicted > 0 and d.prompt_held < d.prompt_tokens
    assert d.room_ranking == ranking and (d.room_probe_ms > 0) == (ranking == "question")
    held = smol.ctx.page.positions(0)
    assert np.isin(held, smol.conv.pos).all()  # no temporary cell left behind
    assert smol.conv.pos == list(range(len(smol.history)))  # positions unchanged: the probe decodes took none
    if ranking == "question":
        assert "8841" in answer, answer
    else:
        assert "8841" not in answer, answer  # what query-aware ranking fixes


def test_the_ranking_is_validated(smol):
    with pytest.raises(ValueError,
                       match=r"must be one of question, recent, question\+generic, bm25, hybrid; got 'oldest'"):
        smol.set_room_ranking("oldest")
    assert smol.room_ranking == room.ROOM_RANKING == "hybrid"
    with pytest.raises(ValueError, match="evictor 'tova' needs last_query, which room-making does not provide"):
        smol.set_room_evictor("tova")
    assert smol.room_evictor.name == "snapkv-spans"  # the default: SnapKV kept a sentence at a time


# --- never upfront, never the message it answers ---------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    w = tm.write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny.gguf", n_ctx_train=8192)
    return w.path


def prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(10, 290, size=n).tolist()


def never_ending(eng: Engine, monkeypatch) -> Engine:
    """A random model may sample its end-of-generation token anywhere: here an answer runs to the wall."""
    monkeypatch.setattr(eng.model, "is_eog", lambda tok: False)
    return eng


def test_a_prompt_that_fits_is_never_evicted_and_the_answer_ends_at_the_wall(tiny, monkeypatch):
    """A 3 900-token prompt at n_ctx 4096 with max_tokens = n_ctx (what serve passes without max_tokens): no
    room is reserved upfront, every prompt cell is kept, and the answer ends at the context's end."""
    with Engine(tiny, n_ctx=4096, gate="never", budget=1.0, threads=THREADS) as eng:
        never_ending(eng, monkeypatch)
        s = eng.stream(prompt(3900, 0), max_tokens=4096)
        list(s)
        d, r = s.decision, s.result
        assert d.room_evicted == 0 and d.chunks == 1
        assert np.isin(np.arange(3900), eng.ctx.page.positions(0)).all()  # every prompt cell
        assert r.finish_reason == "context", r.finish_reason
        assert eng.cells_used() == eng.n_ctx and len(r.tokens) == eng.n_ctx - 3900


def test_an_answer_evicts_earlier_turns_never_the_message_it_answers(tiny, monkeypatch):
    with Engine(tiny, n_ctx=512, gate="never", budget=1.0, threads=THREADS) as eng:
        never_ending(eng, monkeypatch)
        list(eng.stream(prompt(200, 1), max_tokens=8))
        start = len(eng.history)
        s = eng.stream(prompt(250, 2), max_tokens=400)
        list(s)
        d, r = s.decision, s.result
        msg = message_positions(eng, start, 250)
        held = eng.ctx.page.positions(0)
        assert np.isin(msg, held).all()  # the message it answers: every cell
        assert np.isin(np.asarray(eng.conv.pos[start + 250:]), held).all()  # and the answer
        assert d.room_evicted > 0 and d.room_from[1] < msg[0]  # room came from the earlier turn only
        assert r.finish_reason == "context" and eng.cells_used() == eng.n_ctx  # then nothing else could go


def test_a_message_that_fits_whole_takes_the_answers_room_from_earlier_turns(tiny):
    """Fits only if earlier turns make room for its answer: they do, the message itself is read whole."""
    with Engine(tiny, n_ctx=512, gate="never", budget=1.0, threads=THREADS) as eng:
        list(eng.stream(prompt(150, 3), max_tokens=8))
        start = len(eng.history)
        s = eng.stream(prompt(320, 4), max_tokens=64)
        list(s)
        d = s.decision
        assert d.chunks == 1 and d.prompt_held == d.prompt_tokens == 320 and d.room_evicted > 0
        assert d.room_ranking == room.ROOM_RANKING and d.room_from[1] < eng.conv.pos[start]



# --- the long-document family of `eval conversations` (turns=1) ------------------------------------------------

def test_one_turn_is_a_document_longer_than_the_context_with_its_question_last():
    from page_local.eval import conversations as cv

    words = lambda t: len(t.split())  # noqa: E731
    measure = lambda msgs: sum(words(m["content"]) + 4 for m in msgs)  # noqa: E731
    convs = [cv.build_conversation(i, 1, 2.0, 512, words, measure, seed=3) for i in range(6)]
    for c in convs:
        (turn,) = c.turns
        assert turn.doc == 0 and turn.fact.doc == 0
        assert turn.user.endswith(cv.QUESTION.format(key=turn.fact.key))
        assert f"for {turn.fact.key} is: {turn.fact.value}." in turn.user
        assert c.planned_tokens > 1.5 * 512  # longer than the context
    assert len({round(c.turns[0].fact.depth, 1) for c in convs}) >= 2  # the asked fact's depth varies
    with pytest.raises(ValueError, match="turns must be in"):
        cv.build_conversation(0, 0, 2.0, 512, words, measure)


@pytest.mark.parametrize("ranking, words", [("question", "what your message asks"), ("recent", "newest tokens")],
                         ids=["question", "recent"])
def test_why_says_what_ranked_the_room(ranking, words):
    from page_local.engine import narrate
    from tests.fakes import decision

    d = decision(T=4404, B=4404, kept=4046, open=False, evicted=False, gate_mode="verify", rule="raw", D=0.02,
                 room_evicted=358, room_from=(4, 2900), chunks=3, prompt_tokens=4404, prompt_held=4046,
                 room_ranking=ranking)
    assert words in narrate.why(d)
