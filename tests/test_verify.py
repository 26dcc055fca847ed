"""Self-verified eviction (gate modes "verify" and "page+verify") on SmolLM2: the answer is generated
with the full cache up to its end or the cap (verify_tokens), teacher-forced on an evicted copy, and the
eviction is committed iff verify.verify_score passes (by default: no checked position changes the top
token)."""

from __future__ import annotations

import numpy as np
import pytest

from page_local.engine.engine import Engine
from page_local.verify import RULES, VERIFY_CAP, VERIFY_RULE

THREADS = 1
HAY = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
# ~530 tokens: long enough that a 40-cell budget and a quarter lose the needle and a half keeps it (what the
# tests tell apart); every turn prefills it on one thread, so its length is most of this module's time.
# A chat turn whose assistant reply is begun: the answer is ' 4817302.' (9 tokens) and then the end of the
# turn, each greedy choice by a clear margin (measured on an Intel Xeon with AVX-512: the smallest gap between
# the top two log-probabilities over the answer is 1.66 nats, the end-of-turn token leads by 2.2 logits), so
# the premises hold on every CPU family. The raw completion this replaced ("... mentioned in the provided text
# is") was a near-tie at its first token (': ' against ' ', 0.16 nats on the Xeon) and never ended there.
NEEDLE = ("<|im_start|>user\nSome special magic numbers are hidden within the following text. Make sure to "
          "memorize it.\n" + HAY * 10 + "One of the special magic numbers for cold-ocean is: 4817302.\n" + HAY * 10
          + "\nWhat is the special magic number for cold-ocean mentioned in the provided text?<|im_end|>\n"
            "<|im_start|>assistant\nThe special magic number for cold-ocean is")


@pytest.fixture(scope="module")
def engine(smollm2_path):
    with Engine(smollm2_path, n_ctx=2048, threads=THREADS, gate="never") as e:
        yield e


@pytest.fixture(scope="module")
def full_run(engine):
    engine.set_gate("never")
    engine.set_budget(0.25)
    r = engine.generate(NEEDLE, max_tokens=20)
    return r.tokens, engine.ctx.page.positions(0)


LADDER = (40, 0.25, 0.5)  # two rungs that lose the needle (40 cells, a quarter) and one that keeps it (a half)


@pytest.fixture(scope="module")
def verify_alone(engine):
    """{budget: (Result, cells left in sequence 1 after the turn)} of gate "verify" with the default check
    (the whole answer, up to the cap) at each budget of LADDER alone. Several tests read these same turns:
    each is greedy on a reset cache, so running it again gives the same Result; it is run once per module."""
    engine.set_gate("verify")
    engine.set_verify()
    out = {}
    try:
        for budget in LADDER:
            engine.set_budget(budget)
            r = engine.generate(NEEDLE, max_tokens=VERIFY_CAP + 8)
            out[budget] = r, len(engine.ctx.page.positions(1))
    finally:
        engine.set_gate("never")
        engine.set_budget(0.25)
    return out


@pytest.fixture(scope="module")
def search_run(engine):
    """(Result, seq_pos_max of sequences 1-8 after the turn) of gate "search" over LADDER with the default
    check (the engine batches every rung's first chunk), read by the search tests."""
    engine.set_verify()
    engine.set_gate("search")
    engine.set_ladder(LADDER)
    try:
        r = engine.generate(NEEDLE, max_tokens=VERIFY_CAP + 8)
        return r, [engine.ctx.seq_pos_max(s) for s in range(1, 9)]
    finally:
        engine.set_gate("never")
        engine.set_budget(0.25)


def test_budget_one_is_exactly_the_full_cache(engine, full_run):
    engine.set_gate("verify")
    engine.set_budget(1.0)
    r = engine.generate(NEEDLE, max_tokens=20)
    d = r.decision
    assert d.verify_delta == 0.0 and not d.evicted and d.kept == d.T
    assert r.tokens == full_run[0]
    np.testing.assert_array_equal(engine.ctx.page.positions(0), full_run[1])


def test_tiny_budget_on_a_needle_is_rejected_and_keeps_the_full_cache(engine, full_run):
    engine.set_gate("verify")
    engine.set_budget(40)  # sinks + window + 4: the needle cannot survive
    engine.set_verify(8)
    r = engine.generate(NEEDLE, max_tokens=20)
    d = r.decision
    assert d.verify_m == 8 and d.verify_until == "cap" and d.verify_score > d.verify_threshold
    assert d.verify_rule == VERIFY_RULE and d.verify_threshold == RULES[VERIFY_RULE][1]
    assert not d.evicted and d.kept == d.T
    assert "kept the full cache" in d.reason
    # nothing of the candidate is left: the cache is the full one, tokens are the full run's
    assert r.tokens == full_run[0]
    np.testing.assert_array_equal(engine.ctx.page.positions(0), full_run[1])
    assert len(engine.ctx.page.positions(1)) == 0


