"""engine/narrate.py on hand-built Decisions: every kind of turn is told by what happened to the cache
first (the verdict that decided it), then why. The 'verify-refused' case is the bug this module
fixed: a /read essay whose self-verification refused the eviction was reported as 'gate open ...
kept 1897/1897'."""

from __future__ import annotations

import pytest

from page_local.engine import narrate
from page_local.engine import Result
from tests.fakes import decision

VERIFY = dict(gate_mode="verify", rule="forced", open=True)  # verify's base gate is "always"

CASES = {
    "verify-committed": (
        decision(T=1936, B=484, kept=968, evicted=True, D=0.1109, verify_m=12, verify_until="cap",
                 verify_rule="argmax", verify_score=0.0, verify_threshold=0.0, **VERIFY),
        "evicted to 968 of 1936, verified (0 changed top tokens <= 0 over 12 tokens)"),
    "verify-refused": (
        decision(T=1897, B=474, kept=1897, evicted=False, D=0.1109, verify_m=12, verify_until="cap",
                 verify_rule="mean", verify_score=1.76, verify_threshold=0.05, verify_delta=1.76, **VERIFY),
        "verify refused: full cache of 1897 kept (mean loss 1.7600 > 0.05 nats/token over 12 tokens)"),
    "verify-answer-end": (
        decision(T=638, B=159, kept=159, evicted=True, verify_m=7, verify_until="end", verify_rule="max",
                 verify_score=0.0123, verify_threshold=0.5, **VERIFY),
        "evicted to 159 of 638, verified (largest per-token loss 0.0123 <= 0.5 nats over 7 tokens and the "
        "answer's end)"),
    "verify-nothing-to-evict": (
        decision(T=37, B=1024, kept=37, verify_m=0, verify_rule="argmax", verify_score=0.0, verify_threshold=0.0,
                 **VERIFY),
        "full cache kept: 37 tokens, within the speed budget of 1024"),
    "verify-no-room": (
        decision(T=638, B=159, kept=638, verify_rule="argmax", verify_threshold=0.0, **VERIFY),
        "verify skipped (no room in the cache for the candidate): full cache of 638 kept"),
    "verify-stopped-early": (
        decision(T=638, B=159, kept=638, **VERIFY),
        "not verified (the answer stopped before the check): full cache of 638 kept"),
    "page+verify-closed": (
        decision(T=638, B=159, D=0.0209, gate_mode="page+verify"),
        "gate closed (D 0.0209 < 0.07): full cache of 638 kept"),
    "page+verify-committed": (
        decision(T=638, B=159, kept=159, evicted=True, D=0.1109, open=True, gate_mode="page+verify",
                 verify_m=12, verify_until="cap", verify_rule="argmax", verify_score=0.0, verify_threshold=0.0),
        "evicted to 159 of 638, verified (0 changed top tokens <= 0 over 12 tokens)"),
    "page-closed": (
        decision(T=638, B=159, D=0.0209),
        "gate closed (D 0.0209 < 0.07): full cache of 638 kept"),
    "page-open": (
        decision(T=638, B=159, kept=159, evicted=True, open=True, D=0.1109),
        "evicted to 159 of 638, gate open (D 0.1109 >= 0.07)"),
    "page-calibrated-closed": (
        decision(T=638, B=159, D=0.0209, z=-1.2, rule="calibrated"),
        "gate closed (calibrated z -1.20 < -0.6934, D 0.0209): full cache of 638 kept"),
    "page-no-D": (
        decision(T=20, B=36, D=None, rule="none"),
        "gate closed (no D: the probe saw fewer than 2 heads): full cache of 20 kept"),
    "page-measured": (  # Engine.measure (`inspect`): the gate opened, nothing was evicted
        decision(T=638, B=159, open=True, D=0.1109),
        "gate open (D 0.1109 >= 0.07): would evict to 159 of 638"),
    "always": (
        decision(T=638, B=159, kept=159, evicted=True, open=True, gate_mode="always", rule="forced"),
        "evicted to 159 of 638 (gate always, unchecked)"),
    "always-nothing-to-evict": (
        decision(T=37, B=1024, open=True, gate_mode="always", rule="forced"),
        "full cache kept: 37 tokens, within the speed budget of 1024"),
    "never": (
        decision(T=638, B=159, gate_mode="never", rule="forced"),
        "full cache of 638 kept (gate never)"),
}


