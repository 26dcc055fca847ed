"""The cffi declarations (bindings/cdef.py) must mirror the C header (csrc/include/llama-page.h)."""

from __future__ import annotations

import re
from pathlib import Path

from page_local_bindings.cdef import CDEF

HEADER = Path(__file__).resolve().parent.parent / "csrc" / "include" / "llama-page.h"


def _normalize(decl: str) -> str:
    decl = re.sub(r"\s+", " ", decl).strip()
    decl = re.sub(r"\s*([(),*;{}=])\s*", r"\1", decl)
    return decl


def _declarations(text: str) -> set[str]:
    text = re.sub(r"//[^\n]*", "", text)
    text = text.replace("LLAMA_API ", "")
    funcs = re.findall(r"^[ \t]*(?:const )?[a-z_0-9]+ \**\s*llama_page_\w+\s*\([^;]*\);", text, flags=re.M)
    blocks = re.findall(r"(?:enum|struct) llama_page_\w+ \{[^}]*\};", text, flags=re.S)
    return {_normalize(d) for d in funcs + blocks}


def test_cdef_mirrors_header():
    header = _declarations(HEADER.read_text())
    cdef = _declarations(CDEF)
    assert len(header) >= 14, "the header parser found too few declarations"
    assert header - cdef == set(), f"declared in the header but not in bindings/cdef.py: {header - cdef}"
    assert cdef - header == set(), f"declared in bindings/cdef.py but not in the header: {cdef - header}"


def test_every_declared_function_is_exported():
    from page_local.native.pageops import load

    ffi, lib, _ = load()
    for name in re.findall(r"(llama_page_\w+)\s*\(", CDEF):
        assert hasattr(lib, name), name
