"""The real `page-local chat` driven through a pseudo-terminal (pexpect) on the embedded SmolLM2.

On a terminal the REPL reads with prompt_toolkit (history in $PAGE_LOCAL_HOME/history) and Ctrl-C
arrives as a real SIGINT from the tty driver, which the scripted tests of test_repl.py cannot show:
a message streams an answer and the status line ("... cells ..."), /read FILE QUESTION, /stats,
/save, Ctrl-C in the middle of a long answer stops it and keeps the session, Ctrl-C at the prompt
only clears the line, /exit exits 0; a new process then /loads the saved conversation. An evicted
chat is saved with its KV cache and continues in a new process with the tokens the first one gave.

Threads 1, n_ctx 2048 and short answers keep it to a few seconds on a quiet machine; every expect
has a generous timeout because the machine running the tests may be loaded.
"""

from __future__ import annotations

import os
import signal
import re
import shutil
import sys
import time
from pathlib import Path

import pytest

pexpect = pytest.importorskip("pexpect", reason="pexpect is not installed (pip install 'pexpect>=4.8')")

if sys.platform == "win32":  # pragma: no cover
    pytest.skip("pexpect.spawn needs a POSIX pseudo-terminal", allow_module_level=True)

START_TIMEOUT = 120  # model load included, on a loaded machine
TIMEOUT = 120
ARGS = ["chat", "--threads", "1", "--n-ctx", "2048", "--max-tokens", "24"]

# prompt_toolkit turns bracketed paste on, then draws the "> " prompt (the space is a cursor
# movement on a terminal, not a character), each time it starts reading a line
PROMPT = re.compile(r"\x1b\[\?2004h[^>]*>")
ACCEPTED = "\x1b[?2004l"  # prompt_toolkit accepted the line and gave the terminal back
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Z0-9]|[\x08\r]")


def plain(s: str) -> str:
    """Terminal output without escape sequences, backspaces and carriage returns."""
    return ANSI.sub("", s)


def command() -> tuple[str, list[str]]:
    """The installed console script next to this interpreter (or on PATH), else `python -m`."""
    script = Path(sys.executable).with_name("page-local")
    if not script.exists():
        script = Path(shutil.which("page-local") or "")
    if script.is_file():
        return str(script), []
    return sys.executable, ["-m", "page_local.cli"]


