"""Metrics over the runner's rows (runner.py): accuracy, harm, PAGE's classes, compression, open
rates, and AUROCs of the label-free signals. Pure Python + numpy.

Definitions
* accuracy: mean of `correct` (RULER full credit) per (task, evictor, budget, gate).
* harm rate of a configuration: P(not correct | correct with the full cache); the ΔNLL variant is
  P(ΔNLL > 1 nat), ΔNLL = NLL(reference | configuration's cache) - NLL(reference | full cache),
  total nats over the reference tokens.
* PAGE's classes, per (sample, evictor), from the PLAIN evictor's outcome (`*_candidate` fields):
  capacity-bound = harmed at every tested budget (by correctness: only for samples the full cache
  gets right; by ΔNLL: ΔNLL > 1 nat at every budget); dilution-prone = the rest.
* realized compression: mean over all inputs of T / kept (gate-closed inputs count with 1.0), and
  mean kept / T.
* AUROC of a score for "harmed" (positive) vs "unharmed" inputs: Mann-Whitney U / (n_pos n_neg) with
  average ranks for ties; None when a class is empty. Orientation: PAGE says a LOW D marks a
  capacity-bound (harmful) input, so the harm score is -D (AUROC(-D) = 1 - AUROC(D)); Δself is a
  loss, so its harm score is Δself itself. Each (sample, budget) is one input for the per-evictor
  pooled AUROCs.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Iterable, Sequence

import numpy as np

from page_local.eval.rows import FULL
from page_local.gate import VERIFY_MODES

HARM_NATS = 1.0
CALIBRATED = "page-z"  # the PAGE gate re-decided under a calibration profile (regate)
# the report's order: the full cache, the gate modes evaluated (gate.GATE_MODES), the re-decided PAGE beside PAGE
GATE_ORDER = (FULL, "always", "page", CALIBRATED) + VERIFY_MODES
RUN_FIELDS = ("model", "length_target", "query_agnostic", "verify_m")


# --- AUROC -------------------------------------------------------------------------------------

def _ranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks with ties averaged."""
    order = np.argsort(x, kind="mergesort")
    xs = x[order]
    ranks = np.empty(len(x), dtype=np.float64)
    i = 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[i]:
            j += 1
        ranks[order[i: j + 1]] = (i + j) / 2.0 + 1.0
        i = j + 1
    return ranks


def auroc(scores: Sequence[float], labels: Sequence[bool]) -> float | None:
    """P(score of a random positive > score of a random negative) + 0.5 P(tie); None when either
    class is empty. Pairs with a None/NaN score are dropped."""
    s = np.asarray([np.nan if v is None else float(v) for v in scores], dtype=np.float64)
    y = np.asarray([bool(v) for v in labels], dtype=bool)
    if s.shape != y.shape:
        raise ValueError(f"{s.size} scores but {y.size} labels")
    ok = np.isfinite(s)
    s, y = s[ok], y[ok]
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        return None
    r = _ranks(s)
    u = r[y].sum() - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * n_neg))


def roc_curve(scores: Sequence[float], labels: Sequence[bool]) -> tuple[np.ndarray, np.ndarray] | None:
    """(fpr, tpr) from (0, 0) to (1, 1), one point per distinct threshold; None if a class is empty."""
    s = np.asarray([np.nan if v is None else float(v) for v in scores], dtype=np.float64)
    y = np.asarray([bool(v) for v in labels], dtype=bool)
    ok = np.isfinite(s)
    s, y = s[ok], y[ok]
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        return None
    order = np.argsort(-s, kind="mergesort")
    s, y = s[order], y[order]
    last = np.r_[np.flatnonzero(np.diff(s) != 0), len(s) - 1]  # the end of each tie group
    tp = np.cumsum(y)[last]
    fp = np.cumsum(~y)[last]
    return np.r_[0.0, fp / n_neg], np.r_[0.0, tp / n_pos]


# --- grouping helpers ----------------------------------------------------------------------------

def sample_id(row: dict) -> tuple:
    return (row.get("model"), row.get("source"), row.get("task"), row.get("index"), row.get("length_target"),
            row.get("seed"), row.get("query_agnostic"))


def run_id(row: dict) -> tuple:
    return tuple(row.get(k) for k in RUN_FIELDS)


def split_runs(rows: Iterable[dict]) -> dict[tuple, list[dict]]:
    """Rows grouped by run (model, length target, query_agnostic, verify_m)."""
    out: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        out[run_id(r)].append(r)
    return dict(out)


