"""llama.cpp's log output, routed to Python's `logging` (logger "page_local.llama").

llama.cpp (and ggml) have one process-wide log callback. `install()` points it at `_Bridge`, once,
on first model load (runtime.Model) or device query (nothing happens at import time). The bridge:
* maps ggml's levels to logging's (NONE and INFO -> INFO, DEBUG -> DEBUG, WARN -> WARNING,
  ERROR -> ERROR; CONT continues the previous message at its level);
* joins the fragments llama.cpp prints (a message may come in pieces, e.g. the loader's progress
  dots) and emits one record per complete line, per thread;
* drops records the logger would not emit anyway before any formatting.

So without any logging configuration, Python's last-resort handler shows llama.cpp's warnings and
errors on stderr and nothing else; an application embedding the engine configures "page_local.llama"
like any other logger. PAGE_LOCAL_VERBOSE=1 sets the logger to DEBUG (every llama.cpp line) and, if
no handler would print them, adds one on stderr.

While a model or a context is being created (`held()`), warnings and errors from that thread are
held back until it is done: the caller can quote them in its exception (runtime.ModelError), and then
they are emitted with `record.page_local_reported = True`, which the CLI's handler skips (the
one-line error already says it).
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import sys
import threading
from contextlib import contextmanager

LOGGER_NAME = "page_local.llama"
logger = logging.getLogger(LOGGER_NAME)

# enum ggml_log_level (ggml.h)
GGML_LOG_LEVEL_NONE, GGML_LOG_LEVEL_DEBUG, GGML_LOG_LEVEL_INFO = 0, 1, 2
GGML_LOG_LEVEL_WARN, GGML_LOG_LEVEL_ERROR, GGML_LOG_LEVEL_CONT = 3, 4, 5
LEVELS = {GGML_LOG_LEVEL_NONE: logging.INFO, GGML_LOG_LEVEL_DEBUG: logging.DEBUG, GGML_LOG_LEVEL_INFO: logging.INFO,
          GGML_LOG_LEVEL_WARN: logging.WARNING, GGML_LOG_LEVEL_ERROR: logging.ERROR}

_install_lock = threading.Lock()
_bridge: _Bridge | None = None
_c_callback = None  # the ctypes callback object llama.cpp holds a pointer to: kept alive for the process


def verbose() -> bool:
    return bool(os.environ.get("PAGE_LOCAL_VERBOSE"))


class _Bridge:
    """The callable behind the ctypes callback: (ggml level, bytes, user data) -> logging records."""

    def __init__(self) -> None:
        self._local = threading.local()  # per thread: .level, .parts (the unfinished line), .held
        self.closed = False

    def _state(self):
        s = self._local
        if not hasattr(s, "parts"):
            s.level, s.parts, s.held = logging.INFO, [], None
        return s

    def __call__(self, level: int, text: bytes | None, _user) -> None:
        if self.closed:  # interpreter shutdown: do nothing
            return
        try:
            self.feed(int(level), (text or b"").decode("utf-8", "replace"))
        except Exception:  # noqa: BLE001  (an exception must never cross back into C)
            pass

    def feed(self, level: int, text: str) -> None:
        s = self._state()
        if level != GGML_LOG_LEVEL_CONT:
            if s.parts:  # a new message starts: the previous one ended without a newline
                self._emit(s, "".join(s.parts))
                s.parts = []
            s.level = LEVELS.get(level, logging.INFO)
        if not self._wanted(s, s.level):
            return
        if "\n" not in text:
            s.parts.append(text)
            return
        lines = ("".join(s.parts) + text).split("\n")
        s.parts = [lines.pop()] if lines[-1] else []
        for line in lines:
            self._emit(s, line)

    @staticmethod
    def _wanted(s, level: int) -> bool:
        return (s.held is not None and level >= logging.WARNING) or logger.isEnabledFor(level)

    def _emit(self, s, line: str) -> None:
        line = line.rstrip()
        if not line.strip(" ."):  # blank, or only the loader's progress dots
            return
        if s.held is not None and s.level >= logging.WARNING:
            s.held.append((s.level, line))
        elif logger.isEnabledFor(s.level):
            logger.log(s.level, line)

    @contextmanager
    def held(self):
        """Hold back this thread's warnings and errors; yields the list of (level, line) held."""
        s = self._state()
        outer, s.held = s.held, []
        mine = s.held
        reported = [False]
        try:
            yield _Held(mine, reported)
        finally:
            if s.parts:
                self._emit(s, "".join(s.parts))
                s.parts = []
            s.held = outer
            for level, line in mine:
                if outer is not None:
                    outer.append((level, line))
                else:
                    logger.log(level, line, extra={"page_local_reported": reported[0]})


class _Held:
    """What held() yields: the held (level, line) pairs and a way to say they went into an exception."""

    def __init__(self, lines: list, reported: list):
        self.lines, self._reported = lines, reported

    def errors(self) -> list[str]:
        return [line for level, line in self.lines if level >= logging.ERROR]

    def reason(self) -> str | None:
        """The first llama.cpp error line, for an exception message (None when there is none)."""
        errors = self.errors()
        return errors[0] if errors else None

    def mark_reported(self) -> None:
        """The held lines are quoted in an exception: emit them flagged page_local_reported."""
        self._reported[0] = True


def install() -> None:
    """Route llama.cpp's log to the "page_local.llama" logger (idempotent; first call wins)."""
    global _bridge, _c_callback
    if _bridge is not None:
        return
    with _install_lock:
        if _bridge is not None:
            return
        from page_local.native import pageops as native

        lc = native.llama_cpp()
        bridge = _Bridge()
        cb = lc.llama_log_callback(bridge)
        lc.llama_log_set(cb, ctypes.c_void_p(0))
        _c_callback = cb
        atexit.register(_close, bridge)
        if verbose():
            logger.setLevel(logging.DEBUG)
            if not logger.hasHandlers():
                h = logging.StreamHandler(sys.stderr)
                h.setFormatter(logging.Formatter("llama.cpp: %(message)s"))
                logger.addHandler(h)
        _bridge = bridge


def _close(bridge: _Bridge) -> None:
    bridge.closed = True


@contextmanager
def held():
    """install(), then hold this thread's llama.cpp warnings and errors (see the module docstring)."""
    install()
    with _bridge.held() as h:
        yield h
