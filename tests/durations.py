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


def load() -> tuple[dict[str, float], dict[str, float]]:
    """(seconds per test, setup seconds per test where >= 1 s)."""
    try:
        data = json.loads(FILE.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}, {}
    return data.get("tests", {}), data.get("setup", {})


def _shared_fixtures(item) -> list[str]:
    """The module-, package- or session-scoped fixtures a test uses."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return []
    return [name for name, defs in info.name2fixturedefs.items() if defs and defs[-1].scope != "function"]


def mark_slow(items) -> None:
    import pytest

    seconds, setup = load()
    costly = {(item.nodeid.split("::")[0], name) for item in items if setup.get(item.nodeid, 0.0) >= SLOW_S
              for name in _shared_fixtures(item)}
    for item in items:
        file = item.nodeid.split("::")[0]
        if seconds.get(item.nodeid, 0.0) >= SLOW_S or any((file, n) in costly for n in _shared_fixtures(item)):
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


def record(log: str | Path, out: Path = FILE) -> dict[str, float]:
    """Per-test seconds from a `pytest --durations=0 --durations-min=0` report, written to `out`."""
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
    data = {"tests": {k: round(v, 1) for k, v in sorted(seconds.items())},
            "setup": {k: round(v, 1) for k, v in sorted(setup.items()) if v >= 1.0}}
    out.write_text(json.dumps(data, indent=0) + "\n", encoding="utf-8")
    return data["tests"]


if __name__ == "__main__":
    got = record(sys.argv[1])
    slow = sum(v >= SLOW_S for v in got.values())
    print(f"{FILE}: {len(got)} tests, {sum(got.values()):.0f} s in all, {slow} slow (>= {SLOW_S:g} s)")
