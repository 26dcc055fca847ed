#!/usr/bin/env python3
"""Prefill and decode speed of two builds of the library, or of two models, same prompt, alternated.

    python scripts/compare_speed.py --lib-dirs DIR_A DIR_B [--model M] [--rounds 5] [--tokens 2048]
    python scripts/compare_speed.py --models MODEL_A MODEL_B [--rounds 5] [--tokens 2048]

A DIR holds a libllama (e.g. build/bin of two build trees); a MODEL is a GGUF path or a name from
`page-local models`. One process per run (a process holds one libllama): `page-local bench decode
--repeats 1 --json`, A and B alternated so that drift on the machine hits both alike. Prints the
medians and B/A.
Run it alone: with 2 threads on 2 cores any other busy process ruins llama.cpp's timings.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys


def one_run(lib_dir: str | None, model: str | None, args) -> dict:
    exe = shutil.which("page-local") or os.path.join(os.path.dirname(sys.executable), "page-local")
    cmd = [exe, "bench", "decode", "--tokens", str(args.tokens), "--new-tokens", str(args.new_tokens),
           "--repeats", "1", "--threads", str(args.threads), "--json"]
    if model:
        cmd += ["--model", model]
    env = dict(os.environ)
    if lib_dir:
        env["PAGE_LOCAL_LIB_DIR"] = os.path.abspath(lib_dir)
        # libllama finds libggml*.so by its RUNPATH, the build tree it was linked in: a copied DIR would load the
        # original tree's ggml-cpu (with the kernels) unless the loader looks in DIR first
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [os.path.abspath(lib_dir), env.get("LD_LIBRARY_PATH")]))
    env.pop("LLAMA_CPP_LIB_PATH", None)
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} (library {lib_dir or 'default'}) failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--lib-dirs", nargs=2, metavar=("DIR_A", "DIR_B"))
    what.add_argument("--models", nargs=2, metavar=("MODEL_A", "MODEL_B"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    pair = args.lib_dirs or args.models
    runs: dict[str, list[dict]] = {"a": [], "b": []}
    for i in range(2 * args.rounds):
        which = "ab"[i % 2]
        item = pair[i % 2]
        if args.lib_dirs:
            runs[which].append(one_run(item, args.model, args))
        else:
            runs[which].append(one_run(None, item, args))
    out = {"tokens": args.tokens, "new_tokens": args.new_tokens, "rounds": args.rounds,
           "a": pair[0], "b": pair[1]}
    for which in "ab":
        pre = [args.tokens / r["prefill_s"] for r in runs[which]]
        dec = [r["full_tok_s"] for r in runs[which]]
        out[f"{which}_prefill_tok_s"] = round(statistics.median(pre), 1)
        out[f"{which}_decode_tok_s"] = round(statistics.median(dec), 1)
        out[f"{which}_prefill_runs"] = [round(x, 1) for x in pre]
        out[f"{which}_decode_runs"] = [round(x, 1) for x in dec]
    out["prefill_ratio_b_over_a"] = round(out["b_prefill_tok_s"] / out["a_prefill_tok_s"], 3)
    out["decode_ratio_b_over_a"] = round(out["b_decode_tok_s"] / out["a_decode_tok_s"], 3)
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{args.tokens}-token prompt, {args.rounds} alternated runs each, medians")
        print(f"  A {pair[0]}: prefill {out['a_prefill_tok_s']} tok/s, decode {out['a_decode_tok_s']} tok/s")
        print(f"  B {pair[1]}: prefill {out['b_prefill_tok_s']} tok/s, decode {out['b_decode_tok_s']} tok/s")
        print(f"  B/A: prefill {out['prefill_ratio_b_over_a']}x, decode {out['decode_ratio_b_over_a']}x")


if __name__ == "__main__":
    main()
