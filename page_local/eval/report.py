"""Markdown tables and PNG plots from a results file (runner.py rows; metrics.py numbers).

    write_report("results/x.jsonl", "results/x_report") -> results/x_report/report.md

One section per run (model, length target, query_agnostic, verify_m) found in the file; plots are
named <prefix>accuracy_vs_budget.png, <prefix>D_by_task.png, <prefix>roc.png (prefix "" for a
single run, "run<i>_" otherwise). matplotlib runs with the Agg backend (no display needed).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from page_local.eval import metrics
from page_local.eval.rows import read_rows

GATE_LABEL = {"full": "full", "always": "plain", "page": "PAGE", metrics.CALIBRATED: "PAGE (z)", "verify": "verify",
              "page+verify": "PAGE+verify", "search": "search", "page+search": "PAGE+search"}


def _f(v, digits: int = 3) -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def _b(b) -> str:
    return "–" if b is None else (f"{b:g}" if isinstance(b, float) else str(b))


def _table(header: Sequence[str], rows: Sequence[Sequence]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def _accuracy_table(s: dict) -> str:
    acc = {(a["task"], a["evictor"], a["budget"], a["gate"]): a for a in s["accuracy"]}
    budgets = s["budgets"]
    out = []
    for task in s["tasks"]:
        full = acc.get((task, None, None, "full"))
        rows = []
        for ev in s["evictors"]:
            for g in [g for g in s["gates"] if g != "full"]:
                cells = []
                for b in budgets:
                    a = acc.get((task, ev, b, g))
                    cells.append(_f(a["accuracy"], 2) if a else "–")
                rows.append([ev, GATE_LABEL.get(g, g)] + cells)
        n = full["n"] if full else 0
        out.append(f"**{task}** (n = {n}; full cache: {_f(full['accuracy'], 2) if full else '–'})\n\n"
                   + _table(["evictor", "gate"] + [f"b = {_b(b)}" for b in budgets], rows))
    return "\n\n".join(out)


def _harm_table(s: dict) -> str:
    rows = []
    for h in s["harm"]:
        rows.append([h["evictor"], _b(h["budget"]), GATE_LABEL.get(h["gate"], h["gate"]),
                     f"{h['n_harmed']}/{h['n_correct_full']}", _f(h["harm_rate"], 2),
                     f"{h['n_harmed_nll']}/{h['n']}", _f(h["harm_rate_nll"], 2),
                     _f(h["median_delta_nll"], 2), _f(h["mean_delta_nll"], 2)])
    return _table(["evictor", "budget", "gate", "harmed/correct", "harm rate", "ΔNLL>1", "rate",
                   "median ΔNLL", "mean ΔNLL"], rows)


def _harm_by_task_table(s: dict) -> str:
    rows = [[h["task"], h["evictor"], _b(h["budget"]), GATE_LABEL.get(h["gate"], h["gate"]),
             f"{h['n_harmed']}/{h['n_correct_full']}", f"{h['n_harmed_nll']}/{h['n']}", _f(h["median_delta_nll"], 2)]
            for h in s["harm_by_task"] if h["gate"] == "always"]
    return _table(["task", "evictor", "budget", "gate", "harmed/correct", "ΔNLL>1", "median ΔNLL"], rows)


def _compression_table(s: dict) -> str:
    rows = [[c["evictor"] or "–", _b(c["budget"]), GATE_LABEL.get(c["gate"], c["gate"]), c["n"],
             _f(c["compression"], 2), _f(c["kept_fraction"], 3), _f(c["open_rate"], 2), _f(c["evicted_rate"], 2)]
            for c in s["compression"]]
    return _table(["evictor", "budget", "gate", "n", "T/kept (mean)", "kept/T (mean)", "open rate", "evicted rate"],
                  rows)


def _open_table(s: dict) -> str:
    rows = [[o["task"], GATE_LABEL.get(o["gate"], o["gate"]), o["evictor"] or "–", _b(o["budget"]), o["n"],
             _f(o["open_rate"], 2)] for o in s["open_rates"]]
    return _table(["task", "gate", "evictor", "budget", "n", "open rate"], rows)


def _class_tables(s: dict) -> str:
    rows = [[c["task"], c["evictor"], c["n"], c["capacity_by_correct"], c["dilution_by_correct"], c["full_wrong"],
             c["capacity_by_nll"], c["dilution_by_nll"], _f(c["mean_D_capacity_nll"], 4),
             _f(c["mean_D_dilution_nll"], 4)] for c in s["class_counts"]]
    t1 = _table(["task", "evictor", "n", "capacity (correct)", "dilution (correct)", "full wrong",
                 "capacity (ΔNLL)", "dilution (ΔNLL)", "mean D capacity", "mean D dilution"], rows)
    rows = [[{"by_correct": "correctness", "by_nll": "ΔNLL > 1"}[h["definition"]], h["klass"], h["evictor"],
             GATE_LABEL.get(h["gate"], h["gate"]), f"{h['n_harmed']}/{h['n']}", _f(h["harm_rate"], 2),
             _f(h["compression"], 2), _f(h["open_rate"], 2)] for h in s["class_harm"]]
    t2 = _table(["class definition", "class", "evictor", "gate", "harmed", "harm rate", "T/kept", "open rate"], rows)
    return t1 + "\n\nHarm on each class (pooled over budgets):\n\n" + t2


def _auroc_table(s: dict) -> str:
    """One line per (positive class, evictor, budget): -D and delta_self side by side."""
    by: dict[tuple, dict] = {}
    for a in s["aurocs"]:
        by.setdefault((a["target"], a["evictor"], a["budget"]), {})[a["signal"]] = a
    order = ["harm_by_nll", "harm_by_correct", "capacity_by_nll", "capacity_by_correct"]
    rows = []
    for (target, ev, b), d in sorted(by.items(), key=lambda kv: (order.index(kv[0][0]), kv[0][1], kv[0][2] != "all",
                                                                 metrics._budget_sort(None if kv[0][2] == "all"
                                                                                      else kv[0][2]))):
        first = next(iter(d.values()))
        nd, ds = d.get("-D"), d.get("delta_self")
        rows.append([target.replace("_", " "), ev, "all" if b == "all" else _b(b), first["n_pos"], first["n_neg"],
                     _f(nd and nd["auroc"]), _f(nd and nd["auroc_within_task"]),
                     _f(ds and ds["auroc"]) if ds else "n/a", _f(ds and ds["auroc_within_task"]) if ds else "n/a"])
    return _table(["positive class", "evictor", "budget", "n pos", "n neg", "−D pooled", "−D within task",
                   "Δself pooled", "Δself within task"], rows)


def _d_table(s: dict) -> str:
    rows = [[d["task"], d["n"], _f(d["mean"], 4), _f(d["std"], 4), _f(d["min"], 4), _f(d["median"], 4),
             _f(d["max"], 4)] for d in s["d_by_task"]]
    return _table(["task", "n", "mean D", "std", "min", "median", "max"], rows)


def _verify_rule_words(v: dict | None) -> str:
    if not v:  # rows written before verify.py: the mean over the first m tokens
        return "verify = evict iff Δself ≤ 0.05 nats/token over the first m full-cache tokens."
    from page_local.verify import RULES

    what = RULES.get(v["rule"], (v["rule"],))[0]
    return (f"verify = evict iff {what} ≤ {v['threshold']:g} (rule `{v['rule']}`) over the full cache's answer, "
            "up to its end or m tokens.")


def markdown(s: dict, plots: dict[str, str] | None = None, title: str | None = None) -> str:
    run = s["run"]
    t = s.get("timing") or {}
    parts = [f"## {title or 'Run'}",
             f"model `{run.get('model')}`, length target {run.get('length_target')}, "
             f"query-agnostic {run.get('query_agnostic')}, verify m = {run.get('verify_m')}; "
             f"{s['n_samples']} samples, {s['n_rows']} rows; tasks {', '.join(s['tasks'])}; "
             f"evictors {', '.join(s['evictors']) or '–'}; budgets {', '.join(_b(b) for b in s['budgets'])}; "
             f"gates {', '.join(GATE_LABEL.get(g, g) for g in s['gates'])}.",
             f"Wall time per sample (prefill + every configuration): {_f(t.get('sample_s'), 1)} s "
             f"(prefill {_f(t.get('prefill_ms'), 0)} ms).",
             "Gates: plain = the evictor always; PAGE = evict iff the PAGE gate opens "
             "(raw D ≥ 0.07, or calibrated z ≥ −0.6934"
             + (f"; here D ≥ {s['calibrated_threshold']:.4f}" if s.get("calibrated_threshold") is not None else "")
             + "); " + _verify_rule_words(s.get("verify"))
             + (f" PAGE (z) = the PAGE gate re-decided from each input's D under the calibration profile "
                f"`{s['profile']['file']}` (unlabeled pilot of {s['profile']['n_pilot']} prompts: "
                f"μ = {s['profile']['mu']:.4f}, σ = {s['profile']['sigma']:.4f}): open iff z ≥ −0.6934, "
                f"i.e. D ≥ {s['profile']['threshold_D']:.4f}." if s.get("profile") else "")
             + _length_caveat(s.get("profile")),
             "### Accuracy vs budget", _accuracy_table(s)]
    if plots and plots.get("accuracy"):
        parts.append(f"![accuracy vs budget]({plots['accuracy']})")
    parts += ["### Harm (correct with the full cache, wrong after eviction; and ΔNLL > 1 nat)", _harm_table(s),
              "Plain evictor, per task:", _harm_by_task_table(s),
              "### Realized compression and open rates", _compression_table(s), _open_table(s),
              "### PAGE's classes (per sample and evictor, from the plain evictor at every budget)",
              "capacity-bound = harmed at every tested budget; dilution-prone = the rest.", _class_tables(s),
              "### Does the signal predict harm? (AUROC; harm score = −D, since PAGE says low D ⇒ capacity-bound; "
              "and Δself)", _auroc_table(s), "### D by task", _d_table(s)]
    if plots and plots.get("D"):
        parts.append(f"![D by task]({plots['D']})")
    if plots and plots.get("roc"):
        parts.append(f"![ROC]({plots['roc']})")
    return "\n\n".join(parts) + "\n"


# --- plots ---------------------------------------------------------------------------------------

def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def plot_accuracy(s: dict, path: Path) -> Path | None:
    if not s["tasks"] or not s["budgets"]:
        return None
    plt = _plt()
    acc = {(a["task"], a["evictor"], a["budget"], a["gate"]): a["accuracy"] for a in s["accuracy"]}
    tasks, budgets = s["tasks"], s["budgets"]
    ncol = min(3, len(tasks))
    nrow = (len(tasks) + ncol - 1) // ncol
    fig, axes = plt.subplots(nrow, ncol, figsize=(4.2 * ncol, 3.2 * nrow), squeeze=False)
    x = np.arange(len(budgets))
    markers = ["o", "s", "^", "D", "v", "P", "X"]
    gate_style = {"always": ("tab:red", "-"), "page": ("tab:blue", "--"), metrics.CALIBRATED: ("tab:cyan", "--"),
                  "verify": ("tab:green", ":"), "page+verify": ("tab:purple", "-.")}
    for i, task in enumerate(tasks):
        ax = axes[i // ncol][i % ncol]
        full = acc.get((task, None, None, "full"))
        if full is not None:
            ax.axhline(full, color="black", lw=1.2, label="full")
        for j, ev in enumerate(s["evictors"]):
            for g in [g for g in s["gates"] if g != "full"]:
                ys = [acc.get((task, ev, b, g)) for b in budgets]
                ys = [np.nan if y is None else y for y in ys]
                color, ls = gate_style.get(g, ("gray", "-"))
                ax.plot(x, ys, ls, marker=markers[j % len(markers)], ms=4, color=color, lw=1.6,
                        label=f"{ev} {GATE_LABEL.get(g, g)}")
        ax.set_xticks(x, [_b(b) for b in budgets])
        ax.set_ylim(-0.05, 1.05)
        ax.set_title(task, fontsize=9)
        ax.set_xlabel("budget")
        ax.set_ylabel("accuracy")
    for k in range(len(tasks), nrow * ncol):
        axes[k // ncol][k % ncol].axis("off")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(5, len(labels)), fontsize=7)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_d(rows: Sequence[dict], s: dict, path: Path) -> Path | None:
    per: dict[str, dict] = {}
    for r in rows:
        if r.get("D") is not None:
            per.setdefault(r["task"], {})[metrics.sample_id(r)] = float(r["D"])
    if not per:
        return None
    plt = _plt()
    tasks = sorted(per)
    fig, ax = plt.subplots(figsize=(max(4.0, 1.3 * len(tasks) + 1.5), 3.4))
    data = [list(per[t].values()) for t in tasks]
    ax.boxplot(data, showfliers=False, widths=0.5)
    rng = np.random.default_rng(0)
    for i, d in enumerate(data, start=1):
        ax.scatter(i + rng.uniform(-0.15, 0.15, len(d)), d, s=10, alpha=0.7, color="tab:blue", zorder=3)
    ax.axhline(0.07, color="tab:red", ls="--", lw=1, label="raw threshold 0.07")
    if s.get("calibrated_threshold") is not None:
        ax.axhline(s["calibrated_threshold"], color="tab:green", ls=":", lw=1, label="calibrated threshold")
    ax.set_xticks(range(1, len(tasks) + 1), tasks, rotation=20, fontsize=8)
    ax.set_ylabel("D (head-agreement drop)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_roc(rows: Sequence[dict], path: Path) -> Path | None:
    cands = list(metrics.candidates(rows).values())
    if not cands:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(9, 4))
    targets = (("harm by ΔNLL > 1 nat", lambda c: c["delta_nll"] > metrics.HARM_NATS, cands),
               ("harm by correctness", lambda c: not c["correct"], [c for c in cands if c["correct_full"]]))
    styles = ["-", "--", ":", "-."]
    for ax, (title, label_fn, items) in zip(axes, targets):
        ax.plot([0, 1], [0, 1], color="gray", lw=0.8)
        for j, ev in enumerate(sorted({c["evictor"] for c in items})):
            sub = [c for c in items if c["evictor"] == ev]
            labels = [label_fn(c) for c in sub]
            for sig, fn, color in (("−D", lambda c: None if c["D"] is None else -c["D"], "tab:blue"),
                                   ("Δself", lambda c: c["delta_self"], "tab:green")):
                sc = [fn(c) for c in sub]
                curve = metrics.roc_curve(sc, labels)
                if curve is None:
                    continue
                a = metrics.auroc(sc, labels)
                ax.plot(curve[0], curve[1], styles[j % len(styles)], color=color,  # ties: diagonal segments
                        label=f"{ev} {sig} (AUROC {a:.2f})")
        ax.set_title(title + " (pooled over budgets)", fontsize=9)
        ax.set_xlabel("false positive rate")
        ax.set_ylabel("true positive rate")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _length_caveat(p: dict | None) -> str:
    """A sentence when the profile's pilot had prompt lengths far from these inputs' (D shifts with length)."""
    if not p or not p.get("inputs_outside_pilot_lengths"):
        return ""
    lo, hi = p["pilot_tokens"]
    return (f" Caution: the pilot's prompts had {lo}–{hi} tokens and {p['inputs_outside_pilot_lengths']} of "
            f"these {p['inputs']} inputs lie outside [{lo}/1.25, {hi}×1.25]; D shifts with prompt length, so "
            "PAGE (z) here is not the gate a pilot at these lengths would give (`calibrate --lengths`).")


def write_report(rows_path: str | os.PathLike, out_dir: str | os.PathLike | None = None,
                 profile: str | os.PathLike | None = None) -> Path:
    """report.md (+ summary.json and PNG plots) in out_dir (default: <rows file stem>_report beside it).

    profile: a calibration profile file (`page-local calibrate`); the runs of its model get the gate
    "page-z", the PAGE gate re-decided under it (metrics.regate), beside the raw rule."""
    from page_local.gate import Gate
    from page_local.store.profiles import read_profile_file

    rows_path = Path(rows_path)
    if not rows_path.exists():
        raise FileNotFoundError(f"no such results file: {rows_path}")
    rows = read_rows(rows_path)
    if not rows:
        raise ValueError(f"{rows_path} holds no result rows")
    out_dir = Path(out_dir) if out_dir is not None else rows_path.with_name(rows_path.stem + "_report")
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = metrics.split_runs(rows)
    prof = read_profile_file(profile) if profile is not None else None
    if prof is not None and not any(rid[0] == prof.model_id for rid in runs):
        models = ", ".join(sorted({str(rid[0]) for rid in runs}))
        raise ValueError(f"the profile {profile} belongs to model {prof.model_id}; {rows_path.name} holds results "
                         f"of {models} (calibrate the model the results are for)")
    parts = [f"# Evaluation report: {rows_path.name}"]
    summaries = []
    for i, (rid, rrows) in enumerate(runs.items()):
        prefix = "" if len(runs) == 1 else f"run{i + 1}_"
        prof_info = None
        if prof is not None and rid[0] == prof.model_id:
            rrows = rrows + metrics.regate(rrows, prof.mu, prof.sigma)
            inputs = {(r["task"], r["index"]): r["T"] for r in rrows if r.get("T") is not None}
            outside = sum(1 for T in inputs.values() if prof.length_note(int(T)) is not None)
            prof_info = dict(file=Path(profile).name, mu=prof.mu, sigma=prof.sigma, n_pilot=prof.n_pilot,
                             threshold_D=Gate("page", prof).d_threshold,
                             pilot_tokens=list(prof.pilot_tokens) if prof.pilot_tokens else None,
                             inputs_outside_pilot_lengths=outside if prof.pilot_tokens else None,
                             inputs=len(inputs))
        s = metrics.summarize(rrows)
        s["profile"] = prof_info
        plots = {}
        for key, stem, fn in (("accuracy", "accuracy_vs_budget", lambda p: plot_accuracy(s, p)),
                              ("D", "D_by_task", lambda p: plot_d(rrows, s, p)),
                              ("roc", "roc", lambda p: plot_roc(rrows, p))):
            name = f"{prefix}{stem}.png"
            if fn(out_dir / name) is not None:
                plots[key] = name
        s["plots"] = plots
        summaries.append(s)
        parts.append(markdown(s, plots, title=f"Run {i + 1}" if len(runs) > 1 else "Run"))
    md = out_dir / "report.md"
    md.write_text("\n\n".join(parts), encoding="utf-8")
    (out_dir / "summary.json").write_text(json.dumps(summaries, indent=1, default=str), encoding="utf-8")
    return md