class Chat:
    """One `page-local chat` process on a pty; every method waits for what it needs to see."""

    def __init__(self, home: Path, log: list[str], args: tuple[str, ...] = ()):
        env = {k: v for k, v in os.environ.items() if k != "PAGE_LOCAL_MODEL"}
        env.update(PAGE_LOCAL_HOME=str(home), TERM="xterm", COLUMNS="250", LINES="60",
                   # a pty answers no cursor-position request: without this prompt_toolkit waits
                   # for the answer, then prints "WARNING: your terminal doesn't support CPR"
                   PROMPT_TOOLKIT_NO_CPR="1", PYTHONUNBUFFERED="1")
        exe, pre = command()
        try:
            # a user's terminal starts the REPL with SIGINT at its default; a process that inherits an
            # ignored SIGINT (exec keeps SIG_IGN) never sees Ctrl-C, so the child starts as from a shell
            self.child = pexpect.spawn(exe, pre + ARGS + list(args), env=env, encoding="utf-8", codec_errors="replace",
                                       timeout=TIMEOUT, dimensions=(60, 250),
                                       preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        except (OSError, pexpect.ExceptionPexpect) as e:
            pytest.skip(f"pexpect cannot spawn a pseudo-terminal here: {e}")
        self.log = log

        class _Log:  # everything the child printed, for the failure message
            def write(_, s):
                log.append(s)

            def flush(_):
                pass

        self.child.logfile_read = _Log()
        self.banner = self.wait_prompt(START_TIMEOUT)

    def wait_prompt(self, timeout: float = TIMEOUT) -> str:
        """Wait for the next prompt; returns what was printed before it, as plain text."""
        self.child.expect(PROMPT, timeout=timeout)
        return plain(self.child.before)

    def type_line(self, line: str) -> None:
        self.child.send(line + "\r")  # Enter, as a terminal sends it
        self.child.expect_exact(ACCEPTED)

    def ask(self, line: str) -> str:
        """Type a line, wait for the next prompt; what the REPL printed in between, as plain text."""
        self.type_line(line)
        return self.wait_prompt()

    def exit(self) -> int:
        self.type_line("/exit")
        self.child.expect(pexpect.EOF)
        self.child.close()
        return self.child.exitstatus

    def kill(self) -> None:
        if self.child.isalive():
            self.child.terminate(force=True)


@pytest.fixture
def chat(smollm2_path, tmp_path):
    """start(*args) -> a Chat on a fresh process (args: more options); all of them share tmp_path as
    PAGE_LOCAL_HOME."""
    made: list[Chat] = []
    log: list[str] = []

    def start(*args: str) -> Chat:
        c = Chat(tmp_path, log, args)
        made.append(c)
        return c

    try:
        yield start
    finally:
        for c in made:
            c.kill()
        print(plain("".join(log))[-20000:])  # shown by pytest when the test failed


def status_line(out: str) -> str:
    """The line after an answer: what happened to the cache (engine/narrate.py), speed, cells, how it ended."""
    lines = [ln for ln in out.splitlines() if " cells" in ln]
    assert lines, f"no status line in {out!r}"
    line = lines[-1]
    assert re.search(r"^(evicted to \d+ of \d+|verify refused: full cache of \d+ kept|full cache kept: \d+ tokens, within the speed budget of \d+"
                     r"|full cache kept: \d+ tokens \(setting tokens aside pays from \d+\)|not verified \(.*\): full cache of \d+ kept).* · [\d.]+ tok/s · \d+/2048 cells", line), line
    return line


def cells(out: str) -> int:
    """The cells in use after the turn (fewer than before it when the turn evicted)."""
    return int(re.search(r"(\d+)/2048 cells", status_line(out)).group(1))


def kept_of(out: str) -> tuple[int, int]:
    """(K, T) of the turn's decision: the positions kept, of the T in the cache once the message was
    prefilled (K == T when nothing was evicted)."""
    line = status_line(out)
    m = re.match(r"evicted to (\d+) of (\d+)", line)
    if m:
        return int(m.group(1)), int(m.group(2))
    m = re.search(r"full cache of (\d+) kept|full cache kept: (\d+) tokens", line)
    T = int(m.group(1) or m.group(2))
    return T, T


def kept(out: str) -> int:
    return kept_of(out)[0]


def positions(out: str) -> int:
    return kept_of(out)[1]


def test_chat_through_a_pty(chat, tmp_path):
    t0 = time.monotonic()
    c = chat()
    banner = plain(c.banner)
    assert "page-local chat" in banner and "n_ctx 2048" in banner and "max-tokens 24" in banner, banner
    assert "Esc+Enter" in banner  # the terminal hint: stdin and stdout are a tty, prompt_toolkit reads
    assert "budget 0.25 (set aside from 2048 cells)" in banner, banner  # chat's default: parking (SmolLM2's park_from)

    # a message: streamed text, then the status line
    out = c.ask("What is the capital of France?")
    shown = [ln for ln in out.splitlines() if ln.strip()]
    assert len(shown) >= 2 and " cells" not in shown[0], out  # the answer, then the status line
    n1 = cells(out)

    # /read FILE QUESTION: the document goes with the question
    doc = tmp_path / "door.txt"
    doc.write_text("The secret code of the blue door is 58213.\n", encoding="utf-8")
    out = c.ask(f"/read {doc} What is the secret code of the blue door?")
    assert "(sending door.txt with your message)" in out, out
    assert positions(out) > n1 + 20  # the document and the question followed the first turn
    n2 = cells(out)

    # /stats: the last decision as a table, D among its rows
    out = c.ask("/stats")
    assert "last decision" in out
    assert re.search(r"│\s*D\s+│\s*-?\d+\.\d{4}\s*│", out), out
    assert re.search(rf"│\s*cells\s+│\s*{n2}/2048\s*│", out), out

    # /save: the conversation so far (2 turns = 4 messages)
    conv = tmp_path / "conv.json"
    out = c.ask(f"/save {conv}")
    assert f"Saved 4 messages to {conv}" in out, out
    assert conv.is_file()

    # Ctrl-C at the prompt clears the line being typed; nothing is sent
    c.child.send("this line is never sent")
    c.child.sendintr()
    out = c.wait_prompt()
    assert " cells" not in out

    # a long answer, stopped by Ctrl-C shortly after it starts streaming
    out = c.ask("/set max-tokens 400")
    assert "max-tokens 400 (from the next turn)" in out
    # (greedy SmolLM2 answers some requests by copying its last answer, 24 tokens cut by max-tokens 24,
    # and ends there, before the ^C; this one it answers at length: 400 tokens when not stopped)
    c.type_line("Now write a long essay of at least five paragraphs about the history of Paris.")
    c.child.expect(r"\w\w", timeout=TIMEOUT)  # the first streamed text
    time.sleep(0.3)
    c.child.sendintr()  # ^C from the tty driver: SIGINT to the foreground process
    out = c.wait_prompt()
    line = status_line(out)
    assert "stopped by Ctrl-C (the partial answer is kept)" in line, out
    n3 = cells(out)
    assert positions(out) > n2  # the message followed the conversation
    assert kept(out) < n3 < kept(out) + 400  # and a partial answer (fewer than max-tokens) was kept

    # the session survived: it still answers, on top of the kept conversation
    out = c.ask("Thank you. Say goodbye.")
    line = status_line(out)
    assert "Ctrl-C" not in line
    assert positions(out) > n3  # on top of the kept conversation, partial answer included

    assert c.exit() == 0
    history = (tmp_path / "history").read_text(encoding="utf-8")
    assert "What is the capital of France?" in history and "/save" in history
    assert "this line is never sent" not in history

    # a new process loads the saved conversation (the settings saved with it: max-tokens 24)
    c2 = chat()
    assert "max-tokens 24" in plain(c2.banner)
    out = c2.ask("/stats")
    assert "No turn yet" in out
    out = c2.ask(f"/load {conv}")
    assert re.search(r"Loaded 4 messages; budget 0\.25 \(set aside from 2048 cells\) · evictor snapkv-spans · gate search over "
                     r"1/4,1/2 · verify-tokens 64 · "
                     r"on-full evict · temperature 0 · max-tokens 24", out), out
    out = c2.ask("/stats")  # a re-prefill is no turn: no decision to show, the cells it holds
    assert "No turn yet" in out and "re-prefilled since" in out, out
    loaded = int(re.search(r"cells (\d+)/2048", out).group(1))
    # the 2 saved turns were re-prefilled (a replay never evicts under verify), not the later ones
    assert n1 < loaded <= n2 + 8, (n1, loaded, n2)  # + the end-of-turn tokens the template adds
    out = c2.ask("What was the secret code?")
    assert positions(out) > loaded  # on top of the loaded conversation
    assert c2.exit() == 0
    print(f"pty chat test: {time.monotonic() - t0:.1f} s")


DOC = " ".join(f"Item {i} is a {c} box on shelf {i % 7}." for i, c in
               enumerate(["red", "green", "blue", "yellow", "white", "black"] * 4))


def answer(out: str) -> tuple[str, str]:
    """(the streamed answer, what the cache went through): the turn's output without its speed."""
    line = status_line(out)
    return out[: out.index(line)].strip(), line.split(" · ")[0]


def test_an_evicted_chat_saved_and_loaded_in_a_new_process_continues_identically(chat, tmp_path):
    t0 = time.monotonic()
    doc = tmp_path / "shelves.txt"
    doc.write_text(DOC, encoding="utf-8")
    saved = tmp_path / "evicted chat.chat"  # a space: the whole rest of the line is the path
    question = "And which colour is item 9?"

    c = chat("--no-park")  # evicted for good: the cells left are what the file must carry
    for line in ("/set gate always", "/set budget 64", "/set verify-tokens 16", "/set on-full refuse"):
        c.ask(line)
    out = c.ask(f"/read {doc} Which colour is item 4?")
    assert kept_of(out)[0] == 64 < kept_of(out)[1], out  # the document evicted
    held = cells(out)
    out = c.ask(f"/save {saved}")
    assert re.search(rf"Saved 2 messages and the evicted KV cache \([\d.]+ MiB\) to {re.escape(str(saved))}", out), out
    first = answer(c.ask(question))
    assert first[1].startswith("evicted to 64 of "), first  # the continuation evicted again
    assert c.exit() == 0

    c2 = chat()  # started with the default settings: they come back from the file (park off included)
    out = c2.ask(f"/load {saved}")
    assert re.search(r"Loaded 2 messages and their KV cache \(\d+ cells, as saved\); budget 64 \(deleted for good\) · "
                     r"evictor snapkv-spans · "
                     r"gate always · verify-tokens 16 · on-full refuse · temperature 0 · max-tokens 24", out), out
    assert f"KV cache ({held} cells, as saved)" in out, (held, out)  # the cache as the first process held it
    assert answer(c2.ask(question)) == first  # the same tokens, and the same eviction on the way
    assert c2.exit() == 0
    print(f"pty evicted save/load test: {time.monotonic() - t0:.1f} s")
