"""Compare self-verification rules post hoc on the rows of one `eval run` (verify.verify_score on each
row's per-token trace: verify_loss, verify_changed, verify_end).

A run made with --verify-m C holds each candidate's trace over the full cache's answer up to its end or
C tokens, so any rule, threshold and cap c <= C can be re-decided without decoding again. The answer a
committed eviction gives is the full cache's when the whole answer was checked; past the cap it is the
checked tokens plus the candidate's continuation, known from the rows only at the run's own cap (else
counted as `unknown`). --old FILE adds the rows of a run made before verify.py (mean over m = 16) for
the same samples, read as they are.

    python -m page_local.eval.verify_rules results/x.jsonl --old docs/results-smollm2-2048/rows.jsonl.gz
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import numpy as np

from page_local.engine.turn import forced_tokens, search_tokens
from page_local.verify import verify_score
from page_local.eval.rows import read_rows, read_rows_file

DEFAULT_RULES = ("mean:0.05", "max:0.25", "max:0.5", "max:1.0", "sum:1.0", "argmax:0")


def _candidates(rows, evictor: str) -> dict:
    """(task, index, budget) -> one candidate's row (the plain-evictor row carries the trace), with
    `same_answer`: the candidate's own greedy answer is the full cache's."""
    full = {(r["task"], r["index"]): r["prediction"] for r in rows if r.get("gate") == "full"}
    out = {}
    for r in rows:
        if r.get("evictor") == evictor and r.get("gate") == "always" and r.get("verify_loss") is not None:
            same = r["prediction"] == full.get((r["task"], r["index"]))
            out[(r["task"], r["index"], r["budget"])] = dict(r, same_answer=same)
    return out


def decide(r: dict, rule: str, threshold: float, cap: int) -> tuple[bool, bool | None]:
    """(committed, committed answer correct or None if unknown) for one candidate row under a rule."""
    loss = np.asarray(r["verify_loss"], dtype=np.float64)
    k = int(r["verify_tokens"] or 0)
    if k == 0:
        return False, r["correct_full"]
    changed = np.zeros(loss.size, dtype=bool)
    changed[np.asarray(r["verify_changed"], dtype=int)] = True
    run_cap = int(r["verify_m"])
    whole = k < cap  # the answer ended before the cap: its trace (with the end) is the same
    n = loss.size if whole else cap
    v = verify_score(loss[:n], np.zeros(n), changed[:n], rule=rule, threshold=threshold)
    committed = v.passed and bool(r["evicted"])
    if not committed:
        return False, r["correct_full"]
    if whole:
        return True, r["correct_full"]
    if cap == run_cap:
        return True, r.get("correct_committed")
    return True, None


def table(rows, old_rows=None, rules=DEFAULT_RULES, caps=(64,), evictor: str = "snapkv") -> list[dict]:
    cands = _candidates(rows, evictor)
    budgets = sorted({k[2] for k in cands}, reverse=True)
    out = []
    specs = [(f"{rs} cap {c}", rs.split(":")[0], float(rs.split(":")[1]), c) for c in caps for rs in rules]
    old = {}
    if old_rows:
        for r in old_rows:
            if r.get("evictor") == evictor and r.get("gate") == "verify":
                old[(r["task"], r["index"], r["budget"])] = r
    for b in budgets:
        keys = [k for k in cands if k[2] == b]
        T = {k: cands[k]["T"] for k in keys}
        kept = {k: cands[k]["kept"] for k in keys}  # the always row: the candidate's kept
        right = [k for k in keys if cands[k]["correct_full"]]
        # the old rule: mean over the first 16 tokens (end not checked) <= 0.05; decided from the trace
        # (it reproduces the old rows' delta_self); the committed answer's correctness from the old rows
        dec = {}
        for k in keys:
            r = cands[k]
            n16 = min(int(r["verify_tokens"] or 0), 16)
            loss = np.asarray(r["verify_loss"][:n16], dtype=np.float64)
            passed = n16 > 0 and verify_score(loss, np.zeros(n16), rule="mean", threshold=0.05).passed
            com = passed and bool(r["evicted"])
            if not com or r["verify_tokens"] < 16:
                dec[k] = (com, r["correct_full"])
            else:
                o = old.get(k)
                dec[k] = (com, None if o is None else bool(o["correct"]))
        out.append(_line(b, "mean:0.05 first 16 (old)", keys, right, dec, cands, T, kept))
        for label, rule, thr, cap in specs:
            dec = {k: decide(cands[k], rule, thr, cap) for k in keys}
            out.append(_line(b, label, keys, right, dec, cands, T, kept))
    return out


def _line(b, label, keys, right, dec, cands, T, kept) -> dict:
    return dict(
        budget=b, rule=label, n=len(keys), right=len(right),
        lost=sum(dec[k][0] and dec[k][1] is False for k in right),
        unknown=sum(dec[k][0] and dec[k][1] is None for k in right),
        cand_wrong=sum(dec[k][0] and not cands[k]["correct_candidate"] for k in right),
        dnll_harm=sum(dec[k][0] and cands[k]["delta_nll_candidate"] > 1 for k in keys),
        answer_changed=sum(dec[k][0] and not cands[k]["same_answer"] for k in keys),
        evicted=float(np.mean([dec[k][0] for k in keys])),
        compression=float(np.mean([T[k] / kept[k] if dec[k][0] else 1.0 for k in keys])))


def by_task(rows, rule: str, threshold: float, cap: int, evictor: str = "snapkv") -> dict:
    """task -> (committed pairs, pairs) under one rule, for the per-task open rates."""
    cands = _candidates(rows, evictor)
    acc = defaultdict(lambda: [0, 0])
    for k, r in cands.items():
        acc[k[0]][0] += decide(r, rule, threshold, cap)[0]
        acc[k[0]][1] += 1
    return dict(acc)


def forced(r: dict) -> int:
    """Tokens the engine's check decodes on this candidate row (engine/turn.py forced_tokens, from the
    row's trace under the argmax rule: it stops at the chunk of the first changed top token); 0 when
    nothing was evicted or checked."""
    if not r.get("verify_tokens") or r.get("B") is None or r["B"] >= r["T"]:
        return 0
    ch = r.get("verify_changed") or []
    return forced_tokens(int(r["verify_tokens"]) + 1, ch[0] if ch else None)


def search_forced(rs: list[dict]) -> int:
    """Tokens the engine's check decodes as gate search over these candidate rows of one input (its rungs,
    smallest first; engine/turn.py search_tokens: every first chunk in one batch, then smallest first up
    to the first that passes); rows not evicted or not checked take no part."""
    rs = [r for r in rs if forced(r)]
    if not rs:
        return 0
    return search_tokens(int(rs[0]["verify_tokens"]) + 1, [(r.get("verify_changed") or [None])[0] for r in rs])


def _search_line(right: list, choice: dict, cost: dict | None = None) -> dict:
    """One line of the search table. choice: input -> (T/kept of the committed cache or None when the
    full cache was kept, the committed answer correct (None: unknown)); right: inputs right with the full
    cache; cost: input -> tokens the check decoded (mean reported as `forced`)."""
    comp = [1.0 if c is None else c for c, _ in choice.values()]
    return dict(n=len(choice), right=len(right), forced=float(np.mean(list(cost.values()))) if cost else None,
                lost=sum(choice[i][0] is not None and choice[i][1] is False for i in right),
                unknown=sum(choice[i][0] is not None and choice[i][1] is None for i in right),
                evicted=float(np.mean([c is not None for c, _ in choice.values()])),
                compression=float(np.mean(comp)), median_compression=float(np.median(comp)))


def search(rows, rule: str = "argmax", threshold: float = 0.0, cap: int = 64, evictor: str = "snapkv") -> dict:
    """Gate "search" re-decided from the rows: per input, the smallest budget whose check passes under
    the rule is committed (as Engine(gate="search") with the run's budgets as its ladder), else the full
    cache; beside it, verify at each fixed budget under the same rule. Returns {"search": line,
    "fixed": {budget: line}, "chosen": {task: {budget label: count}}} with lost answers, realized
    compression (mean and median T/kept) and the share of inputs evicted."""
    cands = _candidates(rows, evictor)
    inputs = sorted({k[:2] for k in cands})
    budgets = sorted({k[2] for k in cands})  # smallest first: the ladder

    right = [i for i in inputs if cands[(*i, budgets[0])]["correct_full"]]

    def line(choice: dict, cost: dict) -> dict:  # input -> (committed budget or None, committed answer correct)
        return _search_line(right, {i: (None if b is None else cands[(*i, b)]["T"] / cands[(*i, b)]["kept"], ok)
                                    for i, (b, ok) in choice.items()}, cost)

    chosen: dict = defaultdict(lambda: defaultdict(int))
    pick = {}
    for i in inputs:
        pick[i] = (None, cands[(*i, budgets[0])]["correct_full"])
        for b in budgets:
            committed, correct = decide(cands[(*i, b)], rule, threshold, cap)
            if committed:
                pick[i] = (b, correct)
                break
        chosen[i[0]][str(pick[i][0]) if pick[i][0] is not None else "full"] += 1
    fixed = {}
    for b in budgets:
        dec = {i: decide(cands[(*i, b)], rule, threshold, cap) for i in inputs}
        fixed[b] = line({i: (b if c else None, ok) for i, (c, ok) in dec.items()},
                        {i: forced(cands[(*i, b)]) for i in inputs} if rule == "argmax" else None)
    cost = None
    if rule == "argmax":  # first chunks batched, then smallest first up to the committed rung
        cost = {i: search_forced([cands[(*i, b)] for b in budgets]) for i in inputs}
    return {"search": line(pick, cost), "fixed": fixed, "chosen": {t: dict(v) for t, v in sorted(chosen.items())}}


def search_recorded(rows, evictor: str = "snapkv") -> dict:
    """Gate "search" read off the verify rows as they were recorded (whatever rule the run used, for runs
    without per-token traces): per input, the smallest budget whose verify row evicted. Same lines as
    search(): {"search": ..., "fixed": {budget: ...}}."""
    ver = defaultdict(dict)
    for r in rows:
        if r.get("evictor") == evictor and r.get("gate") == "verify":
            ver[(r["task"], r["index"])][r["budget"]] = r
    inputs = sorted(ver)
    budgets = sorted({b for v in ver.values() for b in v})

    right = [i for i in inputs if next(iter(ver[i].values()))["correct_full"]]

    def line(pick: dict, cost: dict) -> dict:  # input -> the committed verify row or None
        return _search_line(right, {i: (None, None) if r is None else (r["T"] / r["kept"], bool(r["correct"]))
                                    for i, r in pick.items()}, cost)

    pick = {i: next((ver[i][b] for b in budgets if b in ver[i] and ver[i][b]["evicted"]), None) for i in inputs}
    cost = {i: search_forced([ver[i][b] for b in budgets if b in ver[i]]) for i in inputs}
    fixed = {b: line({i: ver[i][b] if ver[i].get(b, {}).get("evicted") else None for i in inputs},
                     {i: forced(ver[i][b]) for i in inputs if b in ver[i]}) for b in budgets}
    chosen: dict = defaultdict(lambda: defaultdict(int))
    for i, r in pick.items():
        chosen[i[0]][str(r["budget"]) if r is not None else "full"] += 1
    return {"search": line(pick, cost), "fixed": fixed, "chosen": {t: dict(v) for t, v in sorted(chosen.items())}}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rows")
    ap.add_argument("--old", default=None, help="rows of a run made before verify.py (mean over 16 tokens)")
    ap.add_argument("--rules", default=",".join(DEFAULT_RULES), help="rule:threshold,...")
    ap.add_argument("--caps", default="64", help="comma-separated caps (each <= the run's --verify-m)")
    ap.add_argument("--evictor", default="snapkv")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--search", default=None, metavar="RULE:THRESHOLD",
                    help="re-decide gate 'search' (the run's budgets as the ladder) under this rule, e.g. argmax:0, "
                         "or 'recorded': from the verify rows as they were decided (runs without traces)")
    a = ap.parse_args(argv)
    try:
        rows = read_rows_file(a.rows)
    except ValueError as e:
        ap.error(str(e))
    if a.search:
        if a.search == "recorded":
            s = search_recorded(rows, a.evictor)
        else:
            rule, thr = a.search.split(":")
            s = search(rows, rule, float(thr), int(a.caps.split(",")[0]), a.evictor)
        if a.json:
            print(json.dumps(s))
            return
        print("| gate | correct answers lost (of right w/ full) | evicted | mean T/kept | median T/kept | "
              "tokens checked per input |")
        print("|---|---|---|---|---|---|")
        for label, x in [(f"verify at {b}", v) for b, v in s["fixed"].items()] + [("search (smallest passing)", s["search"])]:
            print(f"| {label} | {x['lost']}/{x['right']}" + (f" (+{x['unknown']} unknown)" if x["unknown"] else "")
                  + f" | {x['evicted']:.2f} | {x['compression']:.2f} | {x['median_compression']:.2f} | "
                  + ("–" if x["forced"] is None else f"{x['forced']:.1f}") + " |")
        print("\nchosen budget per task: " + "; ".join(f"{t} {dict(sorted(c.items()))}" for t, c in s["chosen"].items()))
        return
    samples = {(r["task"], r["index"]) for r in rows}
    old = [r for r in read_rows(a.old) if (r["task"], r["index"]) in samples] if a.old else None
    t = table(rows, old, rules=a.rules.split(","), caps=[int(c) for c in a.caps.split(",")], evictor=a.evictor)
    if a.json:
        print(json.dumps(t))
        return
    print("| budget | rule | correct answers lost (of right w/ full) | committed, candidate's own answer wrong | "
          "committed, candidate's answer ≠ full's | committed, ΔNLL > 1 | evicted | T/kept |")
    print("|---|---|---|---|---|---|---|---|")
    for x in t:
        unk = f" (+{x['unknown']} unknown)" if x["unknown"] else ""
        print(f"| {x['budget']} | {x['rule']} | {x['lost']}/{x['right']}{unk} | {x['cand_wrong']} | "
              f"{x['answer_changed']} | {x['dnll_harm']}/{x['n']} | {x['evicted']:.2f} | {x['compression']:.2f} |")


if __name__ == "__main__":
    main()
