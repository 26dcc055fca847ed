#!/usr/bin/env python3
"""Five first-use attention tunings in a row on this machine: does the choice flip? (issue 42, item 5)

    python scripts/five_tunings.py [--model M] [--n-ctx 4096] [--times 5] [--threads 2]

Each round is what a first start measures (engine/attention.py `first_use`: both paths at 256, 1024 and 2048
cells in the 30 s box, decode steps alternated, medians and spreads) and what `decide` picks from it for
n_ctx; nothing is stored. Each round also says how much CPU other processes took meanwhile (`HostMeter`):
a round that `disturbed` marks would not have been kept by a first start. Run it alone, then compare with
`page-local bench decode --flash-attn on` and `--flash-attn off` on the same machine.
"""

from __future__ import annotations

import argparse
import json
import time

from page_local.cli.common import resolve_model
from page_local.defaults import AUTOTUNE_S
from page_local.engine import attention
from page_local.native.runtime import Model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--n-ctx", type=int, default=4096)
    ap.add_argument("--times", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    picks = []
    with Model(resolve_model(args.model)) as m:
        for i in range(args.times):
            t0 = time.perf_counter()
            with attention.HostMeter() as host:
                points = attention.measure(m, args.threads, attention.TUNE_LENGTHS, repeats=5, budget_s=AUTOTUNE_S)
            pick, why = attention.decide(points, args.n_ctx)
            busy = attention.disturbed(host.others_cores, args.threads)
            picks.append(pick)
            print(json.dumps({"round": i + 1, "pick": pick, "kept_by_a_first_start": not busy,
                              "others_cores": round(host.others_cores, 2),
                              "seconds": round(time.perf_counter() - t0, 1), "why": why,
                              "points": {s: [[round(v, 2) for v in p] for p in points[s]] for s in points}}),
                  flush=True)
    print(f"{args.times} tunings at n_ctx {args.n_ctx}: " + ", ".join(picks)
          + ("  (the same every time)" if len(set(picks)) == 1 else "  (FLIPPED)"))


if __name__ == "__main__":
    main()