@pytest.mark.parametrize("d, expected", CASES.values(), ids=CASES.keys())
def test_status_says_what_happened(d, expected):
    assert narrate.status(d) == expected


def test_a_refused_verification_is_not_told_as_an_open_gate():
    d, _ = CASES["verify-refused"]
    for text in (narrate.status(d), narrate.why(d).split("\n")[1]):
        assert "gate open" not in text and "evicted to" not in text, text
    assert "the full cache was kept. All 1897 positions were kept" in narrate.why(d)


@pytest.mark.parametrize("d, expected", CASES.values(), ids=CASES.keys())
def test_why_starts_with_the_status_and_ends_with_the_record(d, expected):
    lines = narrate.why(d).split("\n")
    assert lines[0] == f"What happened: {expected}."
    assert lines[-1] == f"The engine's record: {d.reason}."
    assert "arXiv 2609.22157" in lines[-2]


@pytest.mark.parametrize("name, needles", [
    ("verify-committed", ["Self-verification decided: the first 12 tokens of the answer were generated with the "
                          "full cache", "so the eviction was committed. The snapkv evictor kept 968 of 1936"]),
    ("verify-answer-end", ["the whole answer (7 tokens and its end) was generated"]),
    ("page+verify-committed", ["Before that, PAGE's gate open (D 0.1109 >= 0.07) let the candidate through."]),
    ("verify-nothing-to-evict", ["Nothing was evicted: the 37 positions fit within the budget of 1024."]),
    ("verify-no-room", ["not checked (no room in the cache for the candidate), and an unchecked eviction is "
                        "never committed. All 638 positions were kept"]),
    ("page-open", ["The gate opened: late layers' heads agree much less", "kept 159 of 638 positions (budget 159, "
                   "4.0x smaller); the answer was generated from the compressed cache."]),
    ("page-closed", ["The gate kept the full cache: head agreement barely drops", "raw threshold 0.07",
                     "`page-local calibrate`"]),
    ("page-calibrated-closed", ["calibrated z -1.20", "this model's calibration profile is in use."]),
    ("page-no-D", ["fewer than 2 heads, so there is no D"]),
    ("page-measured", ["An eviction to 159 of 638 positions would run (nothing was evicted: a measurement)."]),
    ("always", ["forced to 'always', so D was not consulted"]),
    ("never", ["forced to 'never', so D was not consulted. All 638 positions were kept"]),
], ids=lambda v: v if isinstance(v, str) else "")
def test_why_explains_the_deciding_step(name, needles):
    text = narrate.why(CASES[name][0])
    for n in needles:
        assert n in text, (n, text)


def test_summary_adds_the_generation():
    d, status = CASES["verify-refused"]
    r = Result("Paris is the capital.", list(range(12)), d, "stop", prompt_tokens=1897, gen_s=0.24)
    assert narrate.summary(r) == f"{status}; 12 tokens at 50.0 tok/s; finish: stop"


def test_room_making_is_told_after_what_the_turn_did():
    from page_local.engine import narrate
    from fakes import decision

    d = decision(T=4494, B=1123, kept=1123, open=True, evicted=True, gate_mode="verify", rule="forced",
                 verify_m=12, verify_until="end", verify_rule="argmax", verify_score=0.0, verify_threshold=0.0,
                 room_evicted=933, room_from=(28, 1863), chunks=3, prompt_tokens=4494, prompt_held=3561)
    s = narrate.status(d)
    assert s.startswith("evicted to 1123 of 4494, verified")
    assert "context full: 933 earlier tokens deleted to make room (unchecked); read in 3 parts, 3561 of its 4494 tokens held" in s
    assert "positions 28-1863" in narrate.why(d) and "not checked" in narrate.why(d)
    assert "attend to least went" not in narrate.why(d)  # no ranking recorded: none is told
    told = {r: narrate.why(decision(**{**d.to_dict(), "room_ranking": r})) for r in ("question", "hybrid", "bm25")}
    assert "the cells they attend to least went" in told["question"]
    assert "sentences least attended to and sharing the fewest of your question's words went" in told["hybrid"]
    assert "sentences sharing the fewest of your question's words went" in told["bm25"]
    plain = decision(T=638, B=159, kept=638, open=False, evicted=False, gate_mode="page", rule="raw", D=0.02)
    assert narrate.room_words(plain) is None and "context full" not in narrate.status(plain)


