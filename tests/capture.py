"""Copies of named tensors of llama.cpp's graph, taken through the cb_eval callback (tests only)."""

from __future__ import annotations

import ctypes

import numpy as np

from page_local.native import pageops as native


class _Tensor(ctypes.Structure):  # the stable head of struct ggml_tensor (ggml.h)
    _fields_ = [("type", ctypes.c_int32), ("buffer", ctypes.c_void_p),
                ("ne", ctypes.c_int64 * 4), ("nb", ctypes.c_size_t * 4)]


def tensor_capture(prefix: str, dims: int):
    """A cb_eval callback copying every f32 tensor named `<prefix><il>` while `armed[0]` is True
    (it starts True). Returns (callback, captured, armed); captured[il] is the tensor in numpy order
    (ggml's ne reversed) with its last `dims` dimensions kept."""
    lc = native.llama_cpp()
    ggml = ctypes.CDLL(str(native.load()[2].llama_cpp._base_path / "libggml-base.so"))
    ggml.ggml_get_name.restype = ctypes.c_char_p
    ggml.ggml_get_name.argtypes = [ctypes.c_void_p]
    ggml.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    captured: dict[int, np.ndarray] = {}
    armed = [True]

    def cb(t, ask, _user):
        name = ggml.ggml_get_name(t).decode()
        if not name.startswith(prefix):
            return not ask  # ask: "do you want this one?"; otherwise keep computing
        if not ask and armed[0]:
            ten = ctypes.cast(t, ctypes.POINTER(_Tensor)).contents
            shape = tuple(int(x) for x in ten.ne)[::-1]
            out = np.empty(shape, dtype=np.float32)
            ggml.ggml_backend_tensor_get(t, out.ctypes.data, 0, out.nbytes)
            captured[int(name[len(prefix):])] = out.reshape(shape[-dims:])
        return True

    return lc.ggml_backend_sched_eval_callback(cb), captured, armed
