"""`page-local chat`: the Repl driven by scripted lines, asserting on the transcript and the conversation.

Most tests run on tests/fakes.py (no model: queued answers and Decisions), so they pin the REPL's
own behaviour: what each command prints, that the status line tells what happened to the cache
(engine/narrate.py), that errors leave the conversation usable. A few end-to-end tests run the real
SmolLM2 engine and ChatSession (small n_ctx, max_tokens 8): a turn, eviction, self-verification,
save/load, a cut prefill, Ctrl-C, and the click command on piped stdin."""

from __future__ import annotations

import dataclasses
import errno
import io
import json
import os
import re

import pytest
from click.testing import CliRunner
from rich.console import Console

from page_local.chat.session import SAVE_FORMAT, ChatSession
from page_local.engine import narrate
from page_local.cli import repl_commands
from page_local.cli.chat import chat_cmd
from page_local.cli.repl import Repl, run_loop
from page_local.errors import ContextFull, DecodeError
from page_local.store import home, persist
from tests.fakes import TOK_S, FakeChat, FakeEngine, decision

LONG = " ".join(f"Item {i} is a {c} box on shelf {i % 7}." for i, c in
                enumerate(["red", "green", "blue", "yellow", "white", "black"] * 3))


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGE_LOCAL_HOME", str(tmp_path / "home"))  # no user profile or history leaks in


def _console(file=None) -> Console:
    return Console(file=file or io.StringIO(), width=1000, color_system=None, force_terminal=False)


@pytest.fixture
def fake():
    """fake(**Repl kwargs) -> (repl, engine, out) on a FakeEngine; out() returns the transcript so far."""
    def make(console=None, **kw):
        eng = FakeEngine()
        kw.setdefault("max_tokens", 8)
        repl = Repl(eng, console or _console(), session=FakeChat(eng), **kw)
        return repl, eng, lambda: repl.console.file.getvalue()

    return make


def last_line(out: str) -> str:
    return out.strip().splitlines()[-1]


# --- the REPL on the fake engine -----------------------------------------------------------------

def test_answer_streams_then_the_status_line(fake):
    repl, eng, out = fake()
    eng.enqueue([" Paris", "."], decision(T=40, B=1024, open=True, gate_mode="verify", rule="forced", verify_m=0))
    assert repl.handle("What is the capital of France?") is True
    assert [(m.role, m.content) for m in repl.session.messages] == [
        ("user", "What is the capital of France?"), ("assistant", " Paris.")]
    assert out().startswith(" Paris.\n")
    assert last_line(out()) == f"full cache kept: 40 tokens, within the speed budget of 1024 · {TOK_S:.1f} tok/s · 42/2048 cells"


def test_read_essay_refused_by_verify_says_so(fake, tmp_path):
    """The bug narrate.py fixed: after /read of a long essay, self-verification refused the eviction
    and the status line said 'gate open (D 0.1109, verify) kept 1897/1897'."""
    repl, eng, out = fake()
    essay = tmp_path / "essay.txt"
    essay.write_text("An essay. " * 950, encoding="utf-8")
    refused = decision(T=1897, B=474, kept=1897, D=0.1109, open=True, gate_mode="verify", rule="forced",
                       verify_m=8, verify_until="length", verify_rule="argmax", verify_score=3.0,
                       verify_threshold=0.0)
    eng.enqueue(["It", " is", " about", " essays", ".", " It", " is", " short"], refused, finish="length")
    repl.handle(f"/read {essay} Summarise it.")
    assert "(sending essay.txt with your message)" in out()
    status = last_line(out())
    assert status.startswith("verify refused: full cache of 1897 kept (3 changed top tokens > 0 over 8 tokens) · ")
    assert status.endswith(" · 1905/2048 cells · stopped at max-tokens 8")
    assert "gate open" not in out()
    repl.handle("/why")
    assert "so the full cache was kept. All 1897 positions were kept" in out()


@pytest.mark.parametrize("finish, tail", [("length", "stopped at max-tokens 8"),
                                          ("context", "stopped: the context is full (/clear, or a larger --n-ctx)")],
                         ids=["max-tokens", "context"])
def test_status_says_how_the_answer_ended(fake, finish, tail):
    repl, eng, out = fake()
    eng.enqueue(["a"] * 8, decision(T=30), finish=finish)
    repl.handle("Hi.")
    assert last_line(out()) == (f"gate closed (D 0.0500 < 0.07): full cache of 30 kept · {TOK_S:.1f} tok/s · "
                                f"38/2048 cells · {tail}")