def test_committed_eviction_streams_the_full_cache_tokens_first(engine, full_run):
    engine.set_gate("verify")
    engine.set_budget(0.5)
    engine.set_verify(4, 10.0)  # a permissive threshold: commit whatever the loss is
    r = engine.generate(NEEDLE, max_tokens=20)
    d = r.decision
    assert d.evicted and d.verify_m == 4 and d.verify_until == "cap" and d.kept == d.B
    assert np.isfinite(d.verify_delta) and 0.0 <= d.verify_top1 <= 1.0 and d.verify_kl_first >= -1e-6
    assert r.tokens[:4] == full_run[0][:4]  # the m streamed tokens come from the full cache
    held = engine.ctx.page.positions(0)
    assert len(held) == d.B + len(r.tokens)  # the keep set plus the generated tokens
    assert d.verify_ms < d.prefill_ms  # one extra batch decode of m tokens


def test_the_default_check_covers_the_whole_answer_and_its_end(engine, full_run, verify_alone):
    """The needle's answer (' 4817302.', 9 tokens, then end-of-generation) is shorter than the cap:
    all of it, and its end, is checked; whatever the decision, the user reads the full cache's answer.
    (The turns are verify_alone's: gate "verify", engine.set_verify() with no arguments, each budget.)"""
    engine.set_verify()
    assert engine.verify_tokens == VERIFY_CAP
    n = len(full_run[0])
    assert n < VERIFY_CAP
    for budget in (0.5, 0.25, 40):
        r, candidate_cells = verify_alone[budget]
        d = r.decision
        assert r.finish_reason == "stop" and r.tokens == full_run[0][:n]
        assert d.verify_m == n and d.verify_until == "end" and "whole answer" in d.reason
        assert d.verify_score == {"argmax": d.verify_changed, "max": max(d.verify_max, 0.0)}[VERIFY_RULE]
        assert d.evicted == (d.verify_score <= d.verify_threshold)
        assert d.kept == (d.B if d.evicted else d.T)
        assert candidate_cells == 0
    assert not d.evicted  # budget 40 loses the needle: the check refuses it


def test_a_longer_check_is_never_more_permissive(engine):
    """The same full-cache answer checked on longer and longer spans: the score never falls."""
    engine.set_gate("verify")
    engine.set_budget(0.125)
    scores = []
    for m in (2, 5, 9):
        engine.set_verify(m, 1e9)  # run every check to completion
        d = engine.generate(NEEDLE, max_tokens=m).decision
        assert d.verify_m == m
        scores.append(d.verify_score)
    assert all(b >= a - 1e-3 for a, b in zip(scores, scores[1:])), scores


@pytest.mark.parametrize("threshold, opens", [(-1e9, True), (1e9, False)], ids=["page-opens", "page-closes"])
def test_page_plus_verify_runs_verification_only_where_the_gate_opens(engine, threshold, opens):
    """Both branches, each pinned: the raw threshold is moved so that PAGE's gate must open (then the
    candidate is checked) or must stay closed (then nothing is checked or evicted)."""
    engine.set_gate("page+verify")
    engine.set_budget(0.25)
    engine.set_verify(4)
    engine.gate.threshold = threshold
    try:
        d = engine.generate(NEEDLE, max_tokens=8).decision
    finally:
        engine.set_gate("page+verify")  # a fresh gate with the default threshold
    assert d.open is opens and d.T > d.B
    if opens:
        assert d.verify_m == 4 and d.verify_score is not None and d.evicted == (d.verify_score <= d.verify_threshold)
    else:
        assert d.verify_m is None and not d.evicted and d.kept == d.T


def test_bad_verify_settings(engine):
    for m, thr in ((0, 0.05), (1000, 0.05), (4, -1.0), (True, 0.05)):
        with pytest.raises(ValueError):
            engine.set_verify(m, thr)
    with pytest.raises(ValueError, match="verify rule must be one of"):
        engine.set_verify(4, None, "median")
    with pytest.raises(ValueError, match="gate mode must be one of"):
        engine.set_gate("sometimes")


# --- gate mode "search": one candidate per rung of a ladder, the smallest that passes -----------------

def test_search_commits_the_smallest_budget_that_passes_and_agrees_with_verify(full_run, verify_alone, search_run):
    """Every rung's verdict is the verdict verify gives at that budget alone (the same answer checked on
    the same keep set), the committed budget is the smallest that passed, and the user reads the full
    cache's answer. The ladder spans a rung that loses the needle (40 cells) and ones that keep it."""
    ladder = LADDER
    alone = [verify_alone[b][0].decision.evicted for b in ladder]
    assert True in alone and False in alone  # the ladder is not all-pass or all-fail: the test can tell
    r, seq_pos_max = search_run
    d = r.decision
    first = alone.index(True)
    # smallest first: the rungs below the first that passes failed (as verify said), the ones above were
    # not needed
    assert [x["passed"] for x in d.search] == alone[: first + 1] + [None] * (len(ladder) - first - 1)
    assert [x["B"] for x in d.search] == sorted(x["B"] for x in d.search)
    assert d.evicted and d.B == d.search[first]["B"] == d.kept
    # a failed rung stopped where it failed; the chosen one decoded the whole answer (+ the prompt's last token)
    assert d.search[first]["forced"] == d.verify_m + 1
    assert all(0 < x["forced"] <= d.verify_m + 1 for x in d.search[:first])
    # every rung's first chunk went in one batch: the rungs above the chosen one decoded theirs
    above = len(ladder) - first - 1
    assert d.verify_forced == sum(x["forced"] for x in d.search[: first + 1]) + above * min(4, d.verify_m + 1)
    assert r.tokens == full_run[0][: len(r.tokens)]
    assert all(p == -1 for p in seq_pos_max)  # no candidate left behind


