"""ggml's backend registry through ctypes: the device list, device names and memory, and the registry's
proc addresses (how the RPC backend's functions are reached). runtime.py and rpc.py share it."""

from __future__ import annotations

import ctypes
import threading

from page_local.native import llama_log
from page_local.native import pageops as native

_lock = threading.Lock()
_lib = None


def lib():
    """The libllama CDLL with the ggml-backend functions used here declared (ggml's symbols resolve
    through it: libllama links libggml and libggml-base)."""
    global _lib
    with _lock:
        if _lib is not None:
            return _lib
        llama_log.install()
        cdll = native.llama_cpp().llama_cpp._lib
        vp, sz, cp = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p
        for name, res, args in (
            ("ggml_backend_dev_count", sz, []), ("ggml_backend_dev_get", vp, [sz]),
            ("ggml_backend_dev_name", cp, [vp]), ("ggml_backend_dev_description", cp, [vp]),
            ("ggml_backend_dev_type", ctypes.c_int, [vp]),
            ("ggml_backend_dev_memory", None, [vp, ctypes.POINTER(sz), ctypes.POINTER(sz)]),
            ("ggml_backend_reg_by_name", vp, [cp]), ("ggml_backend_reg_get_proc_address", vp, [vp, cp]),
            ("ggml_backend_reg_dev_count", sz, [vp]), ("ggml_backend_reg_dev_get", vp, [vp, sz]),
            ("ggml_set_abort_callback", vp, [vp]),
        ):
            fn = getattr(cdll, name)
            fn.restype, fn.argtypes = res, args
        _lib = cdll
        return cdll


def dev_label(cdll, dev) -> str:
    """'NAME (description)', or NAME when the description says nothing more."""
    name = (cdll.ggml_backend_dev_name(dev) or b"?").decode("utf-8", "replace")
    desc = (cdll.ggml_backend_dev_description(dev) or b"").decode("utf-8", "replace")
    return f"{name} ({desc})" if desc and desc != name else name


def free_memory(dev) -> int:
    """Free memory of a device in bytes (llama.cpp's split weight; its host's memory when it reports none)."""
    cdll = lib()
    free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
    cdll.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
    return int(free.value)
