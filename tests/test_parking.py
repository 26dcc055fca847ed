"""Parking in a conversation (Engine(park=True), engine/parking.py) on the embedded SmolLM2: a later turn finds what
an earlier turn's eviction parked, a save and load keeps the parked cells, the wall lets parked cells go first, and a
short conversation keeps the full cache."""

from __future__ import annotations

import numpy as np
import pytest

from page_local.chat.session import ChatSession
from page_local.engine.engine import Engine
from page_local.engine.parking import PARK_SEQ

THREADS = 1
FILL = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
DOC = (FILL * 8 + "The secret code of the blue door is 58213.\n" + FILL * 8 + "The secret code of the red door is 90417.\n"
       + FILL * 8)
TURNS = [DOC + "\nSay hello.", "What is the secret code of the red door?", "What is the secret code of the blue door?"]
# answer tokens per turn: the greeting stays within the check's span CAP, so the second turn is the first whose
# answer reaches it, and nothing of this chat tells its check that answers end soon after the cap
MAX = [4, 16, 16]


CAP = 8  # the check's span in these chats: answers of up to 16 tokens go on past it, so a passed check parks


def chat(path, **kw) -> tuple[Engine, ChatSession]:
    """A parking chat as `chat --park` runs it (whole sentences: snapkv-spans), with the check's span CAP. With
    SnapKV's pooled cells the second answer's tail, decoded on the parked cache, led the third turn to the red
    door's code for the blue door, with every cell back (SmolLM2, AMD Zen 4); with whole sentences it did not."""
    kw.setdefault("evictor", "snapkv-spans")
    eng = Engine(path, n_ctx=2048, gate="verify", threads=THREADS, autotune=False, verify_tokens=CAP, **kw)
    return eng, ChatSession(eng)


def say(session: ChatSession, text: str, max_tokens: int = 16):
    turn = session.send(text, max_tokens=max_tokens)
    return "".join(turn).strip(), turn.decision


def turn(session: ChatSession, k: int):
    """Turn k of TURNS, with its MAX answer tokens."""
    return say(session, TURNS[k], MAX[k])


@pytest.fixture
def selects(monkeypatch):
    """How many keep sets the turns selected (turn.Pipeline.select calls)."""
    from page_local.engine.turn import Pipeline

    calls, real = [], Pipeline.select
    monkeypatch.setattr(Pipeline, "select", staticmethod(lambda *a, **kw: calls.append(1) or real(*a, **kw)))
    return calls


def test_a_later_turn_finds_what_parking_kept(smollm2_path, selects):
    """The second turn's first CAP answer tokens pass the check on a quarter of the cache, so its eviction is committed
    (three quarters parked) and the answer goes on from the parked cache; the third asks about the other door. Parked, the cells come back before the third message is read and it is answered as
    with the full cache (on an Intel Xeon, evicting them for good instead answered "5821")."""
    with Engine(smollm2_path, n_ctx=2048, budget=1.0, gate="verify", threads=THREADS, autotune=False) as eng:
        s = ChatSession(eng)
        full = [turn(s, k)[0] for k in range(len(TURNS))]
    assert "58213" in full[2] and "90417" in full[1]
    eng, s = chat(smollm2_path, budget=0.25, park=True, park_from=0)
    with eng:
        turn(s, 0)
        assert not selects  # the greeting was over inside the check's span: its keep set was never selected
        answer, dec = turn(s, 1)
        assert answer == full[1]
        assert dec.evicted and dec.parked > 400 and dec.kept < dec.T / 3  # committed: three quarters parked
        assert len(selects) == 1  # selected at the check (selfcheck.KeepSets)
        assert eng.parking.count() == dec.parked == len(eng.ctx.page.parked(PARK_SEQ))
        answer, dec = turn(s, 2)
        assert dec.restored > 400  # every parked cell was back before the message was read
        assert answer == full[2]


def test_an_answer_over_within_the_check_runs_none_and_stays_the_full_cache(smollm2_path, selects):
    """With parking, an answer that is over inside the check's span (here: 16 tokens at most, the default span 32) is
    not checked: no token is left for a parked cache to speed up and the next message chooses again. Nothing is
    forced, nothing parked, no verdict counted, and every turn's log-probabilities are the full cache's, bit for bit.
    (That restored cells read as never-parked ones is tests/test_park.py's restore test.)"""
    from page_local.engine.decision import Sampling

    def run(eng):
        s, out = ChatSession(eng), []
        for text in TURNS:
            st = s.send(text, max_tokens=16, sampling=Sampling(logprobs=4))
            "".join(st)
            out.append((st.result.logprobs, st.decision))
        return out

    with Engine(smollm2_path, n_ctx=2048, budget=1.0, gate="verify", threads=THREADS, autotune=False) as eng:
        full = run(eng)
    with Engine(smollm2_path, n_ctx=2048, budget=0.25, gate="verify", threads=THREADS, autotune=False, park=True,
                park_from=0) as eng:
        parked = run(eng)
        assert eng.backoff.refused == 0 and eng.parking.count() == 0
        assert not selects  # no check ran, so no keep set was ever selected (selfcheck.KeepSets)
    for (lp, d), (lp_full, _) in zip(parked, full):
        assert d.check_unneeded == len(lp) and d.verify_forced is None and d.parked == 0 and not d.evicted
        assert "nothing was left to speed up" in d.reason
        assert lp == lp_full  # every answer token and its 4 best alternatives, the same floats


