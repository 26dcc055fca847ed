"""The evaluation is exact: re-running a committed results file's samples reproduces its rows.

tests/fixtures/eval-rows.jsonl was written by `page-local eval run` (commands below) on SmolLM2 before
the turn pipeline was shared by the engine and the runner; every row must come out again field for
field (timings aside). This pins the whole turn: prefill, probe, D, gate, every evictor's signals,
eviction into a candidate sequence, teacher forcing, greedy answers and self-verification.

    page-local eval run --tasks niah_single_1,niah_multivalue --n 1 --length 768 --budgets 0.25 \
        --evictors snapkv,h2o,lorekv,tova,knorm --gates always,page,verify,page+verify --out F
    page-local eval run --tasks niah_multikey_2 --n 1 --length 768 --budgets 0.5,48 \
        --evictors snapkv,pyramidkv,random,streamingllm --gates always,verify --query-agnostic --out F

The test reruns 43 of the 59 rows (REPLAYED): every row of niah_single_1 (5 evictors x 4 gates) and of
niah_multikey_2 (4 evictors x 2 budgets x 2 gates, query-agnostic), and niah_multivalue's full-cache and
snapkv rows (its answer runs to the 128-token cap; verified over verify_m = 64 tokens). Every task, every
(query_agnostic, length, evictor, budget, gate) of the fixture and every gate's open and closed verdicts
are still rerun and compared field for field (asserted); left out are niah_multivalue's h2o, lorekv, tova
and knorm rows, those evictors being pinned on niah_single_1. Each task is rerun as a run of its own (one
sample, a fresh engine, n_ctx 1,024 as in the joint run), so niah_multivalue's snapkv rows are still
computed right after its full answer, as they were.
"""

from __future__ import annotations

import json
import math
import platform
from pathlib import Path

import pytest

from page_local.eval.rows import read_rows
from page_local.eval.runner import run_eval

FIXTURES = Path(__file__).parent / "fixtures"
FIXTURE = FIXTURES / "eval-rows.jsonl"  # reproduced on an Intel Xeon (AVX-512), flash attention on
# Floats are compared to 1e-5 relative: the same build on another x86 family may sum in another order.
REL = 1e-5


def cpu_class() -> str:
    """The vector extension llama.cpp's CPU kernels use here — what the loaded library was compiled for, not
    what the CPU has (`make test-isa` runs AVX2 kernels on an AVX-512 CPU): rows written on one class do not
    reproduce on another (on an AMD EPYC Zen 1, AVX2 only, D moved by 1 % and a NLL by 5 % on the Xeon's rows)."""
    from page_local.native import pageops

    info = pageops.llama_cpp().llama_print_system_info().decode()
    if "AVX512 = 1" in info:
        return "avx512"
    if "AVX2 = 1" in info:
        return "avx2"
    return platform.machine().lower()


# the committed rows of each CPU class; both were written with flash attention on and llama.cpp's own decode
# kernel (before page-local chose the path and patched the kernel), so the rerun pins both
ROWS = {"avx512": FIXTURE, "avx2": FIXTURES / "eval-rows-avx2.jsonl"}


def REPLAYED(r: dict) -> bool:
    """The fixture's rows the test reruns (module docstring): all but niah_multivalue's h2o, lorekv, tova
    and knorm rows."""
    return r["task"] != "niah_multivalue" or r["evictor"] in (None, "snapkv")


def _kinds(rows: list[dict]) -> set[tuple]:
    """What a set of rows covers: each (query_agnostic, length, evictor, budget, gate) of it."""
    return {(r["query_agnostic"], r["length_target"], str(r["evictor"]), json.dumps(r["budget"]), r["gate"])
            for r in rows}


def _runs(rows: list[dict]) -> list[dict]:
    """The eval runs that rewrite the rows: one per (task, query_agnostic, length, seed, verify_m)."""
    runs: dict[tuple, dict] = {}
    for r in rows:
        key = (r["task"], r["query_agnostic"], r["length_target"], r["seed"], r["verify_m"])
        run = runs.setdefault(key, dict(tasks=[], evictors=[], budgets=[], gates=[]))
        for field, value in (("tasks", r["task"]), ("evictors", r["evictor"]), ("budgets", r["budget"]),
                             ("gates", r["gate"])):
            if value is not None and value != "full" and value not in run[field]:
                run[field].append(value)
    return [dict(v, query_agnostic=k[1], length=k[2], seed=k[3], verify_m=k[4]) for k, v in runs.items()]


def _same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and math.isclose(a, b, rel_tol=REL, abs_tol=1e-9)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def test_rerun_reproduces_the_committed_rows(tmp_path, monkeypatch):
    fixture = ROWS.get(cpu_class())
    if fixture is None or not fixture.exists():
        pytest.skip(f"no rows are committed for this CPU class ({cpu_class()}): write them with the commands in "
                    "this module's docstring under PAGE_LOCAL_FLASH_ATTN=on, as tests/fixtures/eval-rows-<class>.jsonl")
    monkeypatch.setenv("PAGE_LOCAL_FLASH_ATTN", "on")
    # and llama.cpp's own one-token decode kernel: page-local's (csrc/kernels/page-fa-decode.cpp) sums in another order
    monkeypatch.setenv("PAGE_LOCAL_FA_KERNEL", "llama.cpp")
    monkeypatch.setenv("PAGE_LOCAL_PROBE_BATCH", "apart")  # the rows were read with the probe's window a batch of its own
    want = read_rows(fixture)
    assert len(want) == 59, "the fixture holds 3 samples' rows"
    assert {r["task"] for r in want} == {r["task"] for r in read_rows(FIXTURE)}  # the same samples as the first
    want = [r for r in want if REPLAYED(r)]
    assert len(want) == 43
    # still every task, and every (query_agnostic, length, evictor, budget, gate) of the fixture
    assert {r["task"] for r in want} == {r["task"] for r in read_rows(fixture)}
    assert _kinds(want) == _kinds(read_rows(fixture))
    verdicts = lambda rows: {(r["gate"], r["open"], r["evicted"]) for r in rows}  # noqa: E731
    assert verdicts(want) == verdicts(read_rows(fixture))  # each gate's open and closed verdicts too
    for run in _runs(want):
        run_eval(tasks=run["tasks"], n=1, length=run["length"], budgets=run["budgets"], evictors=run["evictors"],
                 gates=run["gates"], seed=run["seed"], verify_m=run["verify_m"],
                 query_agnostic=run["query_agnostic"], out=tmp_path / "rows.jsonl")
    got = read_rows(tmp_path / "rows.jsonl")
    key = lambda r: (r["task"], r["index"], str(r["evictor"]), json.dumps(r["budget"]), r["gate"])  # noqa: E731
    assert sorted(map(key, got)) == sorted(map(key, want))
    got_by = {key(r): r for r in got}
    for w in want:
        g = got_by[key(w)]
        assert g.keys() == w.keys(), key(w)
        diff = {f: (w[f], g[f]) for f in w if f != "timings" and not _same(w[f], g[f])}
        assert not diff, f"{key(w)}: {diff}"


@pytest.mark.parametrize("field", ["prediction", "verify_loss", "D"])
def test_the_comparison_can_fail(field):
    """The comparison above is not vacuous: a changed field is a difference."""
    row = read_rows(FIXTURE)[1]
    other = dict(row)
    if field == "prediction":
        other[field] = row[field] + "x"
    elif field == "verify_loss":
        other[field] = [x + 1e-3 for x in row[field]] if row[field] else [0.5]
    else:
        other[field] = row[field] * (1 + 1e-3)
    assert not _same(row[field], other[field])
