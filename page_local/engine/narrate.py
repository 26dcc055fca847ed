"""A Decision told in words, in one place: the status phrase after a turn (`run`'s stderr and the
REPL's status line), the summary with the generation (`run`), the gate's verdict (`inspect`) and
the `/why` explanation (the REPL).

Every text says first what happened to the cache, then what decided it. The order is the order of
authority in a turn (engine.Decision):
  1. self-verification ran (verify modes, verify_m > 0): its verdict decides, whatever the base gate said;
  2. the gate opened but T <= B (verify_m == 0 in the verify modes): there was nothing to evict;
  3. a verify mode whose check did not run (verify_m is None: no room for the candidate, or the answer
     stopped before the check): the full cache was kept;
  4. otherwise the base gate: forced (always / never) or PAGE's rule on D (raw or calibrated).

Pure functions of the Decision's fields: no engine, no console (tests/test_narrate.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from page_local.gate import RAW_THRESHOLD, VERIFY_MODES, Z_THRESHOLD
from page_local.verify import describe

if TYPE_CHECKING:
    from page_local.engine.engine import Decision, Result


def _rule_words(d: Decision) -> str:
    """PAGE's rule on this input: 'D 0.1109 >= 0.07' or 'calibrated z -1.20 < -0.6934, D 0.0209'."""
    cmp = ">=" if d.open else "<"
    # The engine's gate uses the default thresholds (gate.Gate.for_model); the Decision does not carry them.
    if d.rule == "calibrated" and d.z is not None:
        return f"calibrated z {d.z:+.2f} {cmp} {Z_THRESHOLD:g}, D {d.D:.4f}"
    return f"D {d.D:.4f} {cmp} {RAW_THRESHOLD:g}"


def gate_words(d: Decision) -> str:
    """What the base gate said: 'gate open (D 0.1109 >= 0.07)', 'gate closed (calibrated z -1.20 <
    -0.6934, D 0.0209)', 'gate always' when forced."""
    if d.rule == "forced":
        return f"gate {'always' if d.open else 'never'}"
    state = "open" if d.open else "closed"
    if d.rule == "none" or d.D is None:
        return f"gate {state} (no D: the probe saw fewer than 2 heads)"
    return f"gate {state} ({_rule_words(d)})"


def _span(d: Decision) -> str:
    n = d.verify_m
    return f"{n} token{'' if n == 1 else 's'}" + (" and the answer's end" if d.verify_until == "end" else "")


def _checked(d: Decision) -> str:
    return f"{describe(d.verify_rule, d.verify_score, d.verify_threshold)} over {_span(d)}"


def _unchecked(d: Decision) -> tuple[str, str]:
    """(label, why) for a verify mode whose check did not run."""
    # the engine records the rule before it looks for room: a rule without a span means it found none
    if d.verify_rule is not None:
        return "verify skipped", "no room in the cache for the candidate"
    return "not verified", "the answer stopped before the check"


def room_words(d: Decision) -> str | None:
    """What the context policy did to fit the turn (engine/room.py, engine/parking.py), or None when it did
    nothing: 'context full: 1840 earlier tokens deleted to make room (unchecked); read in 3 parts, 610 of its
    2604 tokens held; positions renumbered'."""
    parts = []
    if d.reread:
        parts.append(f"{d.reread} earlier tokens read again for this message (the context was cut before)")
    if d.restored:
        parts.append(f"{d.restored} set-aside tokens back for this message")
    if d.park_dropped:
        parts.append(f"context full: {d.park_dropped} set-aside tokens deleted (the least relevant)")
    if d.room_evicted:
        parts.append(f"context full: {d.room_evicted} earlier tokens deleted to make room (unchecked)")
    if d.chunks > 1:
        parts.append(f"read in {d.chunks} parts, {d.prompt_held} of its {d.prompt_tokens} tokens held")
    if d.gaps_closed:
        parts.append("positions renumbered to stay inside the trained context")
    return "; ".join(parts) or None


def status(d: Decision) -> str:
    """One phrase: what happened to the cache on this turn, then why; after it, what was done to make
    room (room_words), if anything.

    'evicted to 968 of 1936, verified (0 changed top tokens <= 0 over 12 tokens)',
    'verify refused: full cache of 1897 kept (3 changed top tokens > 0 over 12 tokens)',
    'gate closed (D 0.0209 < 0.07): full cache of 638 kept', 'full cache kept: 37 tokens, within the speed
    budget of 1024', 'evicted to 159 of 638 (gate always, unchecked)'; parking: 'attending to 580 of 2321 tokens,
    1741 set aside (verified: ...)'."""
    parts = [_turn_status(d), room_words(d), disk_words(d)]
    return "; ".join(p for p in parts if p)