def test_a_parked_chat_continues_identically_after_load(smollm2_path, tmp_path):
    eng, s = chat(smollm2_path, budget=0.25, park=True, park_from=0)
    with eng:
        turn(s, 0)
        turn(s, 1)
        parked = eng.ctx.page.parked(PARK_SEQ).tolist()
        held = eng.ctx.page.positions(0).tolist()
        assert parked
        f = s.save(tmp_path / "parked.pglc")
        want = turn(s, 2)
    eng2, s2 = chat(smollm2_path, budget=0.25, park=True, park_from=0)
    with eng2:
        s2.load(f)
        assert eng2.ctx.page.parked(PARK_SEQ).tolist() == parked
        assert eng2.ctx.page.positions(0).tolist() == held
        assert eng2.parking.count() == len(parked)
        got = turn(s2, 2)
        assert got[0] == want[0] and got[1].restored == want[1].restored
    eng3, s3 = chat(smollm2_path, budget=0.25, park=False)  # an engine that does not park: every cell attended
    with eng3:
        s3.load(f)
        assert eng3.parking.count() == 0 and eng3.cells_used() == len(held) + len(parked) == len(eng3.history)


def test_the_wall_lets_parked_cells_go_first(smollm2_path):
    """A message that does not fit beside the held and parked cells: the lowest-ranked parked cells go for good,
    just as many as the message and its answer need, and no held cell is evicted to make room."""
    eng = Engine(smollm2_path, n_ctx=1024, budget=0.25, gate="always", threads=THREADS, autotune=False, park=True,
                 park_from=0)
    with eng:
        s = ChatSession(eng)
        say(s, FILL * 20 + "Say hello.", max_tokens=4)
        parked, held = eng.parking.count(), eng.cells_used()
        assert parked > 300
        msg = FILL * 20 + "What colour is the sky?"  # does not fit beside the held and parked cells
        answer, dec = say(s, msg, max_tokens=8)
        assert dec.park_dropped > 0 and dec.room_evicted == 0
        assert dec.restored == parked - dec.park_dropped
        assert eng.cells_used() + eng.parking.count() <= 1024


def test_parking_switched_off_brings_every_cell_back_at_once(smollm2_path):
    """set_park(False) (the REPL's /set park off) with cells set aside: no message would bring them back any more,
    so they come back now, in position order, and the next turn answers as it does when its message brings them
    back (the cache is the same, cell for cell)."""
    msg, q = FILL * 20 + "Say hello.", "What colour is the sky?"
    answers = []
    for switch_off in (False, True):
        eng = Engine(smollm2_path, n_ctx=1024, budget=0.25, gate="always", threads=THREADS, autotune=False,
                     park=True, park_from=0)
        with eng:
            s = ChatSession(eng)
            say(s, msg, max_tokens=4)
            parked, held = eng.parking.count(), eng.cells_used()
            assert parked > 300
            if switch_off:
                eng.set_park(False, eng.park_from)
                assert eng.parking.count() == 0 and len(eng.parking.positions()) == 0
                assert eng.cells_used() == held + parked == len(eng.history)  # every cell attended again
            eng.set_budget(1.0)
            answer, dec = say(s, q, max_tokens=8)
            assert dec.restored == (0 if switch_off else parked) and not dec.evicted
            answers.append(answer)
    assert answers[0] == answers[1]


def test_below_park_from_the_full_cache_is_kept(smollm2_path):
    eng = Engine(smollm2_path, n_ctx=1024, budget=0.25, gate="always", threads=THREADS, autotune=False, park=True,
                 park_from=2048)
    with eng:
        _, dec = say(ChatSession(eng), FILL * 20 + "Say hello.", max_tokens=4)
        assert not dec.evicted and dec.parked == 0 and eng.cells_used() >= dec.T
        assert "eviction does not pay there" in dec.reason


def test_park_from_is_checked(smollm2_path):
    with pytest.raises(ValueError, match="park_from must be an int >= 0"):
        Engine(smollm2_path, n_ctx=256, park=True, park_from=-1, autotune=False)


