"""Results rows: one JSON object per (sample, configuration), appended to a JSONL file by the runner and
read back by metrics, report and verify_rules."""

from __future__ import annotations

import json
import os
from pathlib import Path

# every (sample, configuration) row is identified by these fields (resuming skips what is there)
KEY_FIELDS = ("model", "source", "task", "index", "length_target", "seed", "query_agnostic", "verify_m",
              "evictor", "budget", "gate")
FULL = "full"  # the gate name of the full-cache configuration (evictor and budget are None)


def _jkey(v) -> str:
    return json.dumps(v)


def row_key(row: dict) -> tuple:
    return tuple(_jkey(row.get(k)) for k in KEY_FIELDS)


def read_rows_file(path: str | os.PathLike) -> list[dict]:
    """read_rows for a file that must be there (the readers of committed rows): ValueError when it is
    missing or holds no rows."""
    if not Path(path).is_file():
        raise ValueError(f"{path}: no such rows file (an `eval run --out` JSONL, or its .gz)")
    rows = read_rows(path)
    if not rows:
        raise ValueError(f"{path} holds no rows")
    return rows


def read_rows(path: str | os.PathLike, repair: bool = False) -> list[dict]:
    """Rows of a results file. A truncated LAST line (an interrupted write) is ignored, and with
    repair=True cut off the file; a bad line elsewhere is a ValueError naming it. A file ending in
    .gz (a committed, compressed results file) is read as gzip; it is never repaired."""
    path = Path(path)
    if not path.exists():
        return []
    if path.suffix == ".gz":
        import gzip

        try:
            data = gzip.decompress(path.read_bytes())
        except (OSError, EOFError) as e:
            raise ValueError(f"{path}: not a readable gzip file ({e})") from None
        repair = False
    else:
        data = path.read_bytes()
    rows, offset = [], 0
    lines = data.split(b"\n")
    for i, line in enumerate(lines):
        end = offset + len(line) + 1
        if line.strip():
            try:
                row = json.loads(line)
                if not isinstance(row, dict):
                    raise ValueError("not an object")
                rows.append(row)
            except ValueError as e:
                if all(not x.strip() for x in lines[i + 1:]):  # the last line: an interrupted write
                    if repair:
                        with open(path, "r+b") as f:
                            f.truncate(offset)
                    break
                raise ValueError(f"{path}:{i + 1}: not a results row ({e})") from None
        offset = end
    return rows


def made_where() -> dict:
    """machine and library: the CPU and the build that made a row (not key fields: greedy answers move with a CPU
    family's rounding and with a rebuilt kernel, so rows of different ones are not paired evidence of a policy's
    effect, but a run resumed elsewhere keeps its rows)."""
    from page_local.native.pageops import library_dir
    from page_local.store.tuning import library_signature, machine_signature
    return dict(machine=machine_signature(), library=library_signature(library_dir()))
