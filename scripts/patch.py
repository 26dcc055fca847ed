#!/usr/bin/env python3
"""`patch -p1 --forward --batch --fuzz 0 -i FILE` for a machine without GNU patch.

CMakeLists.txt applies csrc/patches/ with GNU patch. scripts/check-gpu.sh --bundle runs on machines that may
lack it (a bare image with gcc but not build-essential); there it puts this file on PATH as `patch`. It
applies a unified diff of changed files (no new or deleted files) in the current folder the way patch does
with --fuzz 0: each hunk where its context and removed lines match exactly, at the line the hunk names or
the nearest offset after the previous hunk. A hunk that does not match (or one applied before: --forward)
fails the whole patch, which then changes nothing, exit status 1.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def read_lines(path: str | Path) -> list[str]:
    """The lines of a file with their endings, split at \\n only (CRLF and other bytes kept as they are)."""
    parts = Path(path).read_bytes().decode("utf-8", "surrogateescape").split("\n")
    return [p + "\n" for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


def parse(lines: list[str], strip: int) -> list[tuple[str, list[tuple[int, list[str], list[str]]]]]:
    """[(path, [(old start line, old lines, new lines), ...]), ...] of a unified diff."""
    files: list[tuple[str, list]] = []
    i = 0
    while i < len(lines):
        if lines[i].startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            old = lines[i][4:].split("\t")[0].strip()
            new = lines[i + 1][4:].split("\t")[0].strip()
            if old == "/dev/null" or new == "/dev/null":
                raise SystemExit(f"patch.py: {new if old == '/dev/null' else old}: new and deleted files are not supported")
            files.append(("/".join(new.split("/")[strip:]), []))
            i += 2
            continue
        m = HUNK.match(lines[i])
        if m:
            if not files:
                raise SystemExit(f"patch.py: a hunk before any file header (line {i + 1})")
            n_old = int(m.group(2) or 1)
            n_new = int(m.group(4) or 1)
            old_l: list[str] = []
            new_l: list[str] = []
            i += 1
            while len(old_l) < n_old or len(new_l) < n_new:
                if i >= len(lines):
                    raise SystemExit("patch.py: the diff ends inside a hunk")
                line = lines[i]
                if line.startswith("\\"):
                    raise SystemExit("patch.py: '\\ No newline at end of file' is not supported")
                tag, body = (" ", "\n") if line in ("\n", "\r\n") else (line[0], line[1:])
                if tag == " ":
                    old_l.append(body)
                    new_l.append(body)
                elif tag == "-":
                    old_l.append(body)
                elif tag == "+":
                    new_l.append(body)
                else:
                    raise SystemExit(f"patch.py: unexpected line {i + 1} inside a hunk: {line!r}")
                i += 1
            files[-1][1].append((int(m.group(1)), old_l, new_l))
            continue
        i += 1
    return files


def apply(content: list[str], hunks: list[tuple[int, list[str], list[str]]], path: str) -> list[str]:
    out = list(content)
    offset = 0  # lines added minus removed by the hunks before
    floor = 0   # a hunk applies after the previous one
    for n, (start, old, new) in enumerate(hunks, 1):
        want = max(start - 1 + offset, floor) if old else start + offset  # an empty old side inserts after `start`
        candidates = sorted(range(floor, len(out) - len(old) + 1), key=lambda p: (abs(p - want), p))
        at = next((p for p in candidates if out[p:p + len(old)] == old), None)
        if at is None:
            raise SystemExit(f"patch.py: {path}: hunk #{n} does not apply (no exact match for its context)")
        if at != want:
            print(f"Hunk #{n} succeeded at {at + 1} (offset {at - want} lines).")
        out[at:at + len(old)] = new
        offset += len(new) - len(old)
        floor = at + len(new)
    return out


def main(argv: list[str]) -> int:
    strip, diff = None, None
    args = iter(argv)
    for a in args:
        if a == "-i":
            diff = next(args, None)
        elif a.startswith("-p"):
            strip = int(a[2:])
        elif a == "--fuzz":
            if next(args, None) != "0":
                raise SystemExit("patch.py: only --fuzz 0 is supported")
        elif a in ("--forward", "-N", "--batch", "-t"):
            pass
        else:
            raise SystemExit(f"patch.py: unsupported argument {a!r} (use: -pN --forward --batch --fuzz 0 -i FILE)")
    if diff is None or strip is None:
        raise SystemExit("patch.py: needs -pN and -i FILE")
    results = []
    for path, hunks in parse(read_lines(diff), strip):
        p = Path(path)
        if not p.is_file():
            raise SystemExit(f"patch.py: {path}: no such file")
        content = read_lines(p)
        print(f"patching file {path}")
        results.append((p, apply(content, hunks, path)))
    for p, lines in results:  # all hunks of all files matched: write
        p.write_bytes("".join(lines).encode("utf-8", "surrogateescape"))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
            sys.exit(1)
        raise
