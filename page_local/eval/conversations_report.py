"""The multi-turn evaluation's report: markdown tables and a plot of accuracy by turn, from the rows
eval/conversations.py writes.

    write_report("results/conversations-x.jsonl") -> results/conversations-x_report/report.md

Tables per policy and conversation length: accuracy (overall, by turn, by how long ago the asked
document was read), the cells held, decode tok/s and time to first token, and what the policy did at
the wall. matplotlib runs with the Agg backend.
"""

from __future__ import annotations

import json
import os
import statistics
from collections import defaultdict
from pathlib import Path

from page_local.eval.conversations import ALL_POLICIES
from page_local.eval.report import _plt, _table
from page_local.eval.rows import read_rows

LABEL = {"full": "full cache", "verify": "page-local (verify)", "page": "page-local (PAGE)",
         "park": "page-local (parking, verify)", "room": "page-local (room only)",
         "always": "evicted every turn, unchecked", "park-always": "parked every turn, unchecked",
         "park-search": "page-local (parking, budget search)", "room-recent": "room, ranked as before issue 28",
         "shift": "context shift (llama.cpp)", "truncate": "truncation (Ollama)", "refuse": "400 (llama-server)"}
STYLE = {"full": ("black", "-"), "verify": ("tab:green", "-"), "page": ("tab:blue", "--"), "park": ("tab:purple", "-"),
         "always": ("tab:pink", "--"), "park-always": ("tab:cyan", "-"), "park-search": ("tab:green", "--"),
         "room": ("tab:olive", ":"), "room-recent": ("tab:brown", ":"), "shift": ("tab:orange", "-."),
         "truncate": ("tab:red", "--"), "refuse": ("tab:gray", "-")}


