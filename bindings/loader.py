"""Load the one patched libllama for both page_local (through cffi) and llama_cpp (ctypes).

llama_cpp binds every symbol of the library it finds at import time, from the folder named by
LLAMA_CPP_LIB_PATH (read once, on first import). page_local points that variable at the patched
build before llama_cpp is imported and dlopens the very same file, so one library is in the
process. If llama_cpp was already imported with another library, loading fails with a clear
message instead of running two llama.cpp copies side by side.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
from pathlib import Path
from types import ModuleType

from .cdef import CDEF, TYPES

_LIB_NAME = {"darwin": "libllama.dylib", "win32": "llama.dll"}.get(sys.platform, "libllama.so")
_lock = threading.Lock()
_loaded: tuple | None = None


class LibraryMismatch(RuntimeError):
    """llama_cpp is using a libllama other than page-local's patched build."""


def candidate_dirs() -> list[Path]:
    """Where the patched libllama may be, in the order they are tried.

    $PAGE_LOCAL_LIB_DIR (then nothing else); a checkout's own build (<repo>/build/bin, for code run
    from the checkout without an install); the lib/ folder of the installed llama_cpp package, where
    `pip install .` (and `make setup`, an editable install) put the libraries, so that llama_cpp
    finds the same file by default. llama_cpp is located without being imported.
    """
    env = os.environ.get("PAGE_LOCAL_LIB_DIR")
    if env:
        return [Path(env).expanduser().resolve()]
    here = Path(__file__).resolve().parent
    dirs = []
    if (here.parent / "csrc").is_dir():  # bindings/ of a checkout, not an installed copy
        dirs.append(here.parent / "build" / "bin")
    try:
        spec = importlib.util.find_spec("llama_cpp")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.origin:
        dirs.append(Path(spec.origin).resolve().parent / "lib")
    return dirs or [here.parent / "build" / "bin"]


def library_dir() -> Path:
    """The first candidate folder that holds the library (the first candidate if none does)."""
    dirs = candidate_dirs()
    for d in dirs:
        if (d / _LIB_NAME).is_file():
            return d
    return dirs[0]


def _same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def load() -> tuple:
    """Return (ffi, lib, llama_cpp) bound to the patched library; load it on first call."""
    global _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        path = library_dir() / _LIB_NAME
        if not path.is_file():
            raise FileNotFoundError(
                f"page-local's patched llama.cpp library ({_LIB_NAME}) is missing; looked in "
                + ", ".join(str(d) for d in candidate_dirs())
                + ". Install page-local with `pip install .` or `make setup` in its checkout "
                "(or set PAGE_LOCAL_LIB_DIR to the folder holding it)."
            )
        llama_cpp = _import_llama_cpp(path)

        import cffi

        ffi = cffi.FFI()
        ffi.cdef(TYPES + CDEF)
        lib = ffi.dlopen(str(path))
        try:
            lib.llama_page_last_error
        except AttributeError as e:  # an unpatched build of the same upstream
            raise LibraryMismatch(f"{path} has no llama_page_* functions: it is not page-local's patched build") from e
        llama_cpp.llama_backend_init()
        _loaded = (ffi, lib, llama_cpp)
        return _loaded


def _import_llama_cpp(path: Path) -> ModuleType:
    mod = sys.modules.get("llama_cpp.llama_cpp")
    if mod is None:
        os.environ["LLAMA_CPP_LIB_PATH"] = str(path.parent)
        import llama_cpp.llama_cpp as mod  # noqa: PLC0415  (deliberately late: reads the variable above)
    loaded = getattr(getattr(mod, "_lib", None), "_name", None)
    if loaded is None or not _same_file(loaded, path):
        raise LibraryMismatch(
            f"llama_cpp was already imported with {loaded}, not page-local's patched library {path}. "
            "Import page_local (or call page_local.native.pageops.load()) before llama_cpp, or set "
            f"LLAMA_CPP_LIB_PATH={path.parent} before starting Python."
        )
    import llama_cpp  # noqa: PLC0415

    return llama_cpp