@pytest.mark.parametrize("key,value", [
    ("budget", "2"), ("budget", "1.5"), ("budget", "lots"), ("evictor", "nope"), ("gate", "sometimes"),
    ("verify-tokens", "0"), ("verify-tokens", "300"), ("verify-tokens", "many"), ("on-full", "shrug"),
    ("temperature", "9"), ("temperature", "hot"), ("max-tokens", "0"), ("colour", "red"), ("park", "maybe"),
], ids=["budget-too-small", "budget-ratio>1", "budget-text", "evictor", "gate", "verify-tokens-0",
        "verify-tokens-300", "verify-tokens-text", "on-full", "temperature", "temperature-text", "max-tokens",
        "unknown-key", "park"])
def test_set_invalid_changes_nothing(fake, key, value):
    repl, _, out = fake()
    before = repl.settings()
    repl.handle(f"/set {key} {value}")
    assert "nothing changed" in out()
    assert repl.settings() == before


def test_set_valid_values(fake):
    repl, eng, out = fake()
    eng.set_verify(64, threshold=0.5, rule="argmax")
    for line in ("/set budget 1024", "/set budget 0.5", "/set evictor streamingllm", "/set gate page+verify",
                 "/set verify-tokens 16", "/set on-full refuse", "/set temperature 0.7", "/set max-tokens 4"):
        repl.handle(line)
    assert repl.settings() == {"budget": 0.5, "park": False, "evictor": "streamingllm", "gate": "page+verify",
                               "verify_tokens": 16, "on_full": "refuse", "temperature": 0.7, "max_tokens": 4}
    assert (eng.verify_tokens, eng.verify_threshold, eng.verify_rule) == (16, 0.5, "argmax")  # only the count
    assert "nothing changed" not in out()
    assert last_line(out()) == ("budget 0.5 (deleted for good) · evictor streamingllm · gate page+verify · verify-tokens 16 · "
                                "on-full refuse · temperature 0.7 · max-tokens 4 (from the next turn)")
    eng.enqueue(["x"] * 6)
    repl.handle("Go.")
    assert repl.result.finish_reason == "length" and len(repl.result.tokens) == 4  # max-tokens reached the turn


def test_stats_and_why(fake):
    repl, eng, out = fake()
    repl.handle("/stats")
    repl.handle("/why")
    assert out().count("No turn yet") == 2
    d = decision(T=240, B=60, kept=60, evicted=True, open=True, gate_mode="always", rule="forced",
                 agreement=[0.9, 0.5, 0.25], prefill_ms=12.5)
    eng.enqueue([" Blue", "."], d)
    repl.handle(LONG + " Which colour is item 4?")
    repl.handle("/stats")
    text = out()
    assert "last decision" in text and "evicted to 60 of 240 (gate always, unchecked)" in text
    for field, value in (("outcome", "evicted to 60"), ("D", "0.0500"), ("prefill_ms", "12.50"),
                         ("agreement", "0.90 0.50 0.25"), ("tokens/s", "50.0"), ("cells", "62/2048"),
                         ("reason", "(fake)")):
        assert re.search(rf"│ {re.escape(field)} +│ {re.escape(value)}", text), field
    assert "verify_m" not in text  # self-verification did not run: its rows are left out
    for cmd in ("/why", "/gate"):
        before = len(out())
        repl.handle(cmd)
        assert " ".join(out()[before:].split()) == " ".join(narrate.why(d).split())


def test_save_clear_load_roundtrip(fake, tmp_path):
    repl, eng, out = fake()
    repl.handle("/system You are terse.")
    eng.enqueue([" Red."])
    repl.handle("Name a colour.")
    for line in ("/set budget 0.5", "/set gate never", "/set verify-tokens 16", "/set on-full refuse"):
        repl.handle(line)
    saved = [(m.role, m.content) for m in repl.session.messages]
    f = tmp_path / "conv" / "c.json"
    repl.handle(f"/save {f}")
    assert f"Saved 2 messages to {f}" in out()
    assert json.loads(f.read_text())["settings"] == repl.settings()
    repl.handle("/clear")
    for line in ("/set budget 0.25", "/set gate page", "/set verify-tokens 64", "/set on-full evict"):
        repl.handle(line)
    repl.session.system = None
    assert repl.session.messages == [] and repl.decision is None
    repl.handle(f"/load {f}")
    assert last_line(out()) == ("Loaded 2 messages; budget 0.5 (deleted for good) · evictor snapkv · gate never · verify-tokens 16 · "
                                "on-full refuse · temperature 0 · max-tokens 8")
    assert [(m.role, m.content) for m in repl.session.messages] == saved
    assert repl.session.system == "You are terse."
    assert repl.session.replays[-1] == repl.session.messages  # the loaded conversation was re-prefilled
    repl.handle("/stats")
    assert "No turn yet" in out() and "re-prefilled since" in out()
    eng.enqueue([" Green."])
    repl.handle("And another?")
    assert len(repl.session.messages) == 4