def test_search_decides_the_same_with_the_first_chunks_batched_or_not(engine, search_run, monkeypatch):
    """Batching every rung's first chunk (candidate i in sequence 1 + i) changes what is decoded together,
    not the verdicts: the same rungs pass and fail at the same positions, and the same one is committed.
    (The batched turn, the engine's default, is search_run's.)"""
    batched = search_run[0].decision
    engine.set_verify()
    engine.set_gate("search")
    engine.set_ladder(LADDER)
    pipe = engine.pipeline
    original = type(pipe).check_ladder
    try:
        monkeypatch.setattr(pipe, "check_ladder", lambda *a, **k: original(pipe, *a, **dict(k, batch_first=False)))
        one_by_one = engine.generate(NEEDLE, max_tokens=VERIFY_CAP + 8).decision
    finally:
        engine.set_gate("never")
        engine.set_budget(0.25)
    key = lambda d: [(x["B"], x["passed"], x.get("forced"), x["score"]) for x in d.search]
    assert key(batched) == key(one_by_one) and batched.B == one_by_one.B and batched.kept == one_by_one.kept
    assert any(x["passed"] is False for x in batched.search)  # a rung failed: its first chunk was in the batch
    above = sum(x["passed"] is None for x in batched.search)
    assert batched.verify_forced == one_by_one.verify_forced + above * min(4, batched.verify_m + 1)
    # the first chunks were decoded in another batch, so their K/V (F16) round differently: the chosen
    # candidate's mean loss moves by hundredths of a nat on this 1/4-budget copy, its verdict not at all
    assert abs(batched.verify_delta - one_by_one.verify_delta) < 0.05
    assert all(engine.ctx.seq_pos_max(s) == -1 for s in range(1, 9))


def test_a_failing_candidate_stops_where_it_fails(verify_alone):
    """The check decodes growing chunks (4, 8, 16, ...) and stops at the first chunk with a changed top
    token; the verdict is the one the whole span gives (the argmax rule is monotone in the span). The turn
    is verify_alone's at 40 cells, where the needle is lost: the answer's first digits change."""
    d = verify_alone[40][0].decision
    assert not d.evicted and d.verify_changed >= 1
    assert d.verify_forced in (4, 12, 28) and d.verify_forced < d.verify_m + 1
    assert f"within the first {d.verify_forced} tokens" in d.reason


def test_bad_ladders_are_refused(engine):
    for ladder in ((), (0.1, 0.2, 0.3, 0.4, 0.5), (0.0,), (2.5,), (3,)):
        with pytest.raises(ValueError):
            engine.set_ladder(ladder)


def test_a_check_refused_turn_after_turn_rests(smollm2_path):
    """After two refused checks in a row the next turn keeps the full cache without one (no candidate, no forced
    tokens), then the check runs again; refused again, it rests two turns; a passed check would start over."""
    short = NEEDLE.replace(HAY * 10, HAY * 3)
    with Engine(smollm2_path, n_ctx=4096, threads=THREADS, gate="verify", budget=40) as eng:
        seen = []
        for _ in range(7):  # one conversation: each turn is the same document and question again
            s = eng.stream(short, max_tokens=8)
            "".join(s)
            d = s.decision
            seen.append("rest" if d.check_rested is not None else "pass" if d.evicted else "refused"
                        if d.verify_m else "other")
            if d.check_rested is not None:
                assert d.verify_m is None and d.kept >= d.T and "without one" in d.reason
                assert d.check_rested >= 2  # the refusals in a row that led here
        # 40 cells cannot hold the number: every check that runs is refused (the premise, checked)
        assert seen == ["refused", "refused", "rest", "refused", "rest", "rest", "refused"], seen
        n = len(eng.history)
        eng.rewind(n - 3)  # the last answer's tail: the conversation the refusals were counted on is still there
        assert eng.backoff.refused == 4
        eng.rewind(eng.backoff.at)  # back to before the last checked message: they go with it
        assert eng.backoff.refused == 0 and eng.backoff.rest == 0


def test_backoff_rests_longer_after_each_refusal_and_starts_over_on_a_pass():
    from page_local.engine.selfcheck import Backoff

    b = Backoff()
    turns = []
    for verdict in [False, False, None, False, None, None, False, None, None, None, None, True, False]:
        if b.resting():
            turns.append("rest")
            continue
        turns.append(verdict)
        b.record(verdict)
    assert turns == [False, False, "rest", False, "rest", "rest", False, "rest", "rest", "rest", "rest", True, False]
    assert b.rest == 0 and b.refused == 1  # one refusal after a pass: no rest yet
