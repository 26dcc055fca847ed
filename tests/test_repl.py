"""`page-local chat`: the Repl driven by scripted lines on the real SmolLM2 engine (small n_ctx,
max_tokens 8), asserting on the transcript and on ChatSession's messages; and the click command
through CliRunner (stdin is not a terminal there, so the command reads plain lines)."""

from __future__ import annotations

import io
import json

import pytest
from click.testing import CliRunner
from rich.console import Console

from page_local.engine import Engine
from page_local.repl import Repl, chat, parse_budget, run_loop

LONG = " ".join(f"Item {i} is a {c} box on shelf {i % 7}." for i, c in
                enumerate(["red", "green", "blue", "yellow", "white", "black"] * 3))


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGE_LOCAL_HOME", str(tmp_path / "home"))  # no user profile or history leaks in


def _console(file=None) -> Console:
    return Console(file=file or io.StringIO(), width=1000, color_system=None, force_terminal=False)


@pytest.fixture
def make_repl(smollm2_path):
    """make_repl(n_ctx=2048, **Repl kwargs) -> (repl, out); out() returns the transcript so far."""
    engines = []

    def make(n_ctx=2048, console=None, **kw):
        eng = Engine(smollm2_path, n_ctx=n_ctx, threads=2)
        engines.append(eng)
        kw.setdefault("max_tokens", 8)
        repl = Repl(eng, console or _console(), **kw)
        return repl, lambda: repl.console.file.getvalue()

    yield make
    for e in engines:
        e.close()


def test_question_gets_answer_and_status(make_repl):
    repl, out = make_repl()
    assert repl.handle("What is the capital of France?") is True
    msgs = repl.session.messages
    assert [m.role for m in msgs] == ["user", "assistant"]
    assert msgs[1].content.strip() and msgs[1].content.strip() in out()
    status = out().strip().splitlines()[-1]
    assert "tok/s" in status and f"/{repl.engine.n_ctx} cells" in status and "gate " in status and "kept" in status


@pytest.mark.parametrize("key,value,field", [
    ("budget", "2", "budget"), ("budget", "1.5", "budget"), ("budget", "lots", "budget"),
    ("evictor", "nope", "evictor"), ("gate", "sometimes", "gate"), ("temperature", "9", "temperature"),
    ("temperature", "hot", "temperature"), ("max-tokens", "0", "max_tokens"), ("colour", "red", None),
], ids=["budget-too-small", "budget-ratio>1", "budget-text", "evictor", "gate", "temperature",
        "temperature-text", "max-tokens", "unknown-key"])
def test_set_invalid_changes_nothing(make_repl, key, value, field):
    repl, out = make_repl()
    before = repl.settings()
    repl.handle(f"/set {key} {value}")
    assert "nothing changed" in out()
    assert repl.settings() == before


def test_set_valid_values(make_repl):
    repl, out = make_repl()
    for line in ("/set budget 1024", "/set budget 0.5", "/set evictor streamingllm", "/set temperature 0.7",
                 "/set max-tokens 4"):
        repl.handle(line)
    assert repl.settings() == {"budget": 0.5, "evictor": "streamingllm", "gate": "verify",
                               "temperature": 0.7, "max_tokens": 4}
    assert "nothing changed" not in out()
    assert parse_budget("1024") == 1024 and isinstance(parse_budget("0.25"), float)


def test_gate_always_evicts_and_stats_and_gate_explain(make_repl):
    repl, out = make_repl()
    repl.handle("/stats")
    assert "No turn yet" in out()
    repl.handle("/set gate always")
    assert repl.engine.gate.mode == "always"
    repl.handle(LONG + " Which colour is item 4?")
    d = repl.engine.last_decision
    assert d.gate_mode == "always" and d.open and d.evicted and d.kept < d.T
    repl.handle("/stats")
    text = out()
    assert "last decision" in text
    for field in ("│ D ", "prefill_ms", "evict_ms", "agreement", "tokens/s", "reason"):
        assert field in text, field
    repl.handle("/gate")
    text = out()
    assert "forced to 'always'" in text and f"kept {d.kept} of {d.T} positions" in text
    assert "page-local calibrate" in text


def test_gate_explains_a_verify_decision(make_repl):
    repl, out = make_repl()  # the default gate: verify
    repl.handle(LONG + " Which colour is item 4?")
    d = repl.engine.last_decision
    assert d.gate_mode == "verify" and d.verify_m and d.verify_rule
    repl.handle("/gate")
    text = " ".join(out().split())
    assert "self-verification decided:" in text and "re-scored on the evicted cache in one batch" in text
    assert ("the eviction was committed." if d.evicted else "the full cache was kept.") in text


