"""Conversations that never hit the wall: the speed budget over the whole conversation, room on demand,
messages longer than the context, positions inside the trained context, rewind, snapshot/restore.
Real SmolLM2 and a tiny random model (for positions past a small trained context quickly)."""

from __future__ import annotations

import numpy as np
import pytest

import tiny_model as tm
from page_local import ChatSession, Engine
from page_local.engine import room
from page_local.errors import ContextFull, StateFileError

THREADS = 2
FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
          "Rivers run to the sea and the hills stay where they are. ")


def document(n_rep: int, fact: str, at: float) -> str:
    parts = [FILLER] * n_rep
    parts.insert(int(n_rep * at), fact + " ")
    return "".join(parts)


# --- the pure pieces -------------------------------------------------------------------------------

def test_gap_runs_renumber_the_held_positions():
    held = np.array([0, 1, 2, 5, 6, 9, 12, 13], dtype=np.int32)
    pos = held.astype(np.int64).copy()
    for p0, p1, delta in room.gap_runs(held):  # applied in order, as llama_memory_seq_add would
        pos[(pos >= p0) & (pos < p1)] += delta
    assert pos.tolist() == list(range(held.size))
    assert room.gap_runs(np.arange(5, dtype=np.int32)) == []
    history_pos = np.arange(14)
    new = room.renumber(history_pos, held)
    assert new[held].tolist() == list(range(held.size))  # held tokens land where their cells went
    assert np.all(np.diff(new) >= 0)  # monotone: a prefix of the history is a prefix of positions


def test_the_target_leaves_room_for_what_comes():
    assert room.target_cells(4096, 100) == 2048  # the low-water mark
    assert room.target_cells(4096, 3000) == 4096 - 1 - 3000
    assert room.target_cells(100, 200) == 0
    with pytest.raises(ValueError, match="on_full must be one of"):
        room.check_on_full("drop")


# --- the speed budget ---------------------------------------------------------------------------------

def test_the_speed_budget_is_a_share_of_the_conversation_not_compounded(smollm2_path):
    """Budget 0.5 over three turns: the cells stay about half of the conversation (0.5^k before)."""
    with Engine(smollm2_path, n_ctx=1024, budget=0.5, gate="always", threads=THREADS) as eng:
        kept = []
        for i in range(3):
            s = eng.stream(document(4, f"Fact {i}: the code is {1000 + i}.", 0.5) + " What is the code?",
                           max_tokens=4)
            list(s)
            d = s.decision
            assert d.T == len(eng.history) - len(s.result.tokens)  # T: the whole conversation
            assert d.evicted and d.kept == d.B == max(40, int(d.T * 0.5))
            kept.append(eng.cells_used() / len(eng.history))
        assert min(kept) > 0.45, kept  # not 0.5, 0.25, 0.125


# --- room on demand -------------------------------------------------------------------------------------

def test_a_chat_past_the_context_makes_room_and_keeps_its_structure(smollm2_path):
    """Turns that outgrow n_ctx: no refusal; room is made once in a while (down to the low-water mark),
    the system prompt and every turn boundary survive, and the latest fact is still answered."""
    turns = 5  # ~150 tokens each: the fourth outgrows the 512 cells
    with Engine(smollm2_path, n_ctx=512, gate="never", threads=THREADS) as eng:
        chat = ChatSession(eng, system="You answer in a few words.")
        assert eng.n_keep > 0
        head = eng.history  # filled by the first turn
        made = []
        for i in range(turns):
            turn = chat.send(document(3, f"Note {i}: the locker number is {4100 + i}.", 0.3)
                             + " What is the locker number in the note?", max_tokens=12)
            answer = "".join(turn)
            assert turn.result.finish_reason in ("stop", "length")
            made.append(turn.decision.room_evicted)
            assert eng.cells_used() <= eng.n_ctx
        held = eng.ctx.page.positions(0)
        assert sum(1 for m in made if m) >= 1 and sum(made) > 0, made
        assert np.isin(np.arange(eng.n_keep), held).all()  # the system prompt was never evicted
        control = [i for i, t in enumerate(head) if eng.model.is_control(t)]
        assert np.isin(np.asarray(control), held).all()  # nor a turn boundary
        assert str(4100 + turns - 1) in answer.replace(",", "").replace(" ", ""), answer


def test_refuse_mode_keeps_the_old_hard_stop(smollm2_path):
    with Engine(smollm2_path, n_ctx=512, gate="never", threads=THREADS, on_full="refuse") as eng:
        list(eng.stream(FILLER * 10, max_tokens=2))
        before = (eng.ctx.page.positions(0).tolist(), list(eng.history))
        with pytest.raises(ContextFull):
            list(eng.stream(FILLER * 20, max_tokens=2))
        assert (eng.ctx.page.positions(0).tolist(), list(eng.history)) == before


