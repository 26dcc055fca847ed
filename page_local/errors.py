"""Every exception page-local raises on purpose, in one tree.

    PageLocalError
      ModelError (ValueError)            the model file is missing, not GGUF, truncated or unsupported
        ModelNotInstalled (FileNotFoundError)  a registered model whose package is not installed
    ModelInstallError (RuntimeError)   installing a registered model failed (pip, a checksum)
      ContextTooLong (ValueError)        n_ctx above the model's trained context
      ContextFull (RuntimeError)         the turn does not fit and nothing may be dropped
      EngineBusy (RuntimeError)          a second caller while a turn runs
      Cancelled (RuntimeError)           a prefill stopped by its cancel flag (a client gone, a shutdown)
      DecodeError (RuntimeError)         llama_decode failed
        RemoteLost                       an RPC server stopped answering mid-run
      PageError (RuntimeError)           a page-local native call failed (code = LLAMA_PAGE_ERR_*)
        ProbeError, UnsupportedModel, InvalidArgument (ValueError), InvalidPositions (ValueError)
      LibraryError (RuntimeError)        the patched libllama cannot be found or is another build
      ChatTemplateError (ValueError)     the model's chat template is missing or fails to render
      ChatFileError (ValueError)         a conversation file that cannot be loaded
      StateFileError (ValueError)        a KV-cache file that cannot be restored
      PeerMissing (RuntimeError)         the optional [peer] extra is not importable
      BenchError (RuntimeError)          a benchmark could not measure what it measures on this input

Each class also derives from the built-in it always was, so `except ValueError` keeps working.
Shells catch PageLocalError and print its message: every message says what was wrong and what to do.
This module imports nothing of page-local (it is the bottom layer).
"""

from __future__ import annotations


class PageLocalError(Exception):
    """The base of every error page-local raises on purpose."""


class ModelError(PageLocalError, ValueError):
    """The model file is missing, not a GGUF file, truncated, or unsupported."""


class ModelNotInstalled(ModelError, FileNotFoundError):
    """A registered model whose PyPI package is not installed (the message gives the command)."""


class ModelInstallError(PageLocalError, RuntimeError):
    """Installing a registered model failed: pip refused, a file is missing, or a checksum differs."""


class ContextTooLong(PageLocalError, ValueError):
    """n_ctx is larger than the model's trained context (and allow_long_context was not given)."""

    def __init__(self, n_ctx: int, n_ctx_train: int):
        self.n_ctx, self.n_ctx_train = n_ctx, n_ctx_train
        super().__init__(f"n_ctx {n_ctx} is larger than this model's trained context {n_ctx_train}; pass "
                         "--allow-long-context (Engine: allow_long_context=True) to run anyway")


class ContextFull(PageLocalError, RuntimeError):
    """The turn does not fit in n_ctx and nothing may be dropped (the gate kept the full cache)."""

    def __init__(self, used: int, needed: int, n_ctx: int, gate_open: bool | None = None):
        self.used, self.needed, self.n_ctx, self.gate_open = used, needed, n_ctx, gate_open
        super().__init__(
            f"the context is full: {used} cells are in use and this turn needs {needed} more, "
            f"but n_ctx is {n_ctx}. Nothing was dropped. Start a new conversation or use a larger n_ctx "
            "(n_ctx is rounded up to a multiple of 256)."
        )


class EngineBusy(PageLocalError, RuntimeError):
    """An Engine is not thread-safe: one generation at a time."""


class Cancelled(PageLocalError, RuntimeError):
    """A prefill stopped between two batches because its cancel flag was set (Engine.set_cancel): the
    conversation is left as it was before the message."""


class DecodeError(PageLocalError, RuntimeError):
    """llama_decode failed (the message has its return code and what it means)."""


class RemoteLost(DecodeError):
    """A ggml-rpc-server holding this model's layers stopped answering (killed, crashed, unreachable):
    the model cannot run on; close it and load it again. The process and its other models go on."""

    def __init__(self, endpoints):
        self.endpoints = list(endpoints)
        where = ", ".join(self.endpoints)
        super().__init__(
            f"lost the RPC server at {where} mid-run (it stopped answering: killed, crashed or unreachable); "
            "this model's layers there are gone: close the engine and load the model again once the server "
            "is back (a local engine works meanwhile)")


class PageError(PageLocalError, RuntimeError):
    """A page-local native call failed; `code` is the LLAMA_PAGE_ERR_* value."""

    def __init__(self, message: str, code: int = 0):
        super().__init__(message)
        self.code = code


class ProbeError(PageError):
    """No probe result: never armed, not decoded yet, or the armed batch was unusable."""


class UnsupportedModel(PageError):
    """The context has no KV cache page-local can work with (encoder-only, recurrent, hybrid)."""


class InvalidArgument(PageError, ValueError):
    """Bad sequence id, top-k, buffer size, ..."""


class InvalidPositions(PageError, ValueError):
    """Eviction positions that are duplicated or not in the sequence; the cache is unchanged."""


class LibraryError(PageLocalError, RuntimeError):
    """The patched libllama cannot be found or loaded, or llama_cpp uses another build."""


class ChatTemplateError(PageLocalError, ValueError):
    """The model's chat template is missing, does not parse, or fails to render a conversation."""


class ChatFileError(PageLocalError, ValueError):
    """A conversation file that cannot be loaded (missing, corrupt, wrong format)."""


class StateFileError(PageLocalError, ValueError):
    """A cache file that cannot be restored: truncated, corrupt, another model, or too large."""


class PeerMissing(PageLocalError, RuntimeError):
    """The optional [peer] extra (torch, transformers, kvpress) is not importable."""


class BenchError(PageLocalError, RuntimeError):
    """A benchmark could not measure what it measures on this input (the message says what to change)."""


class ProfileWarning(UserWarning):
    """A calibration profile exists but cannot be used (the gate falls back to the raw rule)."""
