"""Where the asked fact's sentence ranks at each cut of room-making (docs/design.md §5.1).

    python scripts/trace_room.py --n-ctx 512 --length 4 --doc 4 --question 0            # both rankings
    python scripts/trace_room.py --n-ctx 512 --length 4 --doc 1 --question 1 --prior none

Reads eval longdoc's document `doc` at `length` x n_ctx and asks its question `question`, as the evaluation's
room policies do (room-spans: prior "none", room-best: prior "max"), and prints for every cut the sentences
ranked, how many cells were kept, the fact sentence's rank by summed score and whether it was kept; then the
answer and whether the fact's sentence is held for it. SmolLM2, 1 thread.
"""

from __future__ import annotations

import argparse

import numpy as np

from page_local.cli.common import resolve_model
from page_local.eval import longdoc as ld
from page_local.evictors.spans import SnapKVSpans


class Traced(SnapKVSpans):
    """snapkv-spans that records, at each call, the rank of the sentences holding `watch` (history indices of the
    engine's conversation)."""

    def __init__(self, prior: str, eng, watch: set[int]):
        super().__init__(prior=prior)
        self.eng, self.watch, self.cuts = eng, watch, []

    def select(self, inp):
        keep = super().select(inp)
        if inp.T > inp.budget:
            idx = self.eng.conv.indices_of(inp.held)  # the conversation as it is now
            ids = np.unique(inp.spans[np.isin(idx, list(self.watch))])
            uniq, inv = np.unique(inp.spans, return_inverse=True)
            order = uniq[np.argsort(-np.bincount(inv, weights=self.score(inp)), kind="stable")]
            ranks = [int(np.flatnonzero(order == i)[0]) + 1 for i in ids]
            kept = bool(ids.size) and bool(np.isin(inp.held[np.isin(inp.spans, ids)], keep).all())
            self.cuts.append((uniq.size, inp.budget, ranks, kept))
        return keep


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-ctx", type=int, default=512)
    ap.add_argument("--length", type=float, default=4.0)
    ap.add_argument("--doc", type=int, default=4)
    ap.add_argument("--question", type=int, default=0, choices=range(ld.FACTS))
    ap.add_argument("--prior", choices=("none", "max", "both"), default="both")
    a = ap.parse_args()
    with ld.LongDocRun(resolve_model(None), "/dev/null", n_ctxs=[a.n_ctx], lengths=[a.length],
                       policies=["room-best"], threads=1) as run:
        cell = run.cells[0]
        doc = run.document(cell, a.doc)
        fact = doc.facts[a.question]
        for prior in (("none", "max") if a.prior == "both" else (a.prior,)):
            eng = run.engine("room-best", cell)
            prompts = [run.prompter.tokens(doc.message(q)) for q in range(ld.FACTS)]
            watch = set(ld.text_cells(eng.model, prompts[a.question], ld.FACT.format(**fact.__dict__)))
            ev = eng.room._evictor = Traced(prior, eng, watch)
            r = ld.reading("room-best", prompts, cell.n_ctx, run.max_tokens, eng.n_keep)
            snap, _ = ld.read_shared(eng, r)
            o = ld.ask(eng, snap, r.suffix[a.question], run.max_tokens)
            print(f"prior {prior}: doc {a.doc} question {a.question} (depth {fact.depth}, code {fact.code})")
            for k, (n, budget, ranks, kept) in enumerate(ev.cuts, 1):
                print(f"  cut {k}: {n} sentences, {budget} cells kept; the fact's sentence ranked "
                      f"{ranks or '(not read yet)'}{', kept' if kept else ', dropped' if ranks else ''}")
            print(f"  held for the answer: {ld.fact_held(eng, fact):.2f}; answer {o['answer'][:60]!r}")


if __name__ == "__main__":
    main()
