"""The user directory and atomic file writing: where page-local keeps what it writes for a user.

<home> is $PAGE_LOCAL_HOME if set (read at call time, so tests can isolate it), else
platformdirs.user_data_dir("page-local"): profiles/, models/ (assembled or derived GGUF files),
history (the REPL's).
"""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterator


def page_local_home() -> Path:
    """$PAGE_LOCAL_HOME if set, else the per-user data directory of page-local."""
    env = os.environ.get("PAGE_LOCAL_HOME")
    if env:
        return Path(env).expanduser()
    import platformdirs  # imported on first use (nothing runs at import time)

    return Path(platformdirs.user_data_dir("page-local"))


@contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w", fsync: bool = False) -> Iterator[IO]:
    """Write `path` through a temp file in the same folder renamed over it on success: readers see the
    old file or the new one, never half of one; on any error the temp file is removed and `path` is
    unchanged. mode "w" (text, UTF-8) or "wb"."""
    if mode not in ("w", "wb"):
        raise ValueError(f"mode must be 'w' or 'wb', got {mode!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode, **({"encoding": "utf-8"} if mode == "w" else {})) as f:
            yield f
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
