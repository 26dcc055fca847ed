"""Read existing RULER builds into `Sample`s, so that any RULER set runs as is.

Two row formats:
* RULER jsonl (`scripts/data/prepare.py`, KVCache-Factory `data/RULER/<len>/<task>.jsonl`):
  {"index", "input", "outputs", "length"} with the answer prefix left at the end of "input"
  (newer builds store it in "answer_prefix" instead). The input is split as kvpress does: the
  question starts at the last match of the task's question anchor, the prefix at the first
  "The special magic" (niah) or "Answer:" (vt, cwe, fwe, qa) after it (templates.split_ruler_input).
  Use inputs built with RULER's "base" model template: chat markup would stay in the prompt.
* kvpress rows (HF `simonjegou/ruler`): {"context", "question", "answer_prefix", "answer" (list),
  "task", "max_new_tokens"}, as .jsonl or .json (a list of rows, or a dict of equal-length
  columns). `Sample.to_row()` writes this format, with the Sample's other fields as extras.

The task name comes from the `task` argument, else the file name ("niah_single_1.jsonl"), else
the folder (RULER's "<task>/validation.jsonl"), else the question anchor found in each row.
Bad rows raise ValueError naming the file and line (jsonl) or row (json).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from page_local.tasks.sample import Sample
from page_local.tasks.templates import FAMILY_MAX_NEW_TOKENS, QUESTION_PATTERNS, family, metric_for, split_ruler_input

RULER_KEYS = ("input", "outputs")
KVPRESS_KEYS = ("context", "question", "answer_prefix", "answer", "task")


def _rows(path: Path) -> Iterator[tuple[str, int, dict]]:
    """(where, position, row) for every row; where = "file:line" or "file: row i"."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{e.lineno}: invalid JSON: {e.msg}") from None
        if isinstance(data, dict):  # columns, as pandas' to_json(orient="columns"/"list")
            cols = {k: list(v.values()) if isinstance(v, dict) else v for k, v in data.items()}
            if not all(isinstance(v, list) for v in cols.values()) or \
                    len({len(v) for v in cols.values()}) > 1:
                raise ValueError(f"{path}: a JSON object must map column names to equal-length lists")
            n = len(next(iter(cols.values()), []))
            data = [{k: v[i] for k, v in cols.items()} for i in range(n)]
        if not isinstance(data, list):
            raise ValueError(f"{path}: expected a list of rows or a dict of columns")
        for i, row in enumerate(data):
            yield f"{path}: row {i}", i, row
        return
    position = 0
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: invalid JSON: {e.msg}") from None
        yield f"{path}:{lineno}", position, row
        position += 1


def _str_list(v, what: str) -> list[str]:
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not v or not all(isinstance(a, str) for a in v):
        raise ValueError(f"{what} must be a non-empty list of strings, got {v!r:.80}")
    return v


def _index(row: dict, default: int) -> int:
    i = row.get("index", default)
    if isinstance(i, bool) or not isinstance(i, int):
        raise ValueError(f"index must be an int, got {i!r}")
    return i


def _task_from_path(path: Path) -> str | None:
    for name in (path.stem, path.parent.name):
        if family(name) in QUESTION_PATTERNS:
            return name
    return None


def _detect_family(text: str) -> str:
    found = [(m[-1].start(), fam) for fam, pat in QUESTION_PATTERNS.items()
             if (m := list(pat.finditer(text)))]
    if not found:
        raise ValueError("no RULER question anchor found; pass task= or name the file after it")
    return max(found)[1]


def _check_row(row: object, keys: tuple[str, ...], kind: str) -> None:
    if not isinstance(row, dict):
        raise ValueError(f"a row must be a JSON object, got {type(row).__name__}")
    missing = [k for k in keys if k not in row]
    if missing:
        raise ValueError(f"missing {kind} field(s) {missing}")


def ruler_row_to_sample(row: dict, task: str | None, position: int) -> Sample:
    _check_row(row, RULER_KEYS, "RULER")
    text = row["input"]
    if not isinstance(text, str):
        raise ValueError(f"input must be a string, got {type(text).__name__}")
    fam = family(task) if task else None
    if fam not in QUESTION_PATTERNS:
        fam = _detect_family(text)
    context, question, prefix = split_ruler_input(text, fam)
    if not prefix:
        prefix = row.get("answer_prefix") or ""
        if not isinstance(prefix, str) or not prefix:
            raise ValueError("no answer prefix at the end of input and no answer_prefix field")
    new = FAMILY_MAX_NEW_TOKENS[fam]
    length = row.get("length")
    if isinstance(length, int) and not isinstance(length, bool):
        length = max(0, length - new)  # RULER's length includes the tokens to generate
    else:
        length = None
    name = task or fam
    return Sample(task=name, index=_index(row, position), context=context, question=question,
                  answer_prefix=prefix, answers=_str_list(row["outputs"], "outputs"),
                  max_new_tokens=new, metric=metric_for(name), length=length,
                  meta={"source": "ruler"})


def kvpress_row_to_sample(row: dict, position: int) -> Sample:
    _check_row(row, KVPRESS_KEYS, "kvpress")
    task = row["task"]
    if not isinstance(task, str) or not task:
        raise ValueError(f"task must be a non-empty string, got {task!r}")
    new = row.get("max_new_tokens")
    if new is None:
        if family(task) not in FAMILY_MAX_NEW_TOKENS:
            raise ValueError(f"no max_new_tokens and no default for task {task!r}")
        new = FAMILY_MAX_NEW_TOKENS[family(task)]
    meta = row.get("meta") or {}
    if not isinstance(meta, dict):
        raise ValueError(f"meta must be an object, got {meta!r:.80}")
    answers = row["answer"]
    if not (answers == [] and family(task) == "prose"):  # the pilot text has no references
        answers = _str_list(answers, "answer")
    return Sample(task=task, index=_index(row, position), context=row["context"],
                  question=row["question"], answer_prefix=row["answer_prefix"], answers=answers,
                  max_new_tokens=new, metric=row.get("metric") or metric_for(task),
                  length=row.get("length"), seed=row.get("seed"), meta=meta)


def read_ruler_jsonl(path, task: str | None = None) -> list[Sample]:
    """Samples from a RULER jsonl file; see the module docstring for the task name and split."""
    path = Path(path)
    task = task or _task_from_path(path)
    return [_wrap(where, ruler_row_to_sample, row, task, pos) for where, pos, row in _rows(path)]


def read_kvpress(path) -> list[Sample]:
    """Samples from kvpress-style rows in a .jsonl or .json file."""
    path = Path(path)
    return [_wrap(where, kvpress_row_to_sample, row, pos) for where, pos, row in _rows(path)]


def read_samples(path, task: str | None = None) -> list[Sample]:
    """Either format, chosen per row by its keys ("input"/"outputs" or "context"/"question")."""
    path = Path(path)
    task = task or _task_from_path(path)
    out = []
    for where, pos, row in _rows(path):
        if isinstance(row, dict) and "input" in row:
            out.append(_wrap(where, ruler_row_to_sample, row, task, pos))
        else:
            out.append(_wrap(where, kvpress_row_to_sample, row, pos))
    return out


def _wrap(where: str, convert, *args) -> Sample:
    try:
        return convert(*args)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
