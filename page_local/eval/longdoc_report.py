"""The long-document evaluation's report, from the rows eval/longdoc.py writes.

    markdown(summarize(read_rows("results/longdoc-x.jsonl")))

Per (policy, length, n_ctx): accuracy with its 95 % Wilson interval, the questions paired with the full
cache (this policy right and the full cache wrong / the full cache right and this policy wrong), the mean
time to first token (a question alone: the shared reading and its own), decode tok/s, and the cost of a
question (the shared reading divided among the document's questions, plus the question's own time). Rows of
the second-question mode (turns=2) are summarized apart, with the second question's accuracy and its pairs.
Beside accuracy: how often the asked fact's sentence was held whole (fact_held 1: what the policy kept, apart
from whether the model answered with it), and the right answers by the fact's quarter of the document's depth.
Rows on real prose (haystack=prose, eval/longdoc_prose.py) are summarized apart from generated documents', with the
right answers split by the question's wording: the fact's own words, or paraphrased.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict

from page_local.eval.longdoc import POLICIES
from page_local.eval.report import _table

LABEL = {"full": "full cache", "room": "room, ranked by the question, pooled cells",
         "room-spans": "room, ranked by the question, whole sentences",
         "room-best": "room, ranked by the question, whole sentences, best score of each cut (the default before issue 57)",
         "room-reread": "room, whole sentences, read again for the next message",
         "room-both": "room, ranked by the question and a generic query, whole sentences",
         "room-bm25": "room, whole sentences ranked by the question's words (BM25)",
         "room-hybrid": "room, whole sentences ranked by the question's attention and words (hybrid; the default)",
         "room-hybrid-reread": "room, hybrid, read again for the next message",
         "room-hybrid-words": "room, hybrid, read again when the next question's words point to what went",
         "room-recent": "room, ranked by the newest queries", "shift": "context shift (llama.cpp)",
         "truncate": "truncation (Ollama)", "server": "llama-server (400 over the context)"}
Z95 = 1.959964
QUARTERS = 4  # the per-depth table: the document's depth in quarters (eval longdoc places one fact in each)


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of k successes in n trials (95 % by default); (0, 1) when n is 0."""
    if n <= 0:
        return 0.0, 1.0
    p = k / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return max(0.0, mid - half), min(1.0, mid + half)


