"""The slow marker (tests/durations.py) does not depend on which machine recorded the durations."""

from __future__ import annotations

import durations

RECORD = {
    "reference_s": 0.5,
    "tests": {"tests/test_a.py::quick": 0.2, "tests/test_a.py::long": 4.5, "tests/test_a.py::shares": 0.3,
              "tests/test_b.py::setup_heavy": 4.2, "tests/test_b.py::after": 0.1, "tests/test_c.py::alone": 0.1},
    "setup": {"tests/test_b.py::setup_heavy": 4.1},
}
FIXTURES = {"tests/test_a.py::quick": [], "tests/test_a.py::long": ["model"], "tests/test_a.py::shares": ["model"],
            "tests/test_b.py::setup_heavy": ["server"], "tests/test_b.py::after": ["server"],
            "tests/test_c.py::alone": ["server"]}


def scaled(record: dict, k: float) -> dict:
    return {"reference_s": record["reference_s"] * k,
            "tests": {n: s * k for n, s in record["tests"].items()},
            "setup": {n: s * k for n, s in record["setup"].items()}}


def test_a_slower_or_faster_machine_marks_the_same_tests():
    """The record in reference steps: 4.5 s = 9 steps is slow, 0.3 s is not; a test that shares the fixture
    whose setup took 8.2 steps is slow too (it would pay the setup alone), one in another file is not."""
    want = {"tests/test_b.py::setup_heavy", "tests/test_b.py::after"} | (
        {"tests/test_a.py::long"} if 4.5 >= durations.SLOW_STEPS * 0.5 else set())
    for k in (0.25, 1.0, 3.0):
        assert durations.slow_nodeids(scaled(RECORD, k), FIXTURES) == want, k


def test_a_record_without_a_reference_falls_back_to_seconds():
    old = {"tests": RECORD["tests"], "setup": RECORD["setup"]}
    assert durations.slow_nodeids(old, FIXTURES) == set()  # nothing reaches SLOW_S = 5 s
    assert durations.slow_seconds(None) == durations.SLOW_S