def _mean(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _median(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _f(v, digits: int = 2) -> str:
    return "–" if v is None else f"{v:.{digits}f}"


def _x(L: float) -> str:
    return f"{L:g}×"


def _wall_words(policy: str, rows: list[dict]) -> str:
    """What the policy did at the wall, over these rows, in a few words."""
    at = [r for r in rows if r.get("wall") and r.get("finish") != "refused"]
    refused = sum(r.get("finish") == "refused" for r in rows)
    d = [r.get("detail") or {} for r in at]
    if policy in ("verify", "page", "room", "room-recent"):
        speed = sum(bool((r.get("detail") or {}).get("speed_evicted")) for r in rows)
        words = [f"room made on {len(at)}/{len(rows)} turns"]
        if at:
            words.append(f"{_mean(x['room_evicted'] for x in d):.0f} cells evicted each")
        chunked = [x for x in d if x.get("chunks", 1) > 1]
        if chunked:
            held = _mean(x["prompt_held"] / x["prompt_tokens"] for x in chunked if x.get("prompt_tokens"))
            words.append(f"{len(chunked)} messages read in {_mean(x['chunks'] for x in chunked):.1f} chunks, "
                         f"{100 * held:.0f}% of them held")
        if policy not in ("room", "room-recent"):
            words.append(f"speed budget committed on {speed} turns")
    elif policy == "shift":
        words = [f"shifted on {len(at)}/{len(rows)} turns"]
        if at:
            words.append(f"{_mean(x['shift_dropped'] for x in d):.0f} tokens dropped each")
        cut = [x["message_cut"] for x in d if x.get("message_cut")]
        if cut:
            words.append(f"{len(cut)} messages cut to their tail ({_mean(cut):.0f} tokens lost)")
    elif policy == "truncate":
        words = [f"truncated on {len(at)}/{len(rows)} turns"]
        if at:
            words.append(f"{_mean(x['messages_dropped'] for x in d):.1f} oldest messages dropped, "
                         f"{_mean(r['prefilled'] for r in at):.0f} tokens re-prefilled each")
        cut = [x["message_cut"] for x in d if x.get("message_cut")]
        if cut:
            words.append(f"{len(cut)} messages cut to their tail ({_mean(cut):.0f} tokens lost)")
    elif policy == "refuse":
        words = [] if refused else ["every message fit"]
    else:
        words = ["never at the wall (the context holds the whole conversation)"]
    if refused:
        words.append(f"{refused} turns refused")
    return "; ".join(words)


def summarize(rows: list[dict]) -> dict:
    rows = [r for r in rows if r.get("kind") == "conversation"]
    if not rows:
        raise ValueError("no conversation rows")
    policies = [p for p in ALL_POLICIES if any(r["policy"] == p for r in rows)]
    lengths = sorted({r["length"] for r in rows})
    turns = max(r["turns"] for r in rows)
    by = defaultdict(list)
    for r in rows:
        by[(r["policy"], r["length"])].append(r)
    cell = {}
    for (p, L), rs in by.items():
        last = [r for r in rs if r["turn"] == r["turns"] - 1]
        convs = defaultdict(float)
        for r in rs:
            convs[r["conversation"]] += r.get("turn_s") or 0.0
        cell[f"{p}|{L:g}"] = dict(
            policy=p, length=L, n=len(rs), accuracy=_mean(r["correct"] for r in rs),
            by_turn=[_mean(r["correct"] for r in rs if r["turn"] == t) for t in range(turns)],
            same_message=_mean(r["correct"] for r in rs if r["age"] == 0),
            read_before=_mean(r["correct"] for r in rs if r["age"] > 0),
            cells_last=_mean(r.get("cells") for r in last), cells_max=max(r.get("cells") or 0 for r in rs),
            conv_tokens=_mean(r.get("conv_tokens") for r in last),
            decode_tok_s=_median(r.get("decode_tok_s") for r in rs), ttft_s=_median(r.get("ttft_s") for r in rs),
            conversation_s=_mean(convs.values()), wall=_wall_words(p, rs))
    overall = {p: _mean(r["correct"] for r in rows if r["policy"] == p) for p in policies}
    # questions about a document read turns earlier, paired with the full cache's answer to the same question
    full = {(r["conversation"], r["length"], r["turn"]): bool(r["correct"]) for r in rows
            if r["policy"] == "full" and r["age"] > 0}
    later = {}
    for p in policies:
        rs = [r for r in rows if r["policy"] == p and r["age"] > 0]
        k = sum(bool(r["correct"]) for r in rs)
        paired = [(full[key], bool(r["correct"])) for r in rs
                  if (key := (r["conversation"], r["length"], r["turn"])) in full]
        later[p] = dict(n=len(rs), correct=k, accuracy=k / len(rs) if rs else None, ci95=_wilson(k, len(rs)),
                        paired=len(paired), both=sum(a and b for a, b in paired),
                        only_full=sum(a and not b for a, b in paired), only_policy=sum(b and not a for a, b in paired))
    r0 = rows[0]
    return dict(model=r0.get("model_name") or r0["model"], n_ctx=r0["n_ctx"], turns=turns, budget=r0.get("budget"),
                max_tokens=r0.get("max_tokens"), conversations=len({r["conversation"] for r in rows}),
                policies=policies, lengths=lengths, cells=cell, overall=overall, later=later)


def _wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float] | None:
    """The 95 % Wilson score interval of k successes in n."""
    if n == 0:
        return None
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * ((p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5) / d
    return (round(c - h, 3), round(c + h, 3))


def markdown(s: dict, plot: str | None = None) -> str:
    P, Ls = s["policies"], s["lengths"]

    def c(p, L):
        return s["cells"].get(f"{p}|{L:g}", {})

    head = (f"{s['conversations']} conversations × {s['turns']} turns × {len(Ls)} lengths, n_ctx {s['n_ctx']} "
            f"(the full cache's context holds the longest), answers of at most {s['max_tokens']} greedy tokens, "
            f"speed budget {s['budget']}. A length is the conversation's size in units of n_ctx (0.9× that, "
            "answers included).")
    acc = _table(["policy"] + [_x(L) for L in Ls] + ["overall"],
                 [[LABEL.get(p, p)] + [_f(c(p, L).get("accuracy")) for L in Ls] + [_f(s["overall"][p])] for p in P])
    by_turn = []
    for L in Ls:
        by_turn.append(f"**{_x(L)} n_ctx** (tokens at the last turn: "
                       f"{_f(c('full', L).get('conv_tokens') or c(P[0], L).get('conv_tokens'), 0)})\n\n"
                       + _table(["policy"] + [f"turn {t + 1}" for t in range(s["turns"])],
                                [[LABEL.get(p, p)] + [_f(a) for a in c(p, L).get("by_turn", [])] for p in P]))
    age = _table(["policy"] + [f"{_x(L)} {w}" for L in Ls for w in ("same msg", "read before")],
                 [[LABEL.get(p, p)] + [_f(c(p, L).get(k)) for L in Ls for k in ("same_message", "read_before")]
                  for p in P])
    cost = _table(["policy", "length", "cells held (last turn)", "max cells", "decode tok/s (median)",
                   "TTFT s (median)", "s per conversation"],
                  [[LABEL.get(p, p), _x(L), _f(c(p, L).get("cells_last"), 0), c(p, L).get("cells_max", "–"),
                    _f(c(p, L).get("decode_tok_s"), 1), _f(c(p, L).get("ttft_s"), 3),
                    _f(c(p, L).get("conversation_s"), 1)] for p in P for L in Ls])
    wall = _table(["policy", "length", "at the wall"], [[LABEL.get(p, p), _x(L), c(p, L).get("wall", "–")]
                                                       for p in P for L in Ls if p != "full"])
    later = s.get("later") or {}
    lat = _table(["policy", "questions", "accuracy", "95 % interval", "paired with the full cache",
                  "both right", "only the full cache", "only this policy"],
                 [[LABEL.get(p, p), later[p]["n"], _f(later[p]["accuracy"]),
                   "–" if later[p]["ci95"] is None else f"{later[p]['ci95'][0]:.2f}–{later[p]['ci95'][1]:.2f}",
                   later[p]["paired"], later[p]["both"], later[p]["only_full"], later[p]["only_policy"]]
                  for p in P if p in later])
    parts = [f"## Conversations: {s['model']}", head, "### Accuracy", acc,
             "### Questions about a document read turns earlier (all lengths)", lat]
    if plot:
        parts.append(f"![accuracy by turn]({plot})")
    parts += ["### Accuracy by turn", *by_turn,
              "### Asked in the message that pastes the document, or after it (read before)", age,
              "### Cells held, speed", cost, "### At the wall", wall]
    return "\n\n".join(parts) + "\n"


def plot_by_turn(s: dict, path: Path) -> Path:
    plt = _plt()
    Ls = s["lengths"]
    fig, axes = plt.subplots(1, len(Ls), figsize=(4.2 * len(Ls), 3.4), squeeze=False, sharey=True)
    x = list(range(1, s["turns"] + 1))
    for ax, L in zip(axes[0], Ls):
        for p in s["policies"]:
            ys = [float("nan") if a is None else a for a in s["cells"].get(f"{p}|{L:g}", {}).get("by_turn", [])]
            color, ls = STYLE.get(p, ("gray", "-"))
            ax.plot(x[:len(ys)], ys, ls, marker="o", ms=4, color=color, lw=1.6, label=LABEL.get(p, p))
        ax.set_title(f"{_x(L)} n_ctx ({s['n_ctx']})", fontsize=9)
        ax.set_xticks(x)
        ax.set_xlabel("turn")
        ax.set_ylim(-0.05, 1.05)
    axes[0][0].set_ylabel("accuracy")
    axes[0][-1].legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(rows_path: str | os.PathLike, out_dir: str | os.PathLike | None = None) -> Path:
    """report.md, summary.json and accuracy_by_turn.png in out_dir (default: <rows file stem>_report)."""
    rows_path = Path(rows_path)
    rows = read_rows(rows_path)
    if not rows:
        raise ValueError(f"{rows_path} holds no rows")
    stem = rows_path.name.removesuffix(".gz").removesuffix(".jsonl")
    out_dir = Path(out_dir) if out_dir is not None else rows_path.with_name(stem + "_report")
    out_dir.mkdir(parents=True, exist_ok=True)
    s = summarize(rows)
    plot = plot_by_turn(s, out_dir / "accuracy_by_turn.png").name
    md = out_dir / "report.md"
    md.write_text(markdown(s, plot), encoding="utf-8")
    (out_dir / "summary.json").write_text(json.dumps(s, indent=1), encoding="utf-8")
    return md
