"""The CPU build runs on the CPU that built it: no AMX tile code in ggml-cpu, whatever the CPU.

GGML_NATIVE compiles ggml for the build machine (-march=native); on an Intel Xeon with AMX that
would also compile ggml's AMX kernels, which crash with SIGILL. CMakeLists.txt appends -mno-amx-*
after -march=native. A machine without AMX cannot catch a regression by running the code, so these
tests read the built library and the build's own compile command instead.
"""

from __future__ import annotations

import json
import platform
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from page_local_bindings import loader

REPO = Path(__file__).resolve().parent.parent
BUILD = REPO / "build"
X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")
# every AMX instruction starts with "tile" (tileloadd, tilezero, tilestored, tilerelease) or is a
# tile dot product (tdpbssd, tdpbf16ps, tdpfp16ps, tcmmimfp16ps, ...) or (st|ld)tilecfg
AMX_MNEMONIC = re.compile(r"\t(tile[a-z0-9]+|tdp[a-z0-9]+|tcmm[a-z0-9]+|ldtilecfg|sttilecfg)\b")

pytestmark = pytest.mark.skipif(not X86, reason=f"AMX is an x86-64 extension; this is {platform.machine()}")


def _ggml_cpu_library() -> Path:
    d = loader.library_dir()
    libs = sorted(p for p in d.glob("libggml-cpu*") if p.is_file() and not p.is_symlink())
    assert libs, f"no libggml-cpu in {d}: the patched library is not built"
    return libs[0]


def test_built_ggml_cpu_has_no_amx_instructions():
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("objdump (binutils) is not installed")
    lib = _ggml_cpu_library()
    out = subprocess.run([objdump, "-d", "--no-show-raw-insn", str(lib)], capture_output=True, text=True, check=True).stdout
    assert len(out) > 100_000, "objdump printed almost nothing: the check would pass vacuously"
    found = sorted({m.group(1) for m in AMX_MNEMONIC.finditer(out)})
    assert not found, f"{lib.name} contains AMX tile instructions {found}: AMX crashes (SIGILL); see CMakeLists.txt"


def _amx_source_command() -> list[str]:
    db = BUILD / "compile_commands.json"
    if not db.is_file():
        pytest.skip(f"{db} is missing: the checkout's build tree is not configured (run make setup)")
    entries = [e for e in json.loads(db.read_text()) if e["file"].endswith("ggml-cpu/amx/mmq.cpp")]
    assert entries, "ggml-cpu/amx/mmq.cpp is not in the build: the check has nothing to look at"
    e = entries[0]
    args = e.get("arguments") or shlex.split(e["command"])
    # keep the compiler and every flag; drop the output and the compile step
    keep, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a in ("-o", "-c"):
            skip = True
            continue
        keep.append(a)
    return keep


def _amx_macros(args: list[str]) -> set[str]:
    """The __AMX_*__ macros that the compiler defines for this command line (preprocessor only)."""
    r = subprocess.run([*args, "-E", "-dM", "-x", "c++", "/dev/null"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    return set(re.findall(r"#define (__AMX_[A-Z0-9_]+__)", r.stdout))


def test_ggml_cpu_compile_defines_no_amx_even_on_an_amx_cpu():
    """The build's own command for ggml's AMX source, with -march=native replaced by an AMX CPU.

    This is what a Sapphire Rapids machine would compile; the AMX kernels are built only when
    __AMX_INT8__ is defined (ggml-cpu/amx/amx.h)."""
    args = _amx_source_command()
    if not any(a == "-march=native" for a in args):
        pytest.skip("ggml-cpu is not built with -march=native here (GGML_NATIVE off): nothing inherits AMX")
    as_sapphire = ["-march=sapphirerapids" if a == "-march=native" else a for a in args]
    assert not _amx_macros(as_sapphire), f"AMX would be compiled on an AMX CPU: {' '.join(as_sapphire)}"
    # the control: without page-local's flags the same command does define them (the check can fail)
    bare = [a for a in as_sapphire if not a.startswith("-mno-amx")]
    assert "__AMX_INT8__" in _amx_macros(bare)
