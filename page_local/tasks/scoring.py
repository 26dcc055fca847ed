"""RULER scoring (NVIDIA/RULER `scripts/eval/synthetic/constants.py`, `evaluate.py`; docs/algorithms.md §6.1).

A prediction is stripped, every control character [\\x00-\\x1f] becomes a newline, and it is
stripped again (`normalize_prediction`). A reference counts when it is a case-insensitive substring
of the prediction. Per sample:
* string_match_all  = fraction of the references contained (niah_*, vt, cwe, fwe);
* string_match_part = 1 if any reference is contained, else 0 (qa_1, qa_2).
RULER reports the mean over samples x 100 (`task_score`).
"""

from __future__ import annotations

import re
from typing import Callable, Sequence

from page_local.tasks.sample import Sample

_CONTROL = re.compile(r"[\x00-\x1f]")


def normalize_prediction(prediction: str) -> str:
    """RULER's postprocess_pred: strip, control characters -> newline, strip."""
    if not isinstance(prediction, str):
        raise ValueError(f"prediction must be a string, got {type(prediction).__name__}")
    return _CONTROL.sub("\n", prediction.strip()).strip()


def _references(references: Sequence[str]) -> list[str]:
    refs = [references] if isinstance(references, str) else list(references)
    if not refs or not all(isinstance(r, str) for r in refs):
        raise ValueError(f"references must be a non-empty list of strings, got {references!r:.80}")
    return refs


def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """Fraction of references that are case-insensitive substrings of `prediction` (as given)."""
    refs = _references(references)
    pred = prediction.lower()
    return sum(r.lower() in pred for r in refs) / len(refs)


def string_match_part(prediction: str, references: Sequence[str]) -> float:
    """1.0 if any reference is a case-insensitive substring of `prediction` (as given), else 0.0."""
    refs = _references(references)
    pred = prediction.lower()
    return float(any(r.lower() in pred for r in refs))


METRICS: dict[str, Callable[[str, Sequence[str]], float]] = {
    "all": string_match_all,
    "part": string_match_part,
}


def score(sample: Sample, prediction: str) -> float:
    """The sample's metric on the normalised prediction, in [0, 1].

    ValueError for a sample without references (e.g. the unlabeled `prose` pilot).
    """
    if not sample.answers:
        raise ValueError(f"sample {sample.task}[{sample.index}] has no reference answers to score")
    return METRICS[sample.metric](normalize_prediction(prediction), sample.answers)


def correct(sample: Sample, prediction: str) -> bool:
    """Full credit: every reference found ("all"), or any ("part")."""
    return score(sample, prediction) == 1.0


def task_score(samples: Sequence[Sample], predictions: Sequence[str]) -> float:
    """RULER's task number: mean per-sample score x 100."""
    if len(samples) != len(predictions):
        raise ValueError(f"{len(samples)} samples but {len(predictions)} predictions")
    if not samples:
        raise ValueError("no samples to score")
    return 100.0 * sum(score(s, p) for s, p in zip(samples, predictions)) / len(samples)