def disk_words(d: Decision) -> str | None:
    """'8 192 tokens from the disk cache in 0.3 s' (engine/prefixes.py), or None."""
    if not d.disk_tokens:
        return None
    return f"{d.disk_tokens:,} tokens from the disk cache in {d.disk_ms / 1e3:.1f} s".replace(",", " ")


def _turn_status(d: Decision) -> str:
    # T is the whole conversation; the cells may hold less when earlier turns were evicted
    full = f"full cache of {d.T} kept" if d.kept >= d.T else f"nothing evicted this turn ({d.kept} of {d.T} held)"
    if d.park_from is not None:
        return f"full cache kept: {d.T} tokens (setting tokens aside pays from {d.park_from})"
    if d.check_rested is not None:
        return f"full cache kept: {d.T} tokens, unchecked (the last {d.check_rested} checks were refused)"
    if d.check_unneeded is not None:
        return (f"full cache kept: {d.T} tokens, unchecked (the answer was over within the check, "
                f"{d.check_unneeded} tokens: nothing left to speed up)")
    if d.check_unpaid is not None:
        return (f"full cache kept: {d.T} tokens, unchecked (about {d.check_unpaid} answer tokens expected after the "
                "check: too few to pay it back)")
    if d.search:
        passed = [r["label"] for r in d.search if r["passed"]]
        failed = [r["label"] for r in d.search if r["passed"] is False]
        skipped = [r["label"] for r in d.search if r["passed"] is None]
        tried = "; ".join(x for x in (f"passed {', '.join(passed)}" if passed else "",
                                      f"{', '.join(failed)} failed" if failed else "",
                                      f"{', '.join(skipped)} not needed" if skipped else "") if x)
        if d.evicted:
            chosen = next(r["label"] for r in d.search if r["B"] == d.B)
            if d.parked:
                return f"attending to {d.kept} of {d.T} tokens ({chosen}), {d.parked} set aside ({tried})"
            return f"kept {chosen}: {d.kept} of {d.T} ({tried})"
        return f"search refused every budget ({tried}): {full}"
    verify = d.gate_mode in VERIFY_MODES
    kept = (f"attending to {d.kept} of {d.T} tokens, {d.parked} set aside" if d.parked
            else f"evicted to {d.kept} of {d.T}")
    if verify and d.verify_m:
        if d.evicted:
            return f"{kept}, verified ({_checked(d)})"
        return f"verify refused: {full} ({_checked(d)})"
    if d.open and d.T <= d.B:
        return f"full cache kept: {d.T} tokens, within the speed budget of {d.B}"
    if d.evicted and d.parked:
        return f"{kept}, {gate_words(d)}"
    if d.evicted:
        if d.rule == "forced":
            return f"evicted to {d.kept} of {d.T} (gate always, unchecked)"
        return f"evicted to {d.kept} of {d.T}, {gate_words(d)}"
    if not d.open:
        return f"{full} (gate never)" if d.rule == "forced" else f"{gate_words(d)}: {full}"
    if verify:  # open, T > B, no verdict
        label, reason = _unchecked(d)
        return f"{label} ({reason}): {full}"
    # open, T > B and nothing evicted: a measurement only (Engine.measure, `inspect`)
    return f"{gate_words(d)}: would evict to {d.B} of {d.T}"


def summary(r: Result) -> str:
    """The status, then the generation: '<status>; 12 tokens at 45.1 tok/s; finish: length'."""
    return (f"{status(r.decision)}; {len(r.tokens)} tokens at {r.tokens_per_s:.1f} tok/s; "
            f"finish: {r.finish_reason}")


