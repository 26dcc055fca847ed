"""Recorded test durations: which test files xdist hands out first, and which tests are `slow`.

tests/durations.json holds each test's seconds (setup + call + teardown, as `pytest --durations=0` reports
them; "tests") and, where it took a second or more, its setup's ("setup": the module-scoped models, servers
and runs it was the first to need) from a full `make test` on the development machine (docs/test-time.md).
Two uses, neither of which changes what a test does or asserts:

- scheduling: `make test` runs files in parallel workers (`-n 2 --dist loadfile`: a file's module-scoped
  models and servers are made once). xdist hands out files by their number of tests, so a file of a few
  long tests could start last and leave one worker running alone at the end. Files are handed out heaviest
  first by their recorded seconds instead (longest-processing-time first).
- the `slow` marker: a test that took SLOW_S seconds or more is marked slow, and so is every test of its file
  that uses a module- or session-scoped fixture whose setup took SLOW_S or more (left to itself, the next
  such test would pay it), so `make test-fast` (-m "not slow") is the quick loop; `make test` and CI run
  everything.

The record does not depend on which machine wrote it: beside the seconds it keeps `reference_s`, the seconds
the recording machine took for a reference step (reference_step: the embedded model reading 256 tokens on one
thread, the work most of the suite's time is made of), and a test is slow when it took SLOW_STEPS reference
steps or more. A machine twice as slow records twice the seconds and twice the reference: the same marks.
(A record without a reference, as written before, falls back to SLOW_S seconds.)

A test not in the file yet counts DEFAULT_S seconds and is not slow. `make test-durations` rewrites the file
from a full run (python tests/durations.py LOG reads pytest's --durations=0 report and measures the reference
step on the machine that ran it, right after the run).
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

FILE = Path(__file__).with_name("durations.json")
SLOW_S = 5.0
# a test is slow from this many reference steps on (3.9 s on the Intel Xeon that recorded durations.json, whose
# reference step took 0.97 s: `make test-fast` in 3 minutes there)
SLOW_STEPS = 4.0
REFERENCE_TOKENS = 256
DEFAULT_S = 1.0
HAVE_XDIST = importlib.util.find_spec("xdist") is not None


def _data() -> dict:
    try:
        return json.loads(FILE.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def load() -> tuple[dict[str, float], dict[str, float]]:
    """(seconds per test, setup seconds per test where >= 1 s)."""
    data = _data()
    return data.get("tests", {}), data.get("setup", {})


def slow_seconds(reference_s: float | None) -> float:
    """The seconds from which a recorded test is slow, for a record whose reference step took reference_s."""
    return SLOW_STEPS * reference_s if reference_s else SLOW_S


def reference_step(repeats: int = 3) -> float:
    """Seconds (median of repeats) for the embedded SmolLM2 to read REFERENCE_TOKENS tokens on one thread, on
    a fresh cache each time: the unit durations are recorded in."""
    import statistics
    import time

    from page_local.native.runtime import Context, ContextConfig, Model
    from page_local.store import models

    toks = [(i * 7919) % 20000 + 100 for i in range(REFERENCE_TOKENS)]
    times = []
    with Model(models.smollm2_path()) as m, Context(m, ContextConfig(n_ctx=512, threads=1)) as ctx:
        ctx.decode(toks[:32], 0, 0, logits="none")  # warm-up: first-touch of the weights
        for _ in range(repeats):
            ctx.clear()
            t0 = time.perf_counter()
            ctx.decode(toks, 0, 0, logits="none")
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _shared_fixtures(item) -> list[str]:
    """The module-, package- or session-scoped fixtures a test uses."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return []
    return [name for name, defs in info.name2fixturedefs.items() if defs and defs[-1].scope != "function"]


def slow_nodeids(data: dict, fixtures: dict[str, list[str]]) -> set[str]:
    """The tests a record marks slow. fixtures: each test's module-, package- or session-scoped fixtures.
    A test is slow when it took slow_seconds or more, or when a test of its file that took that long to set
    up made a shared fixture it uses (left to itself, it would pay that setup)."""
    seconds, setup = data.get("tests", {}), data.get("setup", {})
    slow = slow_seconds(data.get("reference_s"))
    costly = {(nodeid.split("::")[0], name) for nodeid, names in fixtures.items()
              if setup.get(nodeid, 0.0) >= slow for name in names}
    return {nodeid for nodeid, names in fixtures.items()
            if seconds.get(nodeid, 0.0) >= slow or any((nodeid.split("::")[0], n) in costly for n in names)}


def mark_slow(items) -> None:
    import pytest

    slow = slow_nodeids(_data(), {item.nodeid: _shared_fixtures(item) for item in items})
    for item in items:
        if item.nodeid in slow:
            item.add_marker(pytest.mark.slow)


def make_scheduler(config, log):
    """xdist's file scheduler, handing out the heaviest remaining file first (None: another --dist mode)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    seconds = load()[0]

    class HeaviestFileFirst(LoadFileScheduling):
        def _assign_work_unit(self, node) -> None:  # LoadScopeScheduling's, but not in collection order
            scope = max(self.workqueue, key=lambda s: sum(seconds.get(n, DEFAULT_S) for n in self.workqueue[s]))
            work_unit = self.workqueue.pop(scope)
            self.assigned_work.setdefault(node, {})[scope] = work_unit
            collection = self.registered_collections[node]
            node.send_runtest_some([collection.index(n) for n, done in work_unit.items() if not done])

    return HeaviestFileFirst(config, log)


def record(log: str | Path, out: Path = FILE, reference_s: float | None = None) -> dict:
    """Per-test seconds from a `pytest --durations=0 --durations-min=0` report, written to `out` with the
    reference step's seconds on this machine (measured now when not given)."""
    seconds: dict[str, float] = {}
    setup: dict[str, float] = {}
    for line in Path(log).read_text(encoding="utf-8", errors="replace").splitlines():
        m = re.match(r"\s*([\d.]+)s (setup|call|teardown)\s+(\S+::\S+)", line)
        if m:
            t, phase, nodeid = float(m.group(1)), m.group(2), m.group(3)
            seconds[nodeid] = seconds.get(nodeid, 0.0) + t
            if phase == "setup":
                setup[nodeid] = t
    if not seconds:
        raise SystemExit(f"{log}: no --durations=0 lines")
    ref = reference_step() if reference_s is None else reference_s
    data = {"reference_s": round(ref, 4), "tests": {k: round(v, 1) for k, v in sorted(seconds.items())},
            "setup": {k: round(v, 1) for k, v in sorted(setup.items()) if v >= 1.0}}
    out.write_text(json.dumps(data, indent=0) + "\n", encoding="utf-8")
    return data


if __name__ == "__main__":
    data = record(sys.argv[1])
    got, limit = data["tests"], slow_seconds(data["reference_s"])
    slow = sum(v >= limit for v in got.values())
    print(f"{FILE}: {len(got)} tests, {sum(got.values()):.0f} s in all; reference step {data['reference_s']:.3f} s, "
          f"{slow} slow (>= {SLOW_STEPS:g} steps = {limit:.1f} s here)")