def test_whole_sentences_are_kept_for_speed_too(smollm2_path):
    """snapkv-spans on the speed budget (as room-making ranks): the sentence the question asks about stays held as a
    whole, its value's last digits included, and every other cell of the document is held or parked."""
    eng = Engine(smollm2_path, n_ctx=2048, budget=0.25, gate="always", evictor="snapkv-spans", threads=THREADS,
                 autotune=False, park=True, park_from=0)
    with eng:
        answer, dec = say(ChatSession(eng), DOC + "\nWhat is the secret code of the blue door?")
        assert dec.evicted and dec.parked > 400
        held = set(eng.ctx.page.positions(0).tolist())
        parked = set(eng.ctx.page.parked(PARK_SEQ).tolist())
        assert not held & parked and len(held | parked) >= dec.T
        text = [eng.model.token_to_piece(t, special=True).decode("utf-8", "replace") for t in eng.conv.history]
        i = next(i for i in range(len(text)) if text[i].strip() == "The"
                 and "".join(text[i:i + 8]).lstrip().startswith("The secret code of the blue"))
        j = next(k for k in range(i, len(text)) if "58213" in "".join(text[i:k + 1]))
        sentence = eng.conv.pos[i:j + 2]  # through the value's last digit and the stop after it
        assert set(sentence) <= held, "the fact's sentence is held whole"
        assert "58213" in answer


def test_a_speed_evictor_needing_sentences_is_told_where_they_are(smollm2_path):
    from page_local.engine.turn import Pipeline

    eng = Engine(smollm2_path, n_ctx=256, autotune=False)
    with eng:
        assert eng.pipeline.spans is not None
        bare = Pipeline(eng.ctx, eng.model)
        with pytest.raises(ValueError, match="keeps whole sentences"):
            bare.sentences(np.arange(3))


def test_park_from_is_where_parking_pays_for_the_model(smollm2_path):
    """On the CPU, the cells whose K and V weigh an eighth of the weights (issue 54's measurements), at least 2048:
    SmolLM2 (98 MB, 23 KB a cell in f16) at the floor, 2048; on a GPU the bytes' half; a q8_0 cache halves a cell,
    so twice as many; an explicit park_from wins."""
    from page_local.engine.parking import PARK_FROM, park_from_for

    assert park_from_for(98_362_432, 30 * 3 * 128 * 2) == 2048
    assert park_from_for(491_400_064, 24 * 2 * 128 * 2) == 4864  # Qwen2.5-Coder-0.5B: 1.3x measured at ~4.6K
    # the real shapes' Q4_K_M files (store/synth.py) against where bench decode --fill state measured 1.3x
    measured = {"llama-3.2-1b": 2760, "llama-3.1-8b": 4900, "qwen2.5-7b": 10400}
    from page_local.store import synth

    for name, at in measured.items():
        s = synth.SHAPES[name]
        got = park_from_for(synth.approx_bytes(s), s.kv_bytes_per_cell)
        assert at / 1.5 <= got <= at * 1.5, (name, got, at)
    assert park_from_for(491_400_064, 24 * 2 * 128 * 2, "CUDA0") == 19968  # a GPU: the bytes' half
    assert park_from_for(10_000_000, 23_040) == PARK_FROM  # never below the floor
    with Engine(smollm2_path, n_ctx=256, threads=THREADS, autotune=False, park=True) as eng:
        assert eng.park_from == 2048
        eng.set_park(True, 512)
        assert eng.park_from == 512
        eng.set_park(True)
        assert eng.park_from == 2048
    with Engine(smollm2_path, n_ctx=256, threads=THREADS, autotune=False, park=True, flash_attn="on",
                cache_type="q8_0") as eng:
        assert eng.park_from == 2048  # an eighth of SmolLM2's weights is ~1K q8_0 cells: the floor
    assert park_from_for(491_400_064, 24 * 2 * 128 * 1.0625) == 8960  # q8_0 halves a cell: about twice the cells


def test_payback_expects_what_the_request_allows_and_the_conversation_shows():
    from page_local.engine.selfcheck import Payback

    p = Payback()
    assert p.expected(max_tokens=384, cap=64) == 320 and p.expected(max_tokens=40, cap=64) == 0
    p.record(50, cap=64)  # over within the span: says nothing about what follows the cap
    assert p.after == [] and p.expected(384, 64) == 320
    for n in (112, 120, 300, 90):
        p.record(n, cap=64)
    assert p.after == [56, 236, 26] and p.expected(384, 64) == 56 and p.expected(100, 64) == 36
    assert Payback.tokens(64) == 64


