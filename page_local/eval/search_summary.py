"""The budget-search figures of docs/results.md, per evictor, from the rows of `eval run --gates
[always,]verify,search` (one file may hold several evictors' runs on the same inputs):

    python -m page_local.eval.search_summary docs/results-search-qwen-2048/rows.jsonl.gz

plain / verify: answers lost of the (input, budget) pairs right with the full cache, and committed
caches with ΔNLL > 1 nat; search: lost of the inputs right, inputs evicted, mean and median T/kept,
and that mean over SnapKV's verify at 0.25 on the same inputs (today's default); the median decode
rate (tok/s) of the full cache and of the caches search chose; the tokens the check decodes per input,
smallest first (the engine) and every rung's whole answer (the first version, one batch).
"""

from __future__ import annotations

import argparse
import json
import statistics as st
from collections import defaultdict

from page_local.eval.rows import FULL, read_rows_file
from page_local.eval.verify_rules import forced, search_forced


def _rate(t: dict) -> float | None:
    return t["gen_tokens"] / t["gen_ms"] * 1e3 if t.get("gen_tokens", 0) >= 2 and t.get("gen_ms") else None


def summary(rows) -> dict:
    full = {(r["task"], r["index"]): r for r in rows if r["gate"] == FULL}
    right = {i for i, r in full.items() if r["correct"]}
    default = {(r["task"], r["index"]): r["compression"] if r["evicted"] else 1.0 for r in rows
               if r["gate"] == "verify" and r["evictor"] == "snapkv" and r["budget"] == 0.25}
    out = {}
    for ev in sorted({r["evictor"] for r in rows if r["gate"] != FULL}, key=lambda e: e != "snapkv"):
        mine = [r for r in rows if r.get("evictor") == ev]
        line = {}
        for g in ("always", "verify"):
            sel = [r for r in mine if r["gate"] == g]
            if sel:
                line[g] = dict(lost=sum((r["task"], r["index"]) in right and not r["correct"] for r in sel),
                               pairs=sum((r["task"], r["index"]) in right for r in sel),
                               dnll=sum(bool(r["evicted"]) and (r.get("delta_nll") or 0) > 1 for r in sel), n=len(sel))
        search = [r for r in mine if r["gate"] == "search"]
        if search:
            comp = {(r["task"], r["index"]): r["compression"] if r["evicted"] else 1.0 for r in search}
            common = [i for i in comp if i in default]
            ver = {(r["task"], r["index"], r["B"]): r for r in mine if r["gate"] == "verify"}
            chosen = [_rate(ver[(r["task"], r["index"], r["B"])]["timings"]) for r in search
                      if r["evicted"] and (r["task"], r["index"], r["B"]) in ver]
            by_input = defaultdict(dict)
            for r in mine:
                if r["gate"] == "verify":
                    by_input[(r["task"], r["index"])][r["budget"]] = r
            first, batch = [], []
            for d in by_input.values():
                bs = sorted(d)
                first.append(search_forced([d[b] for b in bs]))
                batch.append(sum(d[b]["verify_tokens"] + 1 for b in bs if forced(d[b])))
            line["search"] = dict(
                lost=sum((r["task"], r["index"]) in right and not r["correct"] for r in search),
                right=sum((r["task"], r["index"]) in right for r in search), evicted=sum(bool(r["evicted"]) for r in search),
                n=len(search), dnll=sum(bool(r["evicted"]) and (r.get("delta_nll") or 0) > 1 for r in search),
                mean=st.mean(comp.values()), median=st.median(comp.values()),
                over_default=(st.mean(comp[i] for i in common) / st.mean(default[i] for i in common)) if common else None,
                full_tok_s=st.median(x for x in (_rate(full[i]["timings"]) for i in comp) if x is not None),
                chosen_tok_s=st.median(x for x in chosen if x is not None) if any(x is not None for x in chosen) else None,
                forced_smallest_first=st.mean(first) if first else None, forced_one_batch=st.mean(batch) if batch else None)
        out[ev] = line
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rows")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    try:
        s = summary(read_rows_file(a.rows))
    except ValueError as e:
        ap.error(str(e))
    if a.json:
        print(json.dumps(s))
        return
    for ev, line in s.items():
        parts = [f"{g}: lost {x['lost']}/{x['pairs']} pairs, ΔNLL > 1 on {x['dnll']}/{x['n']}"
                 for g, x in line.items() if g != "search"]
        print(f"[{ev}] " + " | ".join(parts))
        x = line.get("search")
        if x:
            over = "" if x["over_default"] is None else f", {x['over_default']:.2f}x SnapKV verify at 0.25"
            print(f"  search: lost {x['lost']}/{x['right']}, evicted {x['evicted']}/{x['n']}, ΔNLL > 1 on {x['dnll']}, "
                  f"T/kept mean {x['mean']:.2f} median {x['median']:.2f}{over}")
            print(f"  decode tok/s: full {x['full_tok_s']:.1f}, chosen caches "
                  + ("-" if x["chosen_tok_s"] is None else f"{x['chosen_tok_s']:.1f}")
                  + f"; check tokens per input: smallest first {x['forced_smallest_first']:.1f}, "
                  f"one batch {x['forced_one_batch']:.1f}")


if __name__ == "__main__":
    main()