def test_a_document_longer_than_the_context_is_answered(smollm2_path):
    """~1,300 tokens into 512 cells: prefilled in chunks with room made between them; the fact in the
    last part (where the question is) is answered, and the Decision says how much is still held."""
    doc = document(36, "The secret passphrase is 7719.", 0.93)
    with Engine(smollm2_path, n_ctx=512, gate="verify", threads=THREADS) as eng:
        prompt = doc + "\nWhat is the secret passphrase? The secret passphrase is"
        n = len(eng.model.tokenize(prompt))
        assert n > 2 * eng.n_ctx
        r = eng.generate(prompt, max_tokens=8)
        d = r.decision
        assert d.chunks >= 3 and d.room_evicted > 0 and d.prompt_held < n
        assert eng.cells_used() <= eng.n_ctx
        assert "7719" in r.text, r.text


def test_an_interrupted_chunked_prefill_leaves_the_conversation_as_it_was(smollm2_path, monkeypatch):
    # ~570 tokens into 512 cells, then ~1,140 (read in chunks, the second interrupted)
    with Engine(smollm2_path, n_ctx=512, gate="never", threads=THREADS) as eng:
        list(eng.stream(FILLER * 15, max_tokens=4))
        before = (eng.ctx.page.positions(0).tolist(), list(eng.history))
        calls = []
        real = eng.pipeline.prefill

        def interrupted(toks, *a, **k):
            calls.append(len(toks))
            if len(calls) == 2:
                raise KeyboardInterrupt
            return real(toks, *a, **k)

        monkeypatch.setattr(eng.pipeline, "prefill", interrupted)
        with pytest.raises(KeyboardInterrupt):
            list(eng.stream(FILLER * 30, max_tokens=4))
        monkeypatch.setattr(eng.pipeline, "prefill", real)
        assert (eng.ctx.page.positions(0).tolist(), list(eng.history)) == before
        list(eng.stream(" And then?", max_tokens=2))  # the conversation goes on


def test_a_message_larger_than_the_protected_set_allows_is_refused(smollm2_path):
    with Engine(smollm2_path, n_ctx=256, gate="never", threads=THREADS) as eng:
        list(eng.stream(FILLER * 4, max_tokens=2))
        eng.n_keep = 200  # a system prompt that covers the whole conversation: nothing may go
        before = (eng.ctx.page.positions(0).tolist(), list(eng.history))
        with pytest.raises(ContextFull, match="the context is full"):
            list(eng.stream(FILLER * 4, max_tokens=2))
        assert (eng.ctx.page.positions(0).tolist(), list(eng.history)) == before


# --- positions ----------------------------------------------------------------------------------------

def test_positions_stay_inside_the_trained_context(tmp_path):
    """A 50-turn conversation on a model trained for 512 positions in 256 cells: gaps are closed before
    any position passes 512, and every turn completes."""
    w = tm.write_tiny_llama(tmp_path / "tiny.gguf", n_ctx_train=512)
    rng = np.random.default_rng(0)
    closed = 0
    with Engine(w.path, n_ctx=256, budget=0.5, gate="always", threads=1) as eng:
        for _ in range(50):
            s = eng.stream(rng.integers(10, 250, size=30).tolist(), max_tokens=6)
            list(s)
            closed += s.decision.gaps_closed
            assert eng.ctx.seq_pos_max(0) < 512 and eng.cells_used() <= 256
            assert s.result.finish_reason in ("stop", "length")
        assert len(eng.history) > 2 * 512 and closed > 0


# --- rewind, snapshot, restore -------------------------------------------------------------------------------

def test_rewind_continues_as_if_the_later_turns_never_happened(smollm2_path):
    with Engine(smollm2_path, n_ctx=1024, gate="never", threads=THREADS) as eng:
        list(eng.stream("The capital of France is", max_tokens=4))
        n1 = len(eng.history)
        ref = eng.stream(" And of Italy?", max_tokens=6)
        list(ref)
        eng.reset()
        list(eng.stream("The capital of France is", max_tokens=4))
        list(eng.stream(" Something else entirely.", max_tokens=6))
        eng.rewind(n1)
        assert len(eng.history) == n1 and eng.cells_used() == n1
        again = eng.stream(" And of Italy?", max_tokens=6)
        list(again)
        assert again.result.tokens == ref.result.tokens
        with pytest.raises(ValueError, match="n_tokens must be"):
            eng.rewind(10**6)


def test_snapshot_restore_round_trip_and_a_refused_restore_keeps_the_conversation(smollm2_path, tmp_path):
    with Engine(smollm2_path, n_ctx=1024, budget=0.5, gate="always", threads=THREADS) as eng:
        list(eng.stream(document(6, "The code is 5521.", 0.5), max_tokens=4))
        snap = eng.snapshot()
        assert snap.nbytes > 0 and len(snap.positions) == eng.cells_used() < len(snap.history)
        cont = eng.stream(" What is the code?", max_tokens=6)
        list(cont)
        eng.restore(snap)
        again = eng.stream(" What is the code?", max_tokens=6)
        list(again)
        assert again.result.tokens == cont.result.tokens
        before = (eng.ctx.page.positions(0).tolist(), list(eng.history))
        broken = type(snap)(model_id=snap.model_id, n_ctx=snap.n_ctx, history=snap.history,
                            positions=snap.positions, state=snap.state[: len(snap.state) // 2])
        with pytest.raises(StateFileError):
            eng.restore(broken)
        assert (eng.ctx.page.positions(0).tolist(), list(eng.history)) == before