def test_gate_explains_page_decision(make_repl):
    repl, out = make_repl()
    repl.handle("/set gate page")
    repl.handle("Hello!")
    repl.handle("/gate")
    d = repl.engine.last_decision
    assert d.rule == "raw" and d.reason in out()
    assert ("the gate opened because" if d.open else "the gate kept the full cache because") in out()
    assert "hypothesis per model" in out()


def test_save_clear_load_roundtrip(make_repl, tmp_path):
    repl, out = make_repl()
    repl.handle("/system You are terse.")
    repl.handle("Name a colour.")
    repl.handle("/set budget 0.5")
    repl.handle("/set gate never")
    saved = [(m.role, m.content) for m in repl.session.messages]
    f = tmp_path / "conv" / "c.json"
    repl.handle(f"/save {f}")
    assert json.loads(f.read_text())["settings"]["budget"] == 0.5
    repl.handle("/clear")
    repl.handle("/set budget 0.25")
    repl.handle("/set gate page")
    repl.session.system = None
    assert repl.session.messages == []
    repl.handle(f"/load {f}")
    assert [(m.role, m.content) for m in repl.session.messages] == saved
    assert repl.session.system == "You are terse."
    assert repl.settings()["budget"] == 0.5 and repl.engine.gate.mode == "never"
    assert repl.engine.cells_used() > 0  # re-prefilled, so the next turn continues from the cache
    repl.handle("And another?")
    assert len(repl.session.messages) == 4


@pytest.mark.parametrize("content", ["{not json", json.dumps({"format": "other"}),
                                     json.dumps({"format": "page-local-chat", "messages": [],
                                                 "settings": {"budget": 7}})],
                         ids=["corrupt", "wrong-format", "bad-settings"])
def test_load_bad_file_keeps_conversation(make_repl, tmp_path, content):
    repl, out = make_repl()
    repl.handle("Hi there.")
    before = (list(repl.session.messages), repl.settings(), repl.engine.cells_used())
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    repl.handle(f"/load {bad}")
    assert "could not load" in out() and "unchanged" in out()
    assert (list(repl.session.messages), repl.settings(), repl.engine.cells_used()) == before
    repl.handle(f"/load {tmp_path / 'missing.json'}")
    assert "no such conversation file" in out()
    assert list(repl.session.messages) == before[0]


def test_load_too_long_for_context_keeps_conversation(make_repl, tmp_path):
    big = tmp_path / "big.json"
    big.write_text(json.dumps({"format": "page-local-chat", "version": 1, "system": None,
                               "messages": [{"role": "user", "content": LONG * 2},
                                            {"role": "assistant", "content": "ok"}],
                               "settings": {"gate": "never", "budget": 0.5}}))
    repl, out = make_repl(n_ctx=256)
    repl.handle("/set gate never")  # no eviction: the cache is the whole history, before and after
    repl.handle("Hi.")
    before = (list(repl.session.messages), repl.settings())
    repl.handle(f"/load {big}")
    assert "could not load" in out() and "the conversation is as it was" in out()
    assert (list(repl.session.messages), repl.settings()) == before
    assert repl.engine.cells_used() == len(repl.engine.history)  # the failed prefill left nothing behind
    repl.handle("Thanks.")
    assert len(repl.session.messages) == 4


def test_read_puts_document_into_next_message(make_repl, tmp_path):
    repl, out = make_repl()
    doc = tmp_path / "notes.txt"
    doc.write_text("The launch code is 4471.\n")
    repl.handle(f"/read {doc}")
    assert repl.session.messages == [] and repl.pending_doc is not None
    repl.handle("What is the launch code?")
    user = repl.session.messages[0].content
    assert user.startswith("The launch code is 4471.") and user.endswith("What is the launch code?")
    assert repl.pending_doc is None
    repl.handle(f"/read {doc} Repeat the code.")  # the rest of the line is the question
    user = repl.session.messages[2].content
    assert "4471" in user and user.endswith("Repeat the code.")


def test_read_bad_files(make_repl, tmp_path):
    repl, out = make_repl()
    repl.handle(f"/read {tmp_path / 'missing.txt'}")
    assert "no such file" in out()
    binary = tmp_path / "blob.bin"
    binary.write_bytes(b"\x00\x01\x02\xff" * 10)
    repl.handle(f"/read {binary}")
    assert "not a UTF-8 text file" in out()
    repl.handle(f"/read {tmp_path}")
    assert "cannot read" in out()
    assert repl.pending_doc is None and repl.session.messages == []


