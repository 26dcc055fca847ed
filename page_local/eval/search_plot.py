"""Realized compression against harm for the four ways of deciding an eviction, from the rows of `eval
run --gates always,verify,search` (docs/results.md, "Budget search"): plain eviction and verify at each
budget of the run, PAGE at each budget (re-decided from each input's recorded raw PAGE decision,
`page_open`: the plain eviction where it opened, the full cache elsewhere), and search (one point).

    python -m page_local.eval.search_plot --out docs/search-compression-harm.png \\
        Qwen=docs/results-search-qwen-2048/rows.jsonl.gz "SmolLM2 essay, LORE-KV=rows.jsonl.gz:lorekv"

Each RUN is LABEL=ROWS[:EVICTOR] (evictor default snapkv). x: mean T/kept over the inputs (1 for an input
that kept the full cache); y: the share of the answers right with the full cache that the committed
cache got wrong. Prints the points as JSON lines too.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import numpy as np

from page_local.eval.rows import read_rows_file


def points(rows, evictor: str = "snapkv") -> list[dict]:
    """One dict per (gate, budget): gate in plain, PAGE, verify, search; compression, lost, right, n."""
    full = {(r["task"], r["index"]): r for r in rows if r["gate"] == "full"}
    right = {k for k, r in full.items() if r["correct"]}
    by = defaultdict(dict)  # (gate, budget) -> input -> row
    for r in rows:
        if r["gate"] != "full" and r.get("evictor") == evictor:
            b = "ladder" if r["gate"] == "search" else r["budget"]
            by[(r["gate"], b)][(r["task"], r["index"])] = r

    def point(gate: str, budget, choice: dict) -> dict:  # input -> (T/kept or None for full, correct)
        comp = [1.0 if c is None else c for c, _ in choice.values()]
        lost = sum(1 for i in right if i in choice and choice[i][0] is not None and not choice[i][1])
        return dict(gate=gate, budget=budget, compression=float(np.mean(comp)), lost=lost,
                    right=sum(1 for i in right if i in choice), n=len(choice))

    out = []
    for (gate, b), rs in sorted(by.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        if gate == "always":
            out.append(point("plain", b, {i: (r["T"] / r["kept"], bool(r["correct"])) for i, r in rs.items()}))
            out.append(point("PAGE", b, {i: (r["T"] / r["kept"], bool(r["correct"])) if r["page_open"]
                                         else (None, bool(full[i]["correct"])) for i, r in rs.items()}))
        else:
            label = "verify" if gate == "verify" else "search"
            out.append(point(label, b, {i: (r["T"] / r["kept"], bool(r["correct"])) if r["evicted"]
                                        else (None, bool(full[i]["correct"])) for i, r in rs.items()}))
    return out


STYLE = {"plain": ("tab:red", "o"), "PAGE": ("tab:orange", "s"), "verify": ("tab:blue", "^"),
         "search": ("tab:green", "*")}


PER_ROW = 4  # panels per row of the figure


def plot(runs: list[tuple[str, list[dict]]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    ncol = min(PER_ROW, len(runs))
    nrow = -(-len(runs) // ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(4.2 * ncol, 3.8 * nrow), squeeze=False)
    for ax in axes.flat[len(runs):]:
        ax.set_visible(False)
    for ax, (label, pts) in zip(axes.flat, runs):
        for gate, (color, marker) in STYLE.items():
            sel = sorted((p for p in pts if p["gate"] == gate), key=lambda p: p["compression"])
            if not sel:
                continue
            xs = [p["compression"] for p in sel]
            ys = [p["lost"] / p["right"] if p["right"] else 0.0 for p in sel]
            ax.plot(xs, ys, marker=marker, color=color, label=gate, linestyle="-" if len(sel) > 1 else "",
                    markersize=11 if gate == "search" else 6)
        right = max((p["right"] for p in pts), default=0)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("mean realized compression (T / kept)")
        ax.set_ylabel("share of correct answers lost")
        ax.set_title(f"{label} ({right} right with the full cache)", fontsize=9)
        ax.set_ylim(-0.03, 1.03)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", metavar="LABEL=ROWS[:EVICTOR]")
    ap.add_argument("--out", required=True, help="the PNG to write")
    a = ap.parse_args(argv)
    runs = []
    for spec in a.runs:
        label, _, rest = spec.partition("=")
        if not rest:
            ap.error(f"{spec!r} is not LABEL=ROWS[:EVICTOR]")
        path, _, evictor = rest.partition(":")
        try:
            pts = points(read_rows_file(path), evictor or "snapkv")
        except ValueError as e:
            ap.error(str(e))
        if not pts:
            ap.error(f"{path} has no rows of evictor {evictor or 'snapkv'} under always, verify or search")
        for p in pts:
            print(json.dumps({"run": label, **p}))
        runs.append((label, pts))
    plot(runs, a.out)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