def _budget_sort(b) -> tuple:
    if b is None:
        return (0, 0.0)
    return (1, -float(b)) if isinstance(b, float) else (2, -float(b))


def _gate_sort(g) -> int:
    return GATE_ORDER.index(g) if g in GATE_ORDER else len(GATE_ORDER)


def _mean(v: Sequence) -> float | None:
    v = [float(x) for x in v if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return float(np.mean(v)) if v else None


def _rate(hits: int, n: int) -> float | None:
    return hits / n if n else None


def candidates(rows: Iterable[dict]) -> dict[tuple, dict]:
    """One entry per (sample, evictor, budget): the plain evictor's outcome, the sample's D and z, Δself.
    Keys: (sample_id, evictor, budget)."""
    out: dict[tuple, dict] = {}
    for r in rows:
        if r.get("evictor") is None or r.get("delta_nll_candidate") is None:
            continue
        k = (sample_id(r), r["evictor"], r["budget"])
        if k not in out:
            out[k] = dict(task=r["task"], D=r.get("D"), z=r.get("z"), delta_self=r.get("delta_self"),
                          correct_full=bool(r["correct_full"]), correct=bool(r["correct_candidate"]),
                          delta_nll=float(r["delta_nll_candidate"]), budget=r["budget"], evictor=r["evictor"],
                          sample=sample_id(r))
    return out


# --- tables --------------------------------------------------------------------------------------

def accuracy(rows: Iterable[dict]) -> list[dict]:
    """Per (task, evictor, budget, gate): n, accuracy, mean score; the full cache has evictor/budget None."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["task"], r.get("evictor"), r.get("budget"), r["gate"])].append(r)
    out = []
    for (task, ev, b, g), rs in groups.items():
        out.append(dict(task=task, evictor=ev, budget=b, gate=g, n=len(rs),
                        accuracy=_mean([bool(r["correct"]) for r in rs]), score=_mean([r["score"] for r in rs])))
    out.sort(key=lambda d: (d["task"], d["evictor"] or "", _budget_sort(d["budget"]), _gate_sort(d["gate"])))
    return out


def harm(rows: Iterable[dict], by_task: bool = False) -> list[dict]:
    """Per (evictor, budget, gate) [and task]: harm rate by correctness (among inputs correct with the
    full cache) and by ΔNLL > 1 nat (among all), mean and median ΔNLL."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        if r.get("evictor") is None:
            continue
        key = (r["task"] if by_task else "all", r["evictor"], r["budget"], r["gate"])
        groups[key].append(r)
    out = []
    for (task, ev, b, g), rs in groups.items():
        ok = [r for r in rs if r["correct_full"]]
        harmed = sum(1 for r in ok if not r["correct"])
        dn = [float(r["delta_nll"]) for r in rs if r.get("delta_nll") is not None]
        out.append(dict(task=task, evictor=ev, budget=b, gate=g, n=len(rs), n_correct_full=len(ok),
                        n_harmed=harmed, harm_rate=_rate(harmed, len(ok)),
                        n_harmed_nll=sum(1 for d in dn if d > HARM_NATS),
                        harm_rate_nll=_rate(sum(1 for d in dn if d > HARM_NATS), len(dn)),
                        mean_delta_nll=_mean(dn), median_delta_nll=float(np.median(dn)) if dn else None))
    out.sort(key=lambda d: (d["task"], d["evictor"], _budget_sort(d["budget"]), _gate_sort(d["gate"])))
    return out


def compression(rows: Iterable[dict]) -> list[dict]:
    """Per (evictor, budget, gate): realized compression mean T/kept over all inputs (closed gates
    count 1.0), mean kept/T, the gate's open rate and the rate of inputs actually evicted."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r.get("evictor"), r.get("budget"), r["gate"])].append(r)
    out = []
    for (ev, b, g), rs in groups.items():
        out.append(dict(evictor=ev, budget=b, gate=g, n=len(rs),
                        compression=_mean([r["T"] / r["kept"] if r["kept"] else 1.0 for r in rs]),
                        kept_fraction=_mean([r["kept"] / r["T"] if r["T"] else 1.0 for r in rs]),
                        open_rate=_mean([bool(r["open"]) for r in rs]),
                        evicted_rate=_mean([bool(r["evicted"]) for r in rs])))
    out.sort(key=lambda d: (d["evictor"] or "", _budget_sort(d["budget"]), _gate_sort(d["gate"])))
    return out


def open_rates(rows: Iterable[dict]) -> list[dict]:
    """Per (task, gate kind): PAGE's open rate (per sample; raw rule, and "page-z" when re-gated) and
    verify's open rate (per evictor x budget)."""
    page: dict[str, dict] = defaultdict(dict)
    calib: dict[str, dict] = defaultdict(dict)
    ver: dict[tuple, list[bool]] = defaultdict(list)
    seen = set()
    for r in rows:
        if r["gate"] == CALIBRATED:
            calib[r["task"]][sample_id(r)] = bool(r.get("page_open"))
        else:
            page[r["task"]][sample_id(r)] = bool(r.get("page_open"))
        if r.get("evictor") is not None and r.get("delta_self") is not None:
            k = (sample_id(r), r["evictor"], r["budget"])
            if k not in seen:
                seen.add(k)
                ver[(r["task"], r["evictor"], r["budget"])].append(bool(r.get("verify_open")))
    out = [dict(task=t, gate=g, evictor=None, budget=None, n=len(v), open_rate=_mean(list(v.values())))
           for g, per in (("page", page), (CALIBRATED, calib)) for t, v in sorted(per.items())]
    out += [dict(task=t, gate="verify", evictor=e, budget=b, n=len(v), open_rate=_mean(v))
            for (t, e, b), v in sorted(ver.items(), key=lambda kv: (kv[0][0], kv[0][1], _budget_sort(kv[0][2])))]
    return out


def classes(rows: Iterable[dict]) -> dict[tuple, dict]:
    """Per (sample_id, evictor): {"task", "by_correct": "capacity-bound" | "dilution-prone" | None
    (None: the full cache is wrong), "by_nll": ...}, from the plain evictor at every tested budget."""
    per: dict[tuple, list[dict]] = defaultdict(list)
    for (sid, ev, _b), c in candidates(rows).items():
        per[(sid, ev)].append(c)
    out = {}
    for key, cs in per.items():
        full_ok = cs[0]["correct_full"]
        by_c = None
        if full_ok:
            by_c = "capacity-bound" if all(not c["correct"] for c in cs) else "dilution-prone"
        by_n = "capacity-bound" if all(c["delta_nll"] > HARM_NATS for c in cs) else "dilution-prone"
        out[key] = dict(task=cs[0]["task"], D=cs[0]["D"], by_correct=by_c, by_nll=by_n, n_budgets=len(cs))
    return out


def class_counts(cls: dict[tuple, dict]) -> list[dict]:
    """Per (task, evictor): counts of each class under both definitions."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for (sid, ev), c in cls.items():
        groups[(c["task"], ev)].append(c)
    out = []
    for (task, ev), cs in sorted(groups.items()):
        out.append(dict(task=task, evictor=ev, n=len(cs),
                        capacity_by_correct=sum(c["by_correct"] == "capacity-bound" for c in cs),
                        dilution_by_correct=sum(c["by_correct"] == "dilution-prone" for c in cs),
                        full_wrong=sum(c["by_correct"] is None for c in cs),
                        capacity_by_nll=sum(c["by_nll"] == "capacity-bound" for c in cs),
                        dilution_by_nll=sum(c["by_nll"] == "dilution-prone" for c in cs),
                        mean_D_capacity_nll=_mean([c["D"] for c in cs if c["by_nll"] == "capacity-bound"]),
                        mean_D_dilution_nll=_mean([c["D"] for c in cs if c["by_nll"] == "dilution-prone"])))
    return out


def class_harm(rows: Iterable[dict], cls: dict[tuple, dict] | None = None) -> list[dict]:
    """Harm per (definition, class, evictor, gate), pooled over budgets: on each class, how often each
    gate still harms (correctness: among full-correct; ΔNLL > 1 nat), the compression it realizes and
    how often it opens (a gate that separates the classes opens on dilution-prone inputs only)."""
    rows = list(rows)
    cls = classes(rows) if cls is None else cls
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        if r.get("evictor") is None:
            continue
        c = cls.get((sample_id(r), r["evictor"]))
        if c is None:
            continue
        for definition in ("by_correct", "by_nll"):
            if c[definition] is not None:
                groups[(definition, c[definition], r["evictor"], r["gate"])].append(r)
    out = []
    for (definition, klass, ev, g), rs in groups.items():
        if definition == "by_correct":
            ok = [r for r in rs if r["correct_full"]]
            n_h = sum(1 for r in ok if not r["correct"])
            rate, n = _rate(n_h, len(ok)), len(ok)
        else:
            n_h = sum(1 for r in rs if r["delta_nll"] > HARM_NATS)
            rate, n = _rate(n_h, len(rs)), len(rs)
        out.append(dict(definition=definition, klass=klass, evictor=ev, gate=g, n=n, n_harmed=n_h, harm_rate=rate,
                        compression=_mean([r["T"] / r["kept"] if r["kept"] else 1.0 for r in rs]),
                        open_rate=_mean([bool(r["open"]) for r in rs])))
    out.sort(key=lambda d: (d["definition"], d["klass"], d["evictor"], _gate_sort(d["gate"])))
    return out


def aurocs(rows: Iterable[dict]) -> list[dict]:
    """AUROC of -D and of Δself for harmed vs unharmed inputs, per evictor and budget ("all" = pooled
    over budgets), for harm by correctness (inputs correct with the full cache) and by ΔNLL > 1 nat;
    scope "pooled" (all tasks together) and "within-task" (mean over tasks where both classes occur).
    Also -D for the capacity-bound vs dilution-prone classes (one input per sample and evictor)."""
    rows = list(rows)
    cands = list(candidates(rows).values())
    out = []
    by_ev_b: dict[tuple, list[dict]] = defaultdict(list)
    for c in cands:
        by_ev_b[(c["evictor"], c["budget"])].append(c)
        by_ev_b[(c["evictor"], "all")].append(c)

    def add(target: str, evictor, budget, items: list[dict], label_fn, signals=("-D", "delta_self")):
        for sig in signals:
            score_fn = (lambda c: None if c["D"] is None else -c["D"]) if sig == "-D" else (lambda c: c["delta_self"])
            labels = [label_fn(c) for c in items]
            a = auroc([score_fn(c) for c in items], labels)
            tasks = sorted({c["task"] for c in items})
            within = [auroc([score_fn(c) for c in items if c["task"] == t], [label_fn(c) for c in items if c["task"] == t])
                      for t in tasks]
            within = [w for w in within if w is not None]
            out.append(dict(signal=sig, target=target, evictor=evictor, budget=budget, n=len(items),
                            n_pos=sum(labels), n_neg=len(labels) - sum(labels), auroc=a,
                            auroc_within_task=float(np.mean(within)) if within else None,
                            n_tasks_within=len(within)))

    for (ev, b), items in sorted(by_ev_b.items(), key=lambda kv: (kv[0][0], kv[0][1] == "all", _budget_sort(kv[0][1]) if kv[0][1] != "all" else 0)):
        ok = [c for c in items if c["correct_full"]]
        add("harm_by_correct", ev, b, ok, lambda c: not c["correct"])
        add("harm_by_nll", ev, b, items, lambda c: c["delta_nll"] > HARM_NATS)
    cls = classes(rows)
    per_ev: dict[str, list[dict]] = defaultdict(list)
    for (sid, ev), c in cls.items():
        per_ev[ev].append(c)
    for ev, cs in sorted(per_ev.items()):
        add("capacity_by_correct", ev, None, [c for c in cs if c["by_correct"] is not None],
            lambda c: c["by_correct"] == "capacity-bound", signals=("-D",))
        add("capacity_by_nll", ev, None, cs, lambda c: c["by_nll"] == "capacity-bound", signals=("-D",))
    return out


def d_by_task(rows: Iterable[dict]) -> list[dict]:
    """Per task: n, mean, std, min, median, max of D (one value per sample)."""
    per: dict[str, dict] = defaultdict(dict)
    for r in rows:
        if r.get("D") is not None:
            per[r["task"]][sample_id(r)] = float(r["D"])
    out = []
    for t, v in sorted(per.items()):
        d = np.asarray(list(v.values()))
        out.append(dict(task=t, n=int(d.size), mean=float(d.mean()), std=float(d.std()), min=float(d.min()),
                        median=float(np.median(d)), max=float(d.max())))
    return out


def calibrated_threshold(rows: Iterable[dict]) -> float | None:
    """The raw D at which the calibrated gate flips (mu + theta_z sigma), recovered from rows that
    carry both D and z; None without a profile."""
    from page_local.gate import d_threshold

    pts = {}
    for r in rows:
        if r.get("D") is not None and r.get("z") is not None:
            pts[float(r["D"])] = float(r["z"])
    if len(pts) < 2:
        return None
    d = np.asarray(list(pts)), np.asarray(list(pts.values()))
    if np.ptp(d[1]) == 0:
        return None
    sigma, mu = np.polyfit(d[1], d[0], 1)  # D = mu + z sigma
    return float(d_threshold(mu, sigma))


def regate(rows: Iterable[dict], mu: float, sigma: float, z_threshold: float | None = None) -> list[dict]:
    """The rows a calibrated PAGE gate (open iff z = (D - mu) / sigma >= z_threshold, default
    theta_z = -0.6934) gives on these inputs, as gate "page-z".

    No model run is needed: a PAGE gate only chooses between two caches the runner already
    evaluated — the plain evictor's ("always" rows) and the full cache ("full" rows) — so each new
    row is the always-row when the gate opens and the full-cache outcome when it stays closed."""
    from page_local.gate import Z_THRESHOLD, Gate

    th = Z_THRESHOLD if z_threshold is None else float(z_threshold)
    if not (math.isfinite(mu) and math.isfinite(sigma) and sigma > 0):
        raise ValueError(f"a calibration profile needs a finite mu and sigma > 0, got mu={mu!r} sigma={sigma!r}")
    # the engine's own rule decides, so the report cannot drift from what `run` would do
    gate = Gate.calibrated(mu, sigma, z_threshold=th)
    rows = list(rows)
    full = {sample_id(r): r for r in rows if r["gate"] == FULL}
    plain = [r for r in rows if r["gate"] == "always"]
    if not plain:
        raise ValueError("re-gating needs the plain evictor's rows (gate 'always'); run the evaluation "
                         "with --gates always,...")
    out = []
    for r in plain:
        f = full.get(sample_id(r))
        if f is None:
            continue  # an interrupted sample without its full-cache row: nothing to fall back to
        decision = None if r.get("D") is None else gate.decide(float(r["D"]))
        z = None if decision is None else decision.z
        is_open = decision is not None and decision.open
        new = dict(r, gate=CALIBRATED, z=z, page_open=is_open, rule="calibrated", open=is_open)
        if not (is_open and r["evicted"]):
            new.update(evicted=False, kept=r["T"], compression=1.0, prediction=f["prediction"], finish=f["finish"],
                       score=f["score"], correct=f["correct"], nll_evicted=f["nll_evicted"], delta_nll=0.0)
        out.append(new)
    return out


def timing(rows: Iterable[dict]) -> dict:
    """Wall time per sample (prefill + every configuration) and its parts, in seconds / ms."""
    per: dict[tuple, dict] = {}
    for r in rows:
        t = r.get("timings") or {}
        per.setdefault(sample_id(r), t)
    ts = list(per.values())
    return dict(n_samples=len(ts), sample_s=_mean([t.get("sample_s") for t in ts]),
                prefill_ms=_mean([t.get("prefill_ms") for t in ts]), gate_ms=_mean([t.get("gate_ms") for t in ts]))


def summarize(rows: Sequence[dict]) -> dict:
    """Every table for one run's rows (use split_runs first when a file holds several runs)."""
    rows = list(rows)
    cls = classes(rows)
    first = rows[0] if rows else {}
    return dict(run={k: first.get(k) for k in RUN_FIELDS}, n_rows=len(rows),
                n_samples=len({sample_id(r) for r in rows}),
                tasks=sorted({r["task"] for r in rows}),
                evictors=sorted({r["evictor"] for r in rows if r.get("evictor")}),
                budgets=sorted({r["budget"] for r in rows if r.get("budget") is not None}, key=_budget_sort),
                gates=sorted({r["gate"] for r in rows}, key=_gate_sort),
                accuracy=accuracy(rows), harm=harm(rows), harm_by_task=harm(rows, by_task=True),
                compression=compression(rows), open_rates=open_rates(rows), class_counts=class_counts(cls),
                class_harm=class_harm(rows, cls), aurocs=aurocs(rows), d_by_task=d_by_task(rows),
                calibrated_threshold=calibrated_threshold(rows), timing=timing(rows),
                verify=next(({"rule": r["verify_rule"], "threshold": r.get("verify_threshold")} for r in rows
                             if r.get("verify_rule")), None))  # None: rows from before verify.py (mean, m = 16)