def test_budget_search_is_told_by_its_rungs():
    from page_local.engine import narrate
    from fakes import decision

    rungs = [dict(B=40, label="1/16", score=3.0, passed=False), dict(B=80, label="1/8", score=0.0, passed=True),
             dict(B=160, label="1/4", score=0.0, passed=True)]
    d = decision(T=640, B=80, kept=80, open=True, evicted=True, gate_mode="search", rule="forced", verify_m=9,
                 verify_rule="argmax", verify_score=0.0, verify_threshold=0.0, search=rungs)
    assert narrate.status(d) == "kept 1/8: 80 of 640 (passed 1/8, 1/4; 1/16 failed)"
    refused = decision(T=640, B=160, kept=640, open=True, evicted=False, gate_mode="search", rule="forced",
                       verify_m=9, verify_rule="argmax", verify_score=2.0, verify_threshold=0.0,
                       search=[dict(r, passed=False) for r in rungs])
    assert narrate.status(refused).startswith("search refused every budget (1/16, 1/8, 1/4 failed)")
    smallest_first = decision(T=640, B=80, kept=80, open=True, evicted=True, gate_mode="search", rule="forced",
                              verify_m=9, verify_rule="argmax", verify_score=0.0, verify_threshold=0.0,
                              search=rungs[:2] + [dict(rungs[2], score=None, passed=None)])
    assert narrate.status(smallest_first) == "kept 1/8: 80 of 640 (passed 1/8; 1/16 failed; 1/4 not needed)"
    parked = decision(T=640, B=160, kept=160, open=True, evicted=True, gate_mode="search", rule="forced", verify_m=9,
                      verify_rule="argmax", verify_score=0.0, verify_threshold=0.0, parked=480,
                      search=[dict(B=160, label="1/4", score=0.0, passed=True),
                              dict(B=320, label="1/2", score=None, passed=None)])
    assert narrate.status(parked) == "attending to 160 of 640 tokens (1/4), 480 set aside (passed 1/4; 1/2 not needed)"
    # a check that could not pay back was not prepared: its rungs say nothing
    unpaid = decision(T=3000, kept=3000, open=True, gate_mode="search", check_unpaid=40,
                      search=[dict(B=750, label="1/4", score=None, passed=None)])
    assert narrate.status(unpaid).startswith("full cache kept: 3000 tokens, unchecked (about 40 answer tokens")


def test_a_conversation_below_park_from_says_why_the_full_cache_was_kept():
    d = decision(T=713, open=True, D=0.1, gate_mode="verify", park_from=2048)
    assert narrate.status(d) == "full cache kept: 713 tokens (setting tokens aside pays from 2048)"


def test_a_resting_check_says_so():
    d = decision(T=1900, kept=1900, open=True, D=0.1, gate_mode="verify", check_rested=2)
    assert narrate.status(d) == "full cache kept: 1900 tokens, unchecked (the last 2 checks were refused)"
    assert "without paying for one" in narrate.why(d)


def test_an_answer_over_within_the_check_says_why_none_ran():
    d = decision(T=2400, kept=2400, open=True, D=0.1, gate_mode="verify", check_unneeded=12)
    assert narrate.status(d) == ("full cache kept: 2400 tokens, unchecked (the answer was over within the check, "
                                 "12 tokens: nothing left to speed up)")
    assert "no check was run" in narrate.why(d) and "chooses again" in narrate.why(d)


def test_parking_is_told_as_set_aside():
    d = decision(T=2321, kept=580, open=True, evicted=True, rule="forced", gate_mode="always", parked=1741,
                 restored=1733)
    assert narrate.status(d).startswith("attending to 580 of 2321 tokens, 1741 set aside, gate always")
    assert "1733 set-aside tokens back for this message" in narrate.status(d)
    assert "set aside, not deleted" in narrate.why(d)
