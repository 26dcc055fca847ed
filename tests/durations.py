"""Recorded test durations: which test files xdist hands out first, and which tests are `slow`.

tests/durations.json holds each test's seconds (setup + call + teardown, as `pytest --durations=0` reports
them) from a full `make test` on the development machine (docs/test-time.md). Two uses, neither of which
changes what a test does or asserts:

- scheduling: `make test` runs files in parallel workers (`-n 2 --dist loadfile`: a file's module-scoped
  models and servers are made once). xdist hands out files by their number of tests, so a file of a few
  long tests could start last and leave one worker running alone at the end. Files are handed out heaviest
  first by their recorded seconds instead (longest-processing-time first).
- the `slow` marker: a test that took SLOW_S seconds or more is marked slow, so `make test-fast`
  (-m "not slow") is the quick loop; `make test` and CI run everything.

A test not in the file yet counts DEFAULT_S seconds and is not slow. `make test-durations` rewrites the file
from a full run (python tests/durations.py LOG reads pytest's --durations=0 report).
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

FILE = Path(__file__).with_name("durations.json")
SLOW_S = 5.0
DEFAULT_S = 1.0
HAVE_XDIST = importlib.util.find_spec("xdist") is not None


def load() -> dict[str, float]:
    try:
        return json.loads(FILE.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def mark_slow(items) -> None:
    import pytest

    seconds = load()
    for item in items:
        if seconds.get(item.nodeid, 0.0) >= SLOW_S:
            item.add_marker(pytest.mark.slow)


def make_scheduler(config, log):
    """xdist's file scheduler, handing out the heaviest remaining file first (None: another --dist mode)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    seconds = load()

    class HeaviestFileFirst(LoadFileScheduling):
        def _assign_work_unit(self, node) -> None:  # LoadScopeScheduling's, but not in collection order
            scope = max(self.workqueue, key=lambda s: sum(seconds.get(n, DEFAULT_S) for n in self.workqueue[s]))
            work_unit = self.workqueue.pop(scope)
            self.assigned_work.setdefault(node, {})[scope] = work_unit
            collection = self.registered_collections[node]
            node.send_runtest_some([collection.index(n) for n, done in work_unit.items() if not done])

    return HeaviestFileFirst(config, log)


def record(log: str | Path, out: Path = FILE) -> dict[str, float]:
    """Per-test seconds from a `pytest --durations=0 --durations-min=0` report, written to `out`."""
    seconds: dict[str, float] = {}
    for line in Path(log).read_text(encoding="utf-8", errors="replace").splitlines():
        m = re.match(r"\s*([\d.]+)s (?:setup|call|teardown)\s+(\S+::\S+)", line)
        if m:
            seconds[m.group(2)] = seconds.get(m.group(2), 0.0) + float(m.group(1))
    if not seconds:
        raise SystemExit(f"{log}: no --durations=0 lines")
    rounded = {k: round(v, 1) for k, v in sorted(seconds.items())}
    out.write_text(json.dumps(rounded, indent=0) + "\n", encoding="utf-8")
    return rounded


if __name__ == "__main__":
    got = record(sys.argv[1])
    slow = sum(v >= SLOW_S for v in got.values())
    print(f"{FILE}: {len(got)} tests, {sum(got.values()):.0f} s in all, {slow} slow (>= {SLOW_S:g} s)")
