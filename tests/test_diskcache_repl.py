"""The disk cache of prompt prefixes in `page-local chat` (engine/prefixes.py): a document `/read` in one chat is
restored in the next chat on the same folder (a new Engine, as after a restart), and the status line and `/why`
say so; the click command's --kv-cache-dir and --no-kv-cache reach the engine. The real SmolLM2 engine."""

from __future__ import annotations

import io

import pytest
from click.testing import CliRunner
from rich.console import Console

from page_local.cli.chat import chat_cmd
from page_local.cli.repl import Repl
from page_local.engine import Engine
from page_local.store.diskcache import DiskCache

pytestmark = pytest.mark.slow

DOC = open("/usr/share/common-licenses/GPL-3", encoding="utf-8").read()[:7000]  # ~1.5K SmolLM2 tokens


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGE_LOCAL_HOME", str(tmp_path / "home"))  # no user profile or history leaks in


@pytest.fixture
def doc(tmp_path):
    path = tmp_path / "gpl.txt"
    path.write_text(DOC, encoding="utf-8")
    return path


def chat_once(model_path, folder, line: str) -> tuple[Repl, str]:
    """One chat on a new Engine over the disk cache in `folder`: `line`, then /why; (repl, transcript)."""
    console = Console(file=io.StringIO(), width=1000, color_system=None, force_terminal=False)
    with Engine(model_path, n_ctx=4096, threads=1, disk_cache=DiskCache(folder, max_bytes=1 << 30)) as eng:
        repl = Repl(eng, console, max_tokens=8)
        assert repl.handle(line) is True
        status = console.file.getvalue().strip().splitlines()[-1]
        repl.handle("/why")
    return repl, status + "\n" + console.file.getvalue()


def test_a_document_read_in_one_chat_comes_from_disk_in_the_next(smollm2_path, tmp_path, doc):
    first, out = chat_once(smollm2_path, tmp_path / "kv", f"/read {doc} What is this license called?")
    assert first.decision.disk_tokens == 0 and "from the disk cache" not in out
    again, out = chat_once(smollm2_path, tmp_path / "kv", f"/read {doc} Who published it?")
    n = again.decision.disk_tokens
    status = out.splitlines()[0]
    assert n >= 1000 and f"{n:,} tokens from the disk cache in ".replace(",", " ") in status
    assert f"The first {n} tokens of your message were not read" in out  # /why tells it too


def test_the_chat_command_keeps_its_disk_cache_where_told(smollm2_path, tmp_path, doc):
    def chat(*flags):
        res = CliRunner().invoke(chat_cmd, ["--model", str(smollm2_path), "--n-ctx", "4096", "--threads", "1",
                                            "--max-tokens", "4", *flags],
                                 input=f"/read {doc} What is this license called?\n/exit\n")
        assert res.exit_code == 0, res.output
        return res.output

    off = tmp_path / "off"
    assert "from the disk cache" not in chat("--no-kv-cache", "--kv-cache-dir", str(off))
    assert not off.exists()  # --no-kv-cache writes nothing
    kv = tmp_path / "kv"
    assert "from the disk cache" not in chat("--kv-cache-dir", str(kv))
    assert list(kv.rglob("*.pglc"))  # the read document is kept there
    assert "tokens from the disk cache in " in chat("--kv-cache-dir", str(kv))