def why(d: Decision) -> str:
    """/why: what happened, what decided it and why, in plain sentences; then what D is; then the
    engine's own record (Decision.reason). Lines separated by newlines."""
    ev = f"The {d.evictor} evictor kept {d.kept} of {d.T} positions (budget {d.B}, {d.compression:.1f}x smaller)"
    if d.parked:
        ev += (f"; the other {d.parked} were set aside, not deleted: they stay in memory, out of the attention, and "
               "come back before your next message is read, which chooses again")
    kept_all = f"All {d.T} positions were kept; nothing was dropped."
    verify = d.gate_mode in VERIFY_MODES
    if verify and d.verify_m:
        span = (f"the whole answer ({d.verify_m} tokens and its end) was" if d.verify_until == "end" else
                f"the first {d.verify_m} tokens of the answer were")
        text = (f"Self-verification decided: {span} generated with the full cache, then re-scored on the "
                f"evicted cache in one batch: {describe(d.verify_rule, d.verify_score, d.verify_threshold)}, so "
                + (f"the eviction was committed. {ev}." if d.evicted else f"the full cache was kept. {kept_all}"))
        if d.gate_mode == "page+verify":
            text += f" Before that, PAGE's {gate_words(d)} let the candidate through."
    elif d.open and d.T <= d.B:
        text = f"Nothing was evicted: the {d.T} positions fit within the budget of {d.B}."
    elif d.check_rested is not None:
        text = (f"The check was refused on the last {d.check_rested} turns, so this turn kept the full cache "
                "without paying for one; the conversation is checked again after a rest that doubles with each "
                f"further refusal (up to 8 turns). {kept_all}")
    elif d.check_unneeded is not None:
        text = (f"The answer was over within the check's span ({d.check_unneeded} tokens), so nothing was left for "
                "a smaller attention set to speed up, and your next message chooses again from every cell: no check "
                f"was run and the full cache was kept. {kept_all}")
    elif d.check_unpaid is not None:
        text = (f"At the check's cap, about {d.check_unpaid} more answer tokens were expected (from the request's "
                "max_tokens and this conversation's earlier answers): too few for a smaller attention set to win back "
                f"what the check costs, so no check was run and the full cache was kept. {kept_all}")
    elif verify and d.open:
        text = (f"The evicted candidate was not checked ({_unchecked(d)[1]}), and an unchecked eviction "
                f"is never committed. {kept_all}")
    elif d.rule == "forced":
        text = (f"The gate is forced to '{d.gate_mode}', so D was not consulted. "
                + (f"{ev}; the answer was generated from the compressed cache." if d.evicted else kept_all))
    elif d.rule == "none" or d.D is None:
        text = f"The gate kept the full cache: the probe saw fewer than 2 heads, so there is no D. {kept_all}"
    elif d.open:
        text = ("The gate opened: late layers' heads agree much less than early layers' on which positions "
                f"matter (a large drop: {_rule_words(d)}), which PAGE reads as eviction being safe. "
                + (f"{ev}; the answer was generated from the compressed cache." if d.evicted else
                   f"An eviction to {d.B} of {d.T} positions would run (nothing was evicted: a measurement)."))
    else:
        text = ("The gate kept the full cache: head agreement barely drops from early to late layers (a small "
                f"drop: {_rule_words(d)}), which PAGE reads as an input that needs its whole context. {kept_all}")
    note = ("D is the mean head agreement of the first third of the layers minus that of the last third "
            "(PAGE, arXiv 2609.22157). Its threshold is a hypothesis per model: "
            + ("this model's calibration profile is in use." if d.rule == "calibrated" else
               f"without a profile the raw threshold {RAW_THRESHOLD:g} is used; calibrate this model with "
               "`page-local calibrate` when it is available."))
    room = room_words(d)
    if d.restored and not (d.park_dropped or d.room_evicted or d.chunks > 1):
        text += (f" Before your message was read, the {d.restored} tokens set aside earlier came back, so it was "
                 "read against the whole conversation.")
    elif room:
        text += (f" To fit the turn in the context: {room}. Making room is not checked: the full conversation "
                 "no longer fits, so there is no full cache to check the answer against.")
        if d.room_from is not None:
            text += f" The evicted cells were at positions {d.room_from[0]}-{d.room_from[1]}."
        if d.room_ranking == "question":
            text += (" They were chosen by what your message asks: its last tokens were read with the probe "
                     "first, and the cells they attend to least went.")
        elif d.room_ranking in ("hybrid", "bm25"):
            text += (" They were chosen by what your message asks, whole sentences at a time: its last tokens were "
                     "read with the probe first, and the sentences "
                     f"{'least attended to and ' if d.room_ranking == 'hybrid' else ''}sharing the fewest of your "
                     "question's words went.")
        elif d.room_ranking == "recent":
            text += " They were chosen by the conversation's newest tokens (room ranking 'recent')."
    if d.disk_tokens:
        text += (f" The first {d.disk_tokens} tokens of your message were not read: a conversation read them before "
                 f"and the disk cache kept their cache, restored in {d.disk_ms / 1e3:.1f} s (`page-local cache` lists "
                 "what it keeps).")
    return f"What happened: {status(d)}.\n{text}\n{note}\nThe engine's record: {d.reason}."