def test_a_check_that_could_not_pay_back_is_not_run(smollm2_path, tmp_path):
    """At the cap, the tokens expected after it are fewer than the check's: no check, no forced token, nothing
    parked, and the answer is the full cache's. First from the request (max_tokens 12 leaves 4 after a cap of 8),
    then from the conversation (the answer before went 4 tokens past the cap); a saved chat keeps what it learnt."""
    with Engine(smollm2_path, n_ctx=2048, budget=1.0, gate="verify", threads=THREADS, autotune=False) as eng:
        s = ChatSession(eng)
        full = [say(s, TURNS[0], 4)[0], say(s, TURNS[1], 12)[0], say(s, TURNS[2], 16)[0]]
    eng, s = chat(smollm2_path, budget=0.25, park=True, park_from=0)
    with eng:
        turn(s, 0)
        answer, dec = say(s, TURNS[1], 12)
        assert dec.check_unpaid == 4 and dec.verify_forced is None and dec.parked == 0 and not dec.evicted
        assert answer == full[1] and "no check at the cap: about 4 more answer tokens" in dec.reason
        assert eng.payback.after == [4]  # 12 tokens: 4 after the cap
        answer, dec = say(s, TURNS[2], 16)  # the request allows 8 after the cap, the conversation shows 4
        assert dec.check_unpaid == 4 and dec.parked == 0 and answer == full[2]
        learnt = list(eng.payback.after)
        assert len(learnt) == 2
        f = s.save(tmp_path / "payback.pglc")
    eng2, s2 = chat(smollm2_path, budget=0.25, park=True, park_from=0)
    with eng2:
        s2.load(f)
        assert eng2.payback.after == learnt


def test_a_check_runs_only_where_its_forced_tokens_are_paid_back():
    """Payback.needed: the tokens after the cap at which p x after x gain covers forced x FORCED_STEP; a refused
    check halves p, a parked answer's timing rescales the predicted gain, a told park_from keeps the tokens rule."""
    from page_local.engine.decision import Decision
    from page_local.engine.selfcheck import Payback

    p = Payback()
    assert p.needed(64, 2, None) == 64  # the user's park_from: as many tokens as the check forces
    assert p.needed(64, 2, 0.326) == 84  # (64 + 4) x 0.4 / 0.326: Qwen2.5-Coder at 8.6K cells
    assert p.needed(64, 1, 0.4) == 64 and p.needed(64, 2, 0.0) > 1 << 20
    refused = Decision(T=8603, B=2150, D=None, z=None, open=True, evicted=False, kept=8603, compression=1.0,
                       gate_mode="search", rule="raw", reason="", evictor="snapkv-spans", verify_forced=88,
                       verify_ms=1154.0)
    step = 0.034
    p.record(128, 64, refused, [step * (i + 1) for i in range(128)], 0.326)
    assert p.passed == [False] and p.forced == [88]
    assert p.forced_step == [pytest.approx(1.154 / 88 / step)]
    assert p.needed(64, 2, 0.326) == 209  # 88 x 0.386 / (0.5 x 0.326), rounded up
    passed = Decision(**{**refused.to_dict(), "evicted": True, "parked": 9715, "verify_forced": 69,
                         "verify_ms": 1040.0})
    times = [step * (i + 1) for i in range(64)] + [step * 64 + 1.04 + 0.02 * (i + 1) for i in range(64)]
    p.record(128, 64, passed, times, 0.4)
    assert p.seen == [pytest.approx((1 - 0.02 / step) / 0.4)]  # a parked step 0.02 s against 0.034
    assert p.passed == [False, True] and p.after == [64, 64]


def test_the_engine_weighs_the_check_by_the_models_shape(smollm2_path):
    """With the model's own park_from, parking's gain is step_gain of its shape, and a check that cannot pay is not
    prepared: about 36 tokens after the cap of 64 are fewer than a 2.5K-cell SmolLM2 conversation needs. Told a
    park_from, the gain is the user's word (None)."""
    from page_local.engine.parking import shape_of, step_gain
    from page_local.engine.selfcheck import Payback

    with Engine(smollm2_path, n_ctx=4096, budget=0.25, park=True, threads=2, autotune=False) as eng:
        assert not eng.parking.told and eng.park_from == 2048
        w, c, dev = shape_of(eng.model, "f16")
        g = eng.parking.gain(8192, 2048)
        assert g == pytest.approx(step_gain(w, c, 8192, 2048, dev)) and g > 0.4
        s = ChatSession(eng)
        turn = s.send(DOC * 4 + "\nWhat is the secret code of the red door?", max_tokens=100)
        "".join(turn)
        d = turn.decision
        assert 2048 < d.T < 4096 and d.check_unpaid == 36 and d.verify_forced is None and d.parked == 0
        need = Payback().needed(64, 1, step_gain(w, c, d.T, d.B + 100, dev))  # the engine's gate: verify, one rung
        assert 36 < need < 100 and f"fewer than the {need} a parked cache needs" in d.reason
        eng.set_park(True, park_from=0)
        assert eng.parking.told and eng.parking.gain(8192, 2048) is None