def _cache_file(path, model_id="fake-model", messages=(), settings=None):
    """A cache file as ChatSession.save writes one (an empty llama.cpp state: the fake holds none)."""
    snap = persist.Snapshot(model_id, 2048, (), (0, 1, 2), b"")
    extra = {"format": SAVE_FORMAT, "system": None, "messages": list(messages), "settings": settings or {}}
    return persist.save(snap, path, extra)


def _truncated_cache(tmp_path):
    blob = _cache_file(tmp_path / "whole.chat").read_bytes()
    (tmp_path / "cut.chat").write_bytes(blob[: len(blob) // 2])
    return tmp_path / "cut.chat", "truncated or corrupt"


def _corrupt_cache(tmp_path):
    blob = bytearray(_cache_file(tmp_path / "whole.chat").read_bytes())
    blob[20] ^= 0xFF  # one flipped bit in the header: the checksum no longer matches
    (tmp_path / "bad.chat").write_bytes(bytes(blob))
    return tmp_path / "bad.chat", "checksum mismatch"


def _written(name, content):
    def make(tmp_path):
        path = tmp_path / name
        (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
        return path, "is not a page-local conversation file"
    return make


BAD_FILES = {
    "corrupt-json": _written("bad.json", "{not json"),
    "foreign-json": _written("other.json", json.dumps({"format": "other"})),
    "foreign-binary": _written("photo.png", b"\x89PNG\r\n\x1a\n" + bytes(range(256))),
    "truncated-cache": _truncated_cache,
    "corrupt-cache": _corrupt_cache,
    "bad-settings": lambda tmp: (_written("s.json", json.dumps({"format": "page-local-chat", "messages": [],
                                                               "settings": {"budget": 7}}))(tmp)[0], "bad settings"),
    "another-model": lambda tmp: (_cache_file(tmp / "other.chat", "other-model", settings={"gate": "never"}),
                                  "saved with another model"),
    "folder": lambda tmp: (tmp, "is a folder, not a file written by /save"),
    "missing": lambda tmp: (tmp / "missing.json", "no such conversation file"),
}


@pytest.mark.parametrize("make", BAD_FILES.values(), ids=BAD_FILES.keys())
def test_load_bad_file_is_one_line_and_keeps_conversation(fake, tmp_path, make):
    repl, eng, out = fake()
    eng.enqueue([" Hello."])
    repl.handle("Hi there.")
    before = (list(repl.session.messages), repl.settings(), eng.cells_used())
    path, why = make(tmp_path)
    n = len(out())
    repl.handle(f"/load {path}")
    said = out()[n:]
    assert said.count("\n") == 1 and said.startswith("could not load") and why in said, said
    assert said.rstrip().endswith("; the current conversation is unchanged"), said
    assert (list(repl.session.messages), repl.settings(), eng.cells_used()) == before
    assert repl.session.replays == [] and repl.decision is not None  # nothing re-prefilled; /why still applies
    eng.enqueue([" Bye."])
    repl.handle("Thanks.")  # the REPL goes on
    assert len(repl.session.messages) == 4


def test_paths_with_spaces(fake, tmp_path):
    repl, eng, out = fake()
    eng.enqueue([" Red."])
    repl.handle("Name a colour.")
    repl.handle(f"/save {tmp_path}/my chat.json")  # the whole rest of the line is the path
    assert f"Saved 2 messages to {tmp_path}/my chat.json" in out()
    repl.handle(f'/save "{tmp_path}/our chat.json"')  # or a quoted one
    repl.handle(f"/save '{tmp_path}/their chat.json'")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my chat.json", "our chat.json", "their chat.json"]
    for line in (f"/load {tmp_path}/my chat.json", f'/load "{tmp_path}/our chat.json"'):
        repl.handle("/clear")
        repl.handle(line)
        assert last_line(out()).startswith("Loaded 2 messages; ")
        assert [m.content for m in repl.session.messages] == ["Name a colour.", " Red."]


def test_an_evicted_chat_is_saved_with_its_cache_and_loaded_as_saved(fake, tmp_path):
    repl, eng, out = fake()
    repl.handle("/set gate always")
    repl.handle("/set verify-tokens 16")
    eng.enqueue([" Blue", "."], decision(T=240, kept=60, evicted=True, open=True, gate_mode="always"))
    repl.handle(LONG + " Which colour is item 2?")
    f = tmp_path / "evicted chat.chat"
    repl.handle(f"/save {f}")
    assert re.fullmatch(rf"Saved 2 messages and the evicted KV cache \(\d+\.\d MiB\) to {re.escape(str(f))}; "
                        r"/load continues it with identical tokens", last_line(out())), last_line(out())
    assert persist.is_state_file(f) and ChatSession.read(f)["cache"] is True
    repl.handle("/clear")
    repl.handle("/set gate page")
    repl.handle("/set verify-tokens 64")
    repl.handle(f"/load {f}")
    assert last_line(out()) == ("Loaded 2 messages and their KV cache (62 cells, as saved); budget 0.25 (deleted for good) · evictor "
                                "snapkv · gate always · verify-tokens 16 · on-full evict · temperature 0 · "
                                "max-tokens 8")
    assert repl.session.replays == [] and eng.cells_used() == 62  # restored, not re-prefilled
    repl.handle("/why")
    assert "No turn yet" in out() and "restored from a cache file since" in out()


def _read_only_folder(tmp_path, monkeypatch, session):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    if os.access(ro, os.W_OK):  # root writes anyway: raise what the OS raises for everyone else
        def refuse(*a, **kw):
            raise PermissionError(errno.EACCES, "Permission denied", str(ro))
        monkeypatch.setattr(home.tempfile, "mkstemp", refuse)
    return ro / "c.json", "Permission denied"


def _under_a_file(tmp_path, monkeypatch, session):
    (tmp_path / "notes.txt").write_text("x")
    return tmp_path / "notes.txt" / "c.json", f"{tmp_path / 'notes.txt'} is a file, not a folder"


def _native_failure(exc):
    def make(tmp_path, monkeypatch, session):
        def save(path, settings=None):
            raise exc
        monkeypatch.setattr(session, "save", save)
        return tmp_path / "c.chat", " ".join(str(exc).split())
    return make


SAVE_FAILURES = {
    "folder": lambda tmp, mp, session: (tmp, "it is a folder (/save takes a file name)"),
    "read-only-folder": _read_only_folder,
    "under-a-file": _under_a_file,
    "decode-error": _native_failure(DecodeError("could not save the sequence state")),
    "runtime-error": _native_failure(RuntimeError("llama_state_seq_get_data:\nout of memory")),
}


@pytest.mark.parametrize("make", SAVE_FAILURES.values(), ids=SAVE_FAILURES.keys())
def test_a_failed_save_is_one_line_and_keeps_conversation(fake, tmp_path, monkeypatch, make):
    repl, eng, out = fake()
    eng.enqueue([" Hello."])
    repl.handle("Hi there.")
    path, why = make(tmp_path, monkeypatch, repl.session)
    before = (list(repl.session.messages), repl.settings(), eng.cells_used())
    files = sorted(tmp_path.rglob("*"))
    n = len(out())
    repl.handle(f"/save {path}")
    said = out()[n:]
    assert said.count("\n") == 1 and said.startswith("could not save") and why in said, said
    assert said.rstrip().endswith("the conversation is kept"), said
    assert sorted(tmp_path.rglob("*")) == files  # no file, no temp file left behind
    assert (list(repl.session.messages), repl.settings(), eng.cells_used()) == before
    eng.enqueue([" Bye."])
    repl.handle("Thanks.")  # the REPL goes on
    assert len(repl.session.messages) == 4


def test_read_puts_document_into_next_message(fake, tmp_path):
    repl, eng, out = fake()
    doc = tmp_path / "notes.txt"
    doc.write_text("The launch code is 4471.\n")
    repl.handle(f"/read {doc}")
    assert repl.session.messages == [] and repl.pending_doc is not None and "Read notes.txt" in out()
    eng.enqueue([" 4471."])
    repl.handle("What is the launch code?")
    assert eng.prompts[-1] == "The launch code is 4471.\n\nWhat is the launch code?"  # the question last
    assert repl.pending_doc is None
    eng.enqueue([" 4471."])
    repl.handle(f'/read "{doc}" Repeat the code.')  # the rest of the line is the question
    assert eng.prompts[-1].startswith("The launch code is 4471.") and eng.prompts[-1].endswith("Repeat the code.")


def test_read_bad_files(fake, tmp_path):
    repl, _, out = fake()
    repl.handle(f"/read {tmp_path / 'missing.txt'}")
    assert "no such file" in out()
    binary = tmp_path / "blob.bin"
    binary.write_bytes(b"\x00\x01\x02\xff" * 10)
    repl.handle(f"/read {binary}")
    assert "not a UTF-8 text file" in out()
    repl.handle(f"/read {tmp_path}")
    assert "cannot read" in out()
    (tmp_path / "empty.txt").write_text("  \n")
    repl.handle(f"/read {tmp_path / 'empty.txt'}")
    assert "is empty" in out()
    assert repl.pending_doc is None and repl.session.messages == []


def test_context_full_advice_and_session_continues(fake):
    repl, eng, out = fake()  # on-full evict: room was made, and what may not be evicted is too large
    eng.enqueue(ContextFull(0, 5000, 2048))
    repl.handle(LONG * 20)
    assert "does not fit" in out() and "Even with earlier turns evicted it does not fit" in out()
    assert "(now 2048)" in out() and "on-full" not in out()
    repl.handle("/set on-full refuse")
    eng.enqueue(ContextFull(1900, 300, 2048))
    repl.handle(LONG)
    assert "1900 of 2048 cells are in use and it needs 300 more" in out()
    assert "'/set on-full evict' so that earlier turns are evicted to make room, /clear" in out()
    assert repl.session.messages == [] and repl.decision is None
    eng.enqueue([" Hi."])
    repl.handle("Hi.")
    assert len(repl.session.messages) == 2


def test_a_failed_turn_is_one_message(fake):
    repl, eng, out = fake()
    eng.enqueue(DecodeError("llama_decode returned 1 (no KV slot)"))
    repl.handle("Hi.")
    assert last_line(out()) == "the turn failed: llama_decode returned 1 (no KV slot). /clear starts over."
    assert repl.session.messages == []


def test_ctrl_c_during_generation_keeps_partial_answer(fake):
    class InterruptAfter(io.StringIO):
        """A terminal whose user presses Ctrl-C as the third piece is shown."""
        shown = 0

        def write(self, s):
            n = super().write(s)
            if s.strip():
                self.shown += 1
                if self.shown == 3:
                    raise KeyboardInterrupt
            return n

    repl, eng, out = fake(console=_console(InterruptAfter()), max_tokens=32)
    eng.enqueue([f" w{i}" for i in range(32)], decision(T=50))
    repl.handle("Tell me a long story about a cat.")
    assert [m.role for m in repl.session.messages] == ["user", "assistant"]
    assert repl.session.messages[1].content == " w0 w1 w2"  # what was generated before the stream was closed
    assert repl.result.finish_reason == "interrupted" and len(repl.result.tokens) == 3
    assert last_line(out()).endswith("53/2048 cells · stopped by Ctrl-C (the partial answer is kept)")
    eng.enqueue([" Bye."])
    repl.handle("Thanks.")  # the session goes on
    assert len(repl.session.messages) == 4


def test_commands_misc(fake):
    repl, _, out = fake()
    assert repl.handle("/help") is True and "/read FILE" in out() and "/why" in out()
    assert repl.handle("/frobnicate") is True and "unknown command /frobnicate" in out()
    assert repl.handle("   ") is True and repl.session.messages == []
    repl.handle("/system Answer in French.")
    assert repl.session.system == "Answer in French." and "System prompt set." in out()
    repl.handle("/system")
    assert "system prompt: Answer in French." in out()
    repl.handle("/system -")
    assert repl.session.system is None
    for usage in ("/read", "/save", "/load", "/set budget"):
        repl.handle(usage)
        assert last_line(out()).startswith("usage: ")
    assert repl.handle("/exit") is False and repl.handle("/QUIT") is False


def test_help_is_written_from_the_command_table(fake):
    """Every command is reached by its name and aliases (any case), and /help shows each row's usage and help,
    its continuation lines under the first; no name is taken twice."""
    repl, _, out = fake()
    names = [n for c in repl_commands.COMMANDS for n in (c.name, *c.aliases)]
    assert len(names) == len(set(names)) and all(n == n.lower() and n.startswith("/") for n in names)
    for c in repl_commands.COMMANDS:
        for n in (c.name, *c.aliases):
            assert repl_commands.find(n.upper()) is c
    repl.handle("/help")
    shown = out()
    for c in repl_commands.COMMANDS:
        if c.help is None:  # listed on another row: /load on /save's
            assert any(c.usage in o.usage for o in repl_commands.COMMANDS if o.help), c.name
            continue
        first, *more = c.help.split("\n")
        width = repl_commands.USAGE_WIDTH  # descriptions line up in one column; a wider usage is followed by two spaces
        gap = " " * (width - len(c.usage) if len(c.usage) < width else 2)
        assert re.search(rf"^{re.escape(c.usage)}{gap}{re.escape(first)}$", shown, re.M), c.name
        for line in more:
            assert f"\n{' ' * repl_commands.USAGE_WIDTH}{line}\n" in shown + "\n", line


def test_a_command_added_to_the_table_is_dispatched_and_listed(fake, monkeypatch):
    """Adding a command is a handler and a row: the REPL finds it and /help lists it."""
    seen = []

    def ping(repl, arg):
        seen.append(arg)
        repl.console.print(f"pong {arg}")

    row = repl_commands.Command("/ping", "/ping [TEXT]", "answer pong", ping, aliases=("/p",))
    monkeypatch.setattr(repl_commands, "COMMANDS", (*repl_commands.COMMANDS, row))
    repl, _, out = fake()
    assert repl.handle("/PING  two words ") is True and repl.handle("/p") is True
    assert seen == ["two words", ""] and "pong two words" in out()
    repl.handle("/help")
    assert re.search(r"^/ping \[TEXT\] +answer pong$", out(), re.M)


def test_a_leading_space_sends_a_slash_message(fake):
    repl, eng, _ = fake()
    eng.enqueue([" ok"])
    repl.handle(" /etc/hosts is a file")
    assert eng.prompts == ["/etc/hosts is a file"]


def test_run_loop_continuation_and_ctrl_c(fake):
    repl, eng, _ = fake()
    eng.enqueue([" ok"])
    script = iter(["first line \\", "second line", KeyboardInterrupt, "/exit", "never read"])

    def reader(prompt):
        item = next(script)
        if item is KeyboardInterrupt:
            raise KeyboardInterrupt
        return item

    run_loop(repl, reader)
    assert repl.session.messages[0].content == "first line \nsecond line"
    assert next(script) == "never read"


def test_banner(fake):
    repl, eng, out = fake()
    eng.profile_warning = "the profile is stale"
    repl.banner(multiline_hint=False)
    first = out().splitlines()[0]
    assert first == ("page-local chat · fake-model.gguf · n_ctx 2048 · layers and KV cache on CPU · budget 0.25 (deleted for good) · "
                     "evictor snapkv · gate verify · verify-tokens 64 · on-full evict · temperature 0 · "
                     "max-tokens 8")
    assert "a trailing \\ continues a line" in out() and "Esc+Enter" not in out()
    assert "warning: the profile is stale" in out()
    assert "attention: default for the CPU: flash attention on; f16 cache" in out()


def test_terminal_reader_history_and_esc_enter(tmp_path):
    from prompt_toolkit.input import create_pipe_input
    from prompt_toolkit.output import DummyOutput

    from page_local.cli.repl import terminal_reader

    with create_pipe_input() as inp:
        read = terminal_reader(input=inp, output=DummyOutput())
        inp.send_text("line one\x1b\rline two\r")  # Esc+Enter adds a line; Enter sends
        assert read("> ") == "line one\nline two"
        inp.send_text("\x03")  # Ctrl-C at the prompt
        with pytest.raises(KeyboardInterrupt):
            read("> ")
        inp.send_text("\x04")  # Ctrl-D on an empty line
        with pytest.raises(EOFError):
            read("> ")
    assert "line two" in (tmp_path / "home" / "history").read_text()


# --- end to end on SmolLM2 -----------------------------------------------------------------------

@pytest.fixture
def real_repl(smollm2_path):
    """real_repl(n_ctx=2048, **Repl kwargs) -> (repl, out) on the real Engine and ChatSession."""
    from page_local.engine import Engine

    engines = []

    def make(n_ctx=2048, console=None, on_full="evict", **kw):
        eng = Engine(smollm2_path, n_ctx=n_ctx, threads=2, on_full=on_full)
        engines.append(eng)
        kw.setdefault("max_tokens", 8)
        repl = Repl(eng, console or _console(), **kw)
        return repl, lambda: repl.console.file.getvalue()

    yield make
    for e in engines:
        e.close()


def test_real_turn_status_and_stats(real_repl):
    repl, out = real_repl()
    assert repl.handle("What is the capital of France?") is True
    msgs = repl.session.messages
    assert [m.role for m in msgs] == ["user", "assistant"]
    assert msgs[1].content.strip() and msgs[1].content.strip() in out()
    d, e = repl.decision, repl.engine
    assert d is repl.result.decision and d.gate_mode == "verify"
    status = last_line(out())
    assert status.startswith(f"{narrate.status(d)} · ") and f" · {e.cells_used()}/{e.n_ctx} cells" in status
    repl.handle("/stats")
    assert "last decision" in out() and f"{e.cells_used()}/{e.n_ctx}" in out()


def test_real_gate_always_evicts_and_why(real_repl):
    repl, out = real_repl()
    repl.handle("/set gate always")
    assert repl.engine.gate.mode == "always"
    repl.handle(LONG + " Which colour is item 4?")
    d = repl.decision
    assert d.gate_mode == "always" and d.open and d.evicted and d.kept < d.T
    assert last_line(out()).startswith(f"evicted to {d.kept} of {d.T} (gate always, unchecked) · ")
    repl.handle("/why")
    assert "forced to 'always'" in out() and f"kept {d.kept} of {d.T} positions" in out()


def test_real_verify_decision_explained(real_repl):
    repl, out = real_repl()  # the default gate: verify
    repl.handle(LONG + " Which colour is item 4?")
    d = repl.decision
    assert d.gate_mode == "verify" and d.T > d.B and d.verify_m and d.verify_rule
    assert last_line(out()).startswith("evicted to" if d.evicted else "verify refused: full cache of")
    repl.handle("/why")
    text = " ".join(out().split())
    assert "Self-verification decided:" in text and "re-scored on the evicted cache in one batch" in text
    assert ("the eviction was committed." if d.evicted else "the full cache was kept.") in text


def test_real_save_clear_load_roundtrip(real_repl, tmp_path):
    repl, out = real_repl()
    repl.handle("/system You are terse.")
    repl.handle("Name a colour.")
    repl.handle("/set gate never")
    saved = [(m.role, m.content) for m in repl.session.messages]
    f = tmp_path / "c.json"
    repl.handle(f"/save {f}")
    repl.handle("/clear")
    repl.handle("/set gate page")
    repl.session.system = None
    repl.handle(f"/load {f}")
    assert [(m.role, m.content) for m in repl.session.messages] == saved
    assert repl.session.system == "You are terse." and repl.engine.gate.mode == "never"
    assert repl.engine.cells_used() > 0  # re-prefilled, so the next turn continues from the cache
    repl.handle("And another?")
    assert len(repl.session.messages) == 4


def long_conversation_file(tmp_path):
    """A JSON save whose conversation is longer than a 256-cell context."""
    big = tmp_path / "big.json"
    big.write_text(json.dumps({"format": "page-local-chat", "version": 1, "system": None,
                               "messages": [{"role": "user", "content": LONG * 2},
                                            {"role": "assistant", "content": "ok"}],
                               "settings": {"gate": "never", "budget": 0.5}}))
    return big


def test_real_load_too_long_for_context_keeps_conversation(real_repl, tmp_path):
    big = long_conversation_file(tmp_path)
    repl, out = real_repl(n_ctx=256, on_full="refuse")
    repl.handle("/set gate never")  # no eviction: the cache is the whole history, before and after
    repl.handle("Hi.")
    before = (list(repl.session.messages), repl.settings())
    repl.handle(f"/load {big}")
    assert "could not load" in out() and "the current conversation is unchanged" in out()
    assert (list(repl.session.messages), repl.settings()) == before
    assert repl.engine.cells_used() == len(repl.engine.history)  # the failed prefill left nothing behind
    repl.handle("Thanks.")
    assert len(repl.session.messages) == 4


def test_real_a_failed_load_keeps_an_evicted_conversation_exactly(real_repl, tmp_path, monkeypatch):
    """A load that fails after its file was read (another model's cache; Ctrl-C during a JSON replay)
    puts back the evicted cache itself, which a re-prefill of the messages could not."""
    repl, out = real_repl()
    repl.handle("/set gate always")
    repl.handle("/set budget 64")
    repl.handle(LONG + " Which colour is item 4?")
    e = repl.engine
    assert repl.decision.evicted and repl.session.evicted

    def state():
        snap = e.snapshot()
        return list(repl.session.messages), repl.settings(), snap.history, snap.positions, snap.state

    before = state()
    other = tmp_path / "other model.chat"
    persist.save(dataclasses.replace(e.snapshot(), model_id="another-model"), other,
                 {"format": SAVE_FORMAT, "messages": [], "settings": {"gate": "never"}})
    long_json = tmp_path / "long.json"
    long_json.write_text(json.dumps({"format": SAVE_FORMAT, "version": 1, "system": None, "settings": {},
                                     "messages": [{"role": "user", "content": LONG * 2},
                                                  {"role": "assistant", "content": "ok"}]}))
    decode = e.ctx.decode

    def cut(tokens, pos0, *a, **kw):  # Ctrl-C between two batches of the replay's prefill
        decode(tokens[:64], pos0, *a, **kw)
        raise KeyboardInterrupt

    repl.handle(f"/load {other}")
    assert "saved with another model" in last_line(out()) and state() == before
    monkeypatch.setattr(e.ctx, "decode", cut)
    repl.handle(f"/load {long_json}")
    monkeypatch.undo()
    assert last_line(out()) == f"could not load {long_json}: interrupted; the current conversation is unchanged"
    assert state() == before
    repl.handle("Thanks.")
    assert len(repl.session.messages) == 4


def test_real_load_of_a_conversation_longer_than_the_context_makes_room(real_repl, tmp_path):
    big = long_conversation_file(tmp_path)
    repl, out = real_repl(n_ctx=256)  # on_full "evict", the default
    repl.handle(f"/load {big}")
    assert "Loaded 2 messages" in out(), out()
    assert repl.engine.cells_used() <= 256 < len(repl.engine.history)
    repl.handle("Thanks.")
    assert len(repl.session.messages) == 4


def test_real_ctrl_c_during_prefill_leaves_cache_in_step(real_repl, monkeypatch):
    repl, out = real_repl()
    repl.handle("Hello!")
    before = (list(repl.session.messages), repl.engine.cells_used())
    ctx, decode = repl.engine.ctx, repl.engine.ctx.decode

    def cut(tokens, pos0, *a, **kw):  # Ctrl-C between two batches of a long prefill
        if len(tokens) > 64:
            decode(tokens[:64], pos0, *a, **kw)
            raise KeyboardInterrupt
        return decode(tokens, pos0, *a, **kw)

    monkeypatch.setattr(ctx, "decode", cut)
    repl.handle(LONG + " Which colour is item 2?")
    monkeypatch.undo()
    assert "the message was not sent" in out()
    assert list(repl.session.messages) == before[0]
    # no stray prompt tokens: the cache holds exactly the (re-prefilled) conversation, too short to evict
    assert repl.engine.cells_used() == len(repl.engine.history) < before[1] + 8
    repl.handle("Thanks.")
    assert len(repl.session.messages) == 4


def test_real_ctrl_c_during_generation_keeps_partial_answer(real_repl):
    class InterruptAfter(io.StringIO):
        """A terminal whose user presses Ctrl-C once the answer has started."""
        armed = False

        def write(self, s):
            n = super().write(s)
            if self.armed and s.strip():
                self.armed = False
                raise KeyboardInterrupt
            return n

    f = InterruptAfter()
    repl, out = real_repl(console=_console(f), max_tokens=32)
    f.armed = True
    repl.handle("Tell me a long story about a cat.")
    assert [m.role for m in repl.session.messages] == ["user", "assistant"]
    assert "stopped by Ctrl-C" in out()
    assert repl.result.finish_reason == "interrupted" and len(repl.result.tokens) < 32
    assert repl.engine.cells_used() == len(repl.engine.history)  # the partial answer is in the cache, no more
    repl.handle("Thanks.")  # the session goes on
    assert len(repl.session.messages) == 4


def test_cli_chat_from_piped_stdin(smollm2_path):
    res = CliRunner().invoke(chat_cmd, ["--model", str(smollm2_path), "--n-ctx", "2048", "--max-tokens", "8",
                                        "--budget", "1024"], input="hello\n/stats\n/exit\n")
    assert res.exit_code == 0, res.output
    assert "page-local chat" in res.output and "budget 1024" in res.output
    assert "full cache kept: " in res.output and "last decision" in res.output


def test_cli_chat_eof_exits(smollm2_path):
    res = CliRunner().invoke(chat_cmd, ["--model", str(smollm2_path), "--n-ctx", "512"], input="")
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("args,exit_code,text", [
    (["--model", "/nonexistent/model.gguf"], 1, "model file not found"),
    (["--budget", "2"], 2, "smaller than the 36 protected positions"),
    (["--gate", "maybe"], 2, "maybe"),
], ids=["missing-model", "bad-budget", "bad-gate"])
def test_cli_chat_errors(args, exit_code, text):
    res = CliRunner().invoke(chat_cmd, args, input="")
    assert res.exit_code == exit_code
    assert text in res.output and "Traceback" not in res.output


def test_cli_chat_not_a_gguf(tmp_path, monkeypatch):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a model")
    monkeypatch.setenv("PAGE_LOCAL_MODEL", str(bad))
    res = CliRunner().invoke(chat_cmd, [], input="")
    assert res.exit_code == 1 and "not a GGUF model file" in res.output
    assert res.output.strip().count("\n") == 0  # one line


@pytest.mark.parametrize("command", ["chat", "serve"])
def test_reread_is_words_by_default_a_bare_flag_always_and_no_reread_never(command):
    """--reread MODE (defaults.REREADS), a bare --reread (the older flag) "always", --no-reread "never"; parsed as
    the command parses it, nothing loaded. A mode it does not know is a usage error that names the modes."""
    import click

    from page_local.cli.chat import chat_cmd
    from page_local.cli.serve import serve_cmd

    cmd = {"chat": chat_cmd, "serve": serve_cmd}[command]
    for args, want in (([], "words"), (["--reread"], "always"), (["--reread", "--n-ctx", "512"], "always"),
                       (["--reread", "never"], "never"), (["--reread=words"], "words"), (["--no-reread"], "never")):
        assert cmd.make_context(command, list(args)).params["reread"] == want, args
    with pytest.raises(click.BadParameter, match="never.*words.*always"):
        cmd.make_context(command, ["--reread", "sometimes"])


def test_cli_chat_reread_reads_a_cut_document_again_for_the_next_question(smollm2_path, tmp_path):
    """chat --reread: a document twice the context is read in parts (room made); the next message reads the
    conversation again from the first token room-making deleted, and the status line says so. Without it the
    next message reads only itself."""
    doc = tmp_path / "doc.txt"
    doc.write_text(" ".join(f"Sentence {i} of the notes says the weather was mild on day {i}." for i in range(60))
                   + " The locker number for the warm cotton gym is 3978.")
    lines = f"/read {doc} What is the locker number for the warm cotton gym?\nWhat was the weather on day 3?\n/exit\n"
    for flag in ("--reread", "--no-reread"):
        res = CliRunner().invoke(chat_cmd, ["--model", str(smollm2_path), "--n-ctx", "512", "--max-tokens", "8",
                                            "--threads", "1", flag], input=lines)
        assert res.exit_code == 0, res.output
        assert "earlier tokens deleted to make room" in res.output
        assert ("earlier tokens read again for this message" in res.output) == (flag == "--reread"), res.output
