"""cffi ABI-mode bindings of page-local's C API (csrc/include/llama-page.h) and the loader that
makes sure one patched libllama serves both page_local and llama_cpp."""

from .loader import LibraryMismatch, library_dir, load

__all__ = ["LibraryMismatch", "library_dir", "load"]