def _median(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarize(rows: list[dict]) -> list[dict]:
    """One entry per (n_ctx, length, policy): n, correct, accuracy, its interval, the pairs against the full
    cache on the same (document, question), median TTFT, tok/s and cost per question; for second questions, their
    median TTFT and how many found their fact's sentence whole in the cache (rows that record it)."""
    by = defaultdict(dict)  # (model, haystack, turns, n_ctx, length, policy) -> {(doc, question): row}
    for r in rows:
        by[(r["model"], r.get("haystack", "generated"), r.get("turns", 1), r["n_ctx"], r["length"],
            r["policy"])][(r["doc"], r["question"])] = r
    out = []
    order = {p: i for i, p in enumerate(POLICIES)}
    for (model, haystack, turns, n_ctx, length, policy), qs in sorted(by.items(), key=lambda kv: (
            kv[0][:5], order.get(kv[0][5], 99))):
        k, n = sum(bool(r["correct"]) for r in qs.values()), len(qs)
        full = by.get((model, haystack, turns, n_ctx, length, "full"), {})
        both = [q for q in qs if q in full]
        lo, hi = wilson(k, n)
        second = {}
        if turns == 2:  # the next turn's question, paired with the full cache's
            k2 = sum(bool(r.get("second_correct")) for r in qs.values())
            second = dict(second_correct=k2, second_accuracy=k2 / n if n else None, second_ci=wilson(k2, n),
                          second_wins=sum(bool(qs[q].get("second_correct")) and not full[q].get("second_correct")
                                          for q in both),
                          second_losses=sum(bool(full[q].get("second_correct")) and not qs[q].get("second_correct")
                                            for q in both),
                          second_ttft_s=_median(r.get("second_ttft_s") for r in qs.values()),
                          second_whole=sum(r["second_fact_held"] == 1 for r in qs.values() if "second_fact_held" in r),
                          second_recorded=sum("second_fact_held" in r for r in qs.values()))
        quarters = [[0, 0] for _ in range(QUARTERS)]  # [right, asked] by the fact's quarter of the depth
        for r in qs.values():
            if r.get("depth") is not None:
                qq = quarters[min(QUARTERS - 1, max(0, int(r["depth"] * QUARTERS)))]
                qq[0] += bool(r["correct"])
                qq[1] += 1
        # by the question's wording (prose rows): [right, asked] with the fact's words, and paraphrased
        wording = {w: [sum(bool(r["correct"]) for r in qs.values() if r.get("paraphrased") is w),
                       sum(r.get("paraphrased") is w for r in qs.values())] for w in (False, True)}
        out.append(dict(model=model, haystack=haystack, wording=wording, turns=turns, n_ctx=n_ctx, length=length,
                        policy=policy, n=n, correct=k,
                        whole=sum(r["fact_held"] == 1 for r in qs.values() if "fact_held" in r),
                        recorded=sum("fact_held" in r for r in qs.values()), quarters=quarters,
                        accuracy=k / n if n else None, ci=(lo, hi), paired=len(both),
                        wins=sum(bool(qs[q]["correct"]) and not full[q]["correct"] for q in both),
                        losses=sum(bool(full[q]["correct"]) and not qs[q]["correct"] for q in both),
                        ttft_s=_median(r.get("ttft_s") for r in qs.values()),
                        tok_s=_median(r.get("decode_tok_s") for r in qs.values()),
                        cost_s=_median(r.get("cost_s") for r in qs.values()) if policy != "server" else None,
                        **second))
    return out


def _f(v, digits: int = 1) -> str:
    return "–" if v is None else f"{v:.{digits}f}"


def markdown(summary: list[dict]) -> str:
    """A table per model: the rows of summarize, by n_ctx and length."""
    lines = ["# Long documents: one reading per document, several questions", ""]
    models = sorted({s["model"] for s in summary})
    for m in models:
        if len(models) > 1:
            lines += [f"## {m}", ""]
        for hay in sorted({s.get("haystack", "generated") for s in summary if s["model"] == m}):
            if hay != "generated":
                lines += [f"### On {'real prose' if hay == 'prose' else hay}", ""]
            for turns in sorted({s.get("turns", 1) for s in summary if s["model"] == m}):
                part = [s for s in summary if s["model"] == m and s.get("turns", 1) == turns
                        and s.get("haystack", "generated") == hay]
                if not part:
                    continue
                lines += _turns_table(part, turns)
                if turns == 1:
                    lines += _quarters_table(part)
                    lines += _wording_table(part)
    lines.append("llama-server's row is 0 by definition: a prompt over the context is refused (400); nothing runs.")
    return "\n".join(lines) + "\n"


def _acc(k: int, n: int, ci) -> str:
    return f"{k / n:.2f} [{ci[0]:.2f}, {ci[1]:.2f}]" if n else "–"


def _quarters_table(summary: list[dict]) -> list[str]:
    """Right answers by the fact's quarter of the document (first · second · third · last), per policy."""
    rows = [(s["n_ctx"], f"{s['length']:g}×", LABEL.get(s["policy"], s["policy"]),
             " · ".join(f"{k}/{n}" for k, n in s["quarters"])) for s in summary
            if s["policy"] != "server" and any(n for _, n in s.get("quarters", ()))]
    if not rows:
        return []
    return ["Right answers by the fact's quarter of the document's depth:", "",
            _table(("n_ctx", "length", "policy", "first · second · third · last quarter"), rows), ""]


def _wording_table(summary: list[dict]) -> list[str]:
    """Right answers by the question's wording (rows that record it: real prose), per policy."""
    rows = []
    for s in summary:
        w = s.get("wording") or {}
        (ke, ne), (kp, np_) = w.get(False, (0, 0)), w.get(True, (0, 0))
        if s["policy"] != "server" and ne + np_:
            rows.append((s["n_ctx"], f"{s['length']:g}×", LABEL.get(s["policy"], s["policy"]),
                         f"{ke}/{ne}", _acc(ke, ne, wilson(ke, ne)), f"{kp}/{np_}", _acc(kp, np_, wilson(kp, np_))))
    if not rows:
        return []
    return ["Right answers by the question's wording (the fact's own words, or paraphrased):", "",
            _table(("n_ctx", "length", "policy", "same words", "accuracy (95 % Wilson)", "paraphrased",
                    "accuracy (95 % Wilson)"), rows), ""]


def _turns_table(summary: list[dict], turns: int) -> list[str]:
    rows = []
    for s in summary:
        pair = "–" if s["policy"] == "full" or not s["paired"] else f"{s['wins']} / {s['losses']}"
        row = (s["n_ctx"], f"{s['length']:g}×", LABEL.get(s["policy"], s["policy"]), f"{s['correct']}/{s['n']}",
               _acc(s["correct"], s["n"], s["ci"]), pair)
        if turns == 1:
            row += (f"{s['whole']}/{s['recorded']}" if s.get("recorded") else "–",)
        if turns == 2:
            pair2 = ("–" if s["policy"] == "full" or not s["paired"] else
                     f"{s['second_wins']} / {s['second_losses']}")
            whole = f"{s['second_whole']}/{s['second_recorded']}" if s["second_recorded"] else "–"
            row += (f"{s['second_correct']}/{s['n']}", _acc(s["second_correct"], s["n"], s["second_ci"]), pair2,
                    whole, _f(s["second_ttft_s"]))
        rows.append(row + (_f(s["ttft_s"]), _f(s["tok_s"]), _f(s["cost_s"])))
    head = ("n_ctx", "length", "policy", "right", "accuracy (95 % Wilson)",
            "vs full: it right & full wrong / full right & it wrong")
    if turns == 1:
        head += ("fact held whole",)
    if turns == 2:
        head = head[:3] + ("first right", "first accuracy (95 % Wilson)", "first vs full", "second right",
                           "second accuracy (95 % Wilson)", "second vs full", "second's fact held whole",
                           "second TTFT (s)")
    title = ["## The second question: the next turn asks about another fact", ""] if turns == 2 else []
    return title + [_table(head + ("TTFT (s)", "decode tok/s", "cost per question (s)"), rows), ""]