def test_context_full_advice_and_session_continues(make_repl):
    repl, out = make_repl(n_ctx=256)
    repl.handle(LONG * 2)  # longer than the whole context
    assert "does not fit" in out() and "longer than the context" in out() and "--n-ctx" in out()
    assert repl.session.messages == []
    repl.handle("/set gate never")  # the full cache is kept, so the conversation fills the context
    for _ in range(4):
        repl.handle(LONG[:300])
        if "/set gate always" in out():
            break
    assert "/clear" in out() and "/set gate always" in out() and "at your own risk" in out()
    n = len(repl.session.messages)
    repl.handle("/clear")
    repl.handle("Hi.")
    assert len(repl.session.messages) == 2 and n >= 2


def test_ctrl_c_during_generation_keeps_partial_answer(make_repl):
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
    repl, out = make_repl(console=_console(f), max_tokens=32)
    f.armed = True
    repl.handle("Tell me a long story about a cat.")
    assert [m.role for m in repl.session.messages] == ["user", "assistant"]
    assert "stopped by Ctrl-C" in out()
    assert len(repl.engine.last_result.tokens) < 32
    repl.handle("Thanks.")  # the session goes on
    assert len(repl.session.messages) == 4


def test_ctrl_c_during_prefill_leaves_cache_in_step(make_repl, monkeypatch):
    repl, out = make_repl()
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
    # no stray prompt tokens: the cache holds exactly the re-prefilled conversation (too short to evict)
    assert not repl.engine.last_decision.evicted
    assert repl.engine.cells_used() == len(repl.engine.history) < before[1] + 8
    repl.handle("Thanks.")
    assert len(repl.session.messages) == 4


def test_commands_misc(make_repl):
    repl, out = make_repl()
    assert repl.handle("/help") is True and "/read FILE" in out()
    assert repl.handle("/frobnicate") is True and "unknown command /frobnicate" in out()
    assert repl.handle("   ") is True and repl.session.messages == []
    repl.handle("/system Answer in French.")
    assert repl.session.system == "Answer in French."
    repl.handle("/system -")
    assert repl.session.system is None
    assert repl.handle("/exit") is False


def test_run_loop_continuation_and_ctrl_c(make_repl):
    repl, out = make_repl()
    script = iter(["first line \\", "second line", KeyboardInterrupt, "/exit", "never read"])

    def reader(prompt):
        item = next(script)
        if item is KeyboardInterrupt:
            raise KeyboardInterrupt
        return item

    run_loop(repl, reader)
    assert repl.session.messages[0].content == "first line \nsecond line"
    assert next(script) == "never read"


def test_cli_chat_from_piped_stdin(smollm2_path, tmp_path):
    runner = CliRunner()
    res = runner.invoke(chat, ["--model", str(smollm2_path), "--n-ctx", "2048", "--max-tokens", "8",
                               "--budget", "1024"], input="hello\n/stats\n/exit\n")
    assert res.exit_code == 0, res.output
    assert "page-local chat" in res.output and "budget 1024" in res.output
    assert "cells" in res.output and "last decision" in res.output


def test_cli_chat_eof_exits(smollm2_path):
    res = CliRunner().invoke(chat, ["--model", str(smollm2_path), "--n-ctx", "512"], input="")
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("args,exit_code,text", [
    (["--model", "/nonexistent/model.gguf"], 1, "model file not found"),
    (["--budget", "2"], 2, "smaller than the 36 protected positions"),
    (["--gate", "maybe"], 2, "maybe"),
], ids=["missing-model", "bad-budget", "bad-gate"])
def test_cli_chat_errors(args, exit_code, text, tmp_path):
    res = CliRunner().invoke(chat, args, input="")
    assert res.exit_code == exit_code
    assert text in res.output and "Traceback" not in res.output


def test_cli_chat_not_a_gguf(tmp_path, monkeypatch):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a model")
    monkeypatch.setenv("PAGE_LOCAL_MODEL", str(bad))
    res = CliRunner().invoke(chat, [], input="")
    assert res.exit_code == 1 and "not a GGUF model file" in res.output


def test_terminal_reader_history_and_esc_enter(tmp_path):
    from prompt_toolkit.input import create_pipe_input
    from prompt_toolkit.output import DummyOutput

    from page_local.repl import terminal_reader

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
