"""`page-local chat`: an interactive chat on one Engine, with PAGE's gate decision after each answer.

Two layers, so the REPL can be tested with scripted input (docs/design.md §11, rule 10):
* `Repl` holds the ChatSession and the settings; `Repl.handle(line)` runs one complete input
  (a message or a slash command), writes to a rich Console and returns False when the user exits.
* `run_loop` only reads lines (prompt_toolkit on a terminal, plain stdin otherwise), joins
  continuation lines and feeds them to `handle`.

    with Engine(n_ctx=2048) as eng:
        repl = Repl(eng, Console())
        repl.handle("What is KV-cache eviction?")
        repl.handle("/stats")
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Callable

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

from . import models
from .cli_common import BudgetType, load_options, model_option, parse_budget, show_llama_log, verify_tokens_option
from .chat import ChatFileError, ChatSession
from .chat_template import ChatTemplateError
from .engine import ContextFull, Engine, Sampling
from .evictors import EVICTORS
from .engine import GATE_MODES as MODES
from .gate import page_local_home
from .native import PageError
from .runtime import DecodeError, ModelError, describe_placement
from .verify import describe

MAX_READ_BYTES = 16 * 1024 * 1024  # /read refuses larger files before reading them
SETTINGS = ("budget", "evictor", "gate", "temperature", "max_tokens")

HELP = """\
Type a message and press Enter. Esc+Enter, or a line ending in \\, continues on a new line.
Ctrl-C stops an answer (the partial answer stays); Ctrl-C at the prompt clears the line; Ctrl-D exits.

/help                 this text
/clear                start a new conversation (drops a pending /read document too)
/system [TEXT]        set the system prompt (re-prefills the conversation); alone: show it; '-' removes it
/set [KEY VALUE]      budget (0.25 = ratio, 1024 = cells), evictor, gate (verify|page|page+verify|always|never),
                      temperature, max-tokens; alone: show the settings. They apply from the next turn.
/stats                the last gate decision in full, with timings
/gate                 the last gate decision in plain words
/read FILE [QUESTION] put the file's text into the next message (QUESTION, or your next line, follows it)
/save FILE, /load FILE  the conversation and the settings, as JSON
/exit                 quit"""


def _split_path(rest: str) -> tuple[str, str]:
    """'"my file.txt" why?' -> ('my file.txt', 'why?'); 'a.txt why?' -> ('a.txt', 'why?')."""
    rest = rest.strip()
    if rest[:1] in ("'", '"'):
        end = rest.find(rest[0], 1)
        if end > 0:
            return rest[1:end], rest[end + 1 :].strip()
    path, _, tail = rest.partition(" ")
    return path, tail.strip()


class Repl:
    """A chat on `engine` driven one input at a time; every output goes to `console`.

    `handle(line)` takes one complete input (continuation lines already joined) and returns False
    only for /exit. It never raises for user mistakes (bad settings, missing files, a full context):
    it prints what happened and what to do, and the conversation stays usable.
    """

    def __init__(self, engine: Engine, console: Console | None = None, system: str | None = None,
                 max_tokens: int = 512, temperature: float = 0.0):
        self.engine = engine
        self.console = console or Console()
        self.session = ChatSession(engine, system=system)
        self.max_tokens = max_tokens
        self.sampling = Sampling(temperature=temperature)
        self.sampling.validate()
        self.pending_doc: tuple[str, str] | None = None  # (file name, text) from /read

    # --- entry points ------------------------------------------------------------------------
    def banner(self, multiline_hint: bool = True) -> None:
        """The one-time greeting: model, settings, how to continue a line, and a profile warning if any."""
        e = self.engine
        self.console.print(Text(f"page-local chat · {e.model.path.name} · n_ctx {e.n_ctx} · "
                                f"{describe_placement(e.placement)} · " + self._settings_line(), style="bold"),
                           soft_wrap=True)
        hint = "Esc+Enter or a trailing \\ continues a line" if multiline_hint else "a trailing \\ continues a line"
        self.console.print(Text(f"/help for commands · {hint} · Ctrl-C stops an answer · Ctrl-D exits",
                                style="dim"))
        if e.profile_warning:
            self.console.print(Text(f"warning: {e.profile_warning}", style="yellow"))

    def handle(self, line: str) -> bool:
        """Run one input; False means the user asked to exit."""
        text = line.strip()
        if not text:
            return True
        if not line.startswith("/"):  # " /x" is a message: a leading space escapes the slash
            self._send(text)
            return True
        cmd, arg = (text.split(None, 1) + [""])[:2]  # the argument keeps its inner newlines
        cmd, arg = cmd.lower(), arg.strip()
        if cmd in ("/exit", "/quit"):
            return False
        action = {
            "/help": lambda a: self.console.print(Text(HELP)),
            "/clear": self._clear, "/system": self._system, "/set": self._set, "/stats": self._stats,
            "/gate": self._gate, "/read": self._read, "/save": self._save, "/load": self._load,
        }.get(cmd)
        if action is None:
            self._error(f"unknown command {cmd}; /help lists the commands (start a message with a space "
                        "to send text that begins with '/')")
        else:
            action(arg)
        return True

    # --- a turn ------------------------------------------------------------------------------
    def _send(self, text: str) -> None:
        if self.pending_doc is not None:
            # the document first, then the question: the probe window (the last 32 tokens) then
            # sits on the question, which is what PAGE's gate is meant to look at
            name, doc = self.pending_doc
            self.pending_doc = None
            text = f"{doc.rstrip()}\n\n{text}"
            self.console.print(Text(f"(sending {name} with your message)", style="dim"))
        n_msgs, cells = len(self.session.messages), self.engine.cells_used()
        gen = self.session.send(text, max_tokens=self.max_tokens, sampling=self.sampling)
        interrupted = False
        try:
            for piece in gen:
                self.console.print(Text(piece), end="", soft_wrap=True)
        except KeyboardInterrupt:
            interrupted = True
        except ContextFull as e:
            self._context_full(e)
            return
        except ChatTemplateError as e:  # raised while rendering, before anything reached the cache
            return self._error(f"the message was not sent: {e}")
        except (RuntimeError, ValueError) as e:  # a decode failure: the cache may be out of step
            return self._error(f"the turn failed: {e}. /clear starts over.")
        finally:
            # A KeyboardInterrupt raised here (not inside the generator) leaves it suspended;
            # closing it runs ChatSession.send's cleanup, which records the partial answer.
            gen.close()
        if len(self.session.messages) == n_msgs:  # Ctrl-C before the prompt was in the cache
            if self.engine.cells_used() != cells:
                self._resync()
            return self.console.print(Text("stopped before the answer began; the message was not sent",
                                           style="dim"))
        self.console.print()
        self._status(interrupted)

    def _resync(self) -> None:
        # A prefill cut between two batches leaves part of the prompt in the cache that the
        # session does not know about; re-prefilling the recorded conversation drops it.
        try:
            self.session.replay(list(self.session.messages))
        except (RuntimeError, ValueError) as e:
            self.session.clear()
            self._error(f"the cache could not be restored ({e}); the conversation was cleared")

    def _status(self, interrupted: bool) -> None:
        r, d, e = self.session.last_result, self.engine.last_decision, self.engine
        if r is None or d is None:
            return
        parts = [f"{r.tokens_per_s:.1f} tok/s", f"{e.cells_used()}/{e.n_ctx} cells"]
        z = f", z {d.z:+.2f}" if d.z is not None else ""
        D = f"D {d.D:.4f}{z}, " if d.D is not None else ""
        parts.append(f"gate {'open' if d.open else 'closed'} ({D}{d.gate_mode}) kept {d.kept}/{d.T}")
        if interrupted:
            parts.append("stopped by Ctrl-C (the partial answer is kept)")
        elif r.finish_reason == "context":
            parts.append("stopped: the context is full (/clear, or a larger --n-ctx)")
        elif r.finish_reason == "length":
            parts.append(f"stopped at max-tokens {self.max_tokens}")
        self.console.print(Text(" · ".join(parts), style="dim"), soft_wrap=True)

    def _context_full(self, e: ContextFull) -> None:
        self._error(f"this message does not fit: {e.used} of {e.n_ctx} cells are in use and it needs "
                    f"{e.needed} more. Nothing was sent and nothing was dropped.")
        if e.needed > e.n_ctx:
            tip = "The message alone is longer than the context: shorten it, or restart with a larger --n-ctx"
        else:
            tip = "What you can do: /clear to start a new conversation, or restart with a larger --n-ctx"
            if self.engine.gate_mode != "always":
                tip += (", or '/set gate always' so that the evictor compresses every turn, at your own risk: "
                        "the gate keeps the full cache when eviction looks unsafe")
        self.console.print(f"{tip} (now {e.n_ctx}).", highlight=False)

    # --- commands ----------------------------------------------------------------------------
    def _clear(self, _arg: str) -> None:
        self.session.clear()
        self.pending_doc = None
        self.console.print("New conversation.")

    def _system(self, arg: str) -> None:
        if not arg:
            return self.console.print(Text(f"system prompt: {self.session.system or '(none)'}"))
        old = self.session.system
        new = None if arg == "-" else arg
        if self._replayed(lambda: self.session.set_system(new), lambda: self.session.set_system(old),
                          "could not change the system prompt"):
            self.console.print("System prompt removed." if new is None else "System prompt set.")

    def settings(self) -> dict:
        """The settings that /save writes and /load restores."""
        e = self.engine
        return {"budget": e.budget, "evictor": e.evictor, "gate": e.gate_mode,
                "temperature": self.sampling.temperature, "max_tokens": self.max_tokens}

    def _settings_line(self) -> str:
        s = self.settings()
        return (f"budget {s['budget']} · evictor {s['evictor']} · gate {s['gate']} · "
                f"temperature {s['temperature']:g} · max-tokens {s['max_tokens']}")

    def apply_setting(self, key: str, value) -> None:
        """Set one setting from a string (or a JSON value); ValueError leaves every setting unchanged."""
        key = key.lower().replace("-", "_")
        if key == "budget":
            self.engine.set_budget(parse_budget(value) if isinstance(value, str) else value)
        elif key == "evictor":
            self.engine.set_evictor(str(value))
        elif key == "gate":
            self.engine.set_gate(str(value))
        elif key == "temperature":
            try:
                t = float(value)
            except (TypeError, ValueError):
                t = value  # Sampling.validate names the offending value
            s = Sampling(temperature=t, top_k=self.sampling.top_k, top_p=self.sampling.top_p)
            s.validate()  # ValueError: temperature must be in [0, 5]
            self.sampling = s
        elif key == "max_tokens":
            n = int(value) if isinstance(value, str) and re.fullmatch(r"\d+", value.strip()) else value
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"max-tokens must be an int >= 1, got {value!r}")
            self.max_tokens = n
        else:
            raise ValueError(f"unknown setting {key!r}; settings: budget, evictor, gate, temperature, max-tokens")

    def apply_settings(self, settings: object) -> None:
        """Apply several settings at once: all of them, or (ValueError) none of them."""
        if not isinstance(settings, dict):
            raise ValueError(f"settings must be an object, got {type(settings).__name__}")
        old = self.settings()
        try:
            for k in SETTINGS:
                if k in settings:
                    self.apply_setting(k, settings[k])
        except ValueError:
            for k, v in old.items():
                self.apply_setting(k, v)
            raise

    def _set(self, arg: str) -> None:
        if not arg:
            return self.console.print(self._settings_line(), highlight=False)
        key, _, value = arg.partition(" ")
        if not value.strip():
            return self._error(f"usage: /set {key} VALUE")
        try:
            self.apply_setting(key, value.strip())
        except ValueError as e:
            return self._error(f"{e}; nothing changed")
        self.console.print(f"{self._settings_line()} (from the next turn)", highlight=False)

    def _stats(self, _arg: str) -> None:
        d, r = self.engine.last_decision, self.session.last_result
        if d is None:
            return self.console.print("No turn yet.")
        t = Table(title="last decision", show_header=False)
        t.add_column("field", style="bold")
        t.add_column("value", overflow="fold")
        for k, v in d.to_dict().items():
            if k.startswith("verify_") and d.verify_m is None:
                continue  # self-verification did not run on this turn
            if k == "agreement":
                v = " ".join(f"{a:.2f}" for a in v) or "-"
            elif v is None:
                v = "-"
            elif k.endswith("_ms"):
                v = f"{v:.2f}"
            elif isinstance(v, float):
                v = f"{v:.4f}"
            t.add_row(k, str(v))
        if r is not None and r.decision is d:  # after /load or /system the decision is the replay's
            for k, v in (("prompt_tokens", r.prompt_tokens), ("generated", f"{len(r.tokens)} ({r.finish_reason})"),
                         ("tokens/s", f"{r.tokens_per_s:.1f}")):
                t.add_row(k, str(v))
        t.add_row("cells", f"{self.engine.cells_used()}/{self.engine.n_ctx}")
        t.add_row("device", describe_placement(self.engine.placement))
        self.console.print(t)

    def _gate(self, _arg: str) -> None:
        d = self.engine.last_decision
        if d is None:
            return self.console.print("No turn yet: the gate decides after each message's prefill.")
        if d.rule == "forced":
            what = (f"the gate is forced to '{d.gate_mode}', so D was not consulted: "
                    + ("the evictor ran whenever the conversation exceeded the budget."
                       if d.open else "the full cache is kept on every turn."))
        elif d.rule == "none":
            what = f"the gate kept the full cache because {d.reason}."
        elif d.open:
            what = ("the gate opened because late layers' heads agree much less than early layers' on which "
                    "positions matter (a large drop D), which PAGE reads as eviction being safe.")
        else:
            what = ("the gate kept the full cache because head agreement barely drops from early to late "
                    "layers (a small D), which PAGE reads as an input that needs its whole context.")
        act = (f"The {d.evictor} evictor kept {d.kept} of {d.T} positions (budget {d.B}, {d.compression:.1f}x "
               "smaller); the answer was generated from the compressed cache." if d.evicted else
               f"Nothing was evicted: the {d.T} positions fit within the budget of {d.B}." if d.open else
               f"All {d.T} positions were kept; nothing was dropped.")
        if d.verify_m:  # self-verification had the last word
            span = (f"the whole answer ({d.verify_m} tokens and its end)" if d.verify_until == "end" else
                    f"the first {d.verify_m} tokens of the answer")
            what = (f"self-verification decided: {span} were generated with the full cache, then re-scored "
                    f"on the evicted cache in one batch: "
                    f"{describe(d.verify_rule, d.verify_score, d.verify_threshold)}, so "
                    + ("the eviction was committed." if d.evicted else "the full cache was kept."))
            act = (f"{d.kept} of {d.T} prompt positions are held now." if d.evicted else
                   f"All {d.T} positions were kept; nothing was dropped.")
        self.console.print(Text(f"Decision: {d.reason}.\nIn plain words: {what} {act}"))
        self.console.print(Text(
            "D is the mean head agreement of the first third of the layers minus that of the last third "
            "(PAGE, arXiv 2609.22157). Its threshold is a hypothesis per model: "
            + ("this model's calibration profile is in use." if d.rule == "calibrated" else
               "without a profile the raw threshold 0.07 is used; calibrate this model with "
               "`page-local calibrate` when it is available."), style="dim"))

    def _read(self, arg: str) -> None:
        if not arg:
            return self._error("usage: /read FILE [QUESTION]")
        name, question = _split_path(arg)
        path = Path(name).expanduser()
        try:
            if path.stat().st_size > MAX_READ_BYTES:
                return self._error(f"{path} is larger than {MAX_READ_BYTES // 2**20} MiB; /read is for text documents")
            data = path.read_bytes()
        except FileNotFoundError:
            return self._error(f"no such file: {path}")
        except OSError as e:
            return self._error(f"cannot read {path}: {e.strerror or e}")
        try:
            if b"\0" in data:
                raise UnicodeDecodeError("utf-8", data, 0, 1, "NUL byte")
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError:
            return self._error(f"{path} is not a UTF-8 text file; /read takes text documents only")
        if not text.strip():
            return self._error(f"{path} is empty")
        self.pending_doc = (path.name, text)
        if question:
            self._send(question)
        else:
            self.console.print(Text(f"Read {path.name} ({len(text)} characters); it is sent with your next "
                                    "message, which follows it.", style="dim"))

    def _save(self, arg: str) -> None:
        if not arg:
            return self._error("usage: /save FILE")
        try:
            path = self.session.save(_split_path(arg)[0], settings=self.settings())
        except OSError as e:
            return self._error(f"could not save: {e}")
        self.console.print(f"Saved {len(self.session.messages)} messages to {path}", highlight=False)

    def _load(self, arg: str) -> None:
        if not arg:
            return self._error("usage: /load FILE")
        path = _split_path(arg)[0]
        try:
            data = ChatSession.read(path)  # validate before touching the current conversation
        except ChatFileError as e:
            return self._error(f"could not load: {e}; the current conversation is unchanged")
        old_settings, old_system, old_messages = self.settings(), self.session.system, list(self.session.messages)
        try:
            self.apply_settings(data.get("settings") or {})  # before the replay: its prefill runs the gate
        except ValueError as e:
            return self._error(f"could not load {path}: bad settings ({e}); the current conversation is unchanged")

        def restore() -> None:
            self.apply_settings(old_settings)
            self.session.system = old_system
            self.session.replay(old_messages)

        if self._replayed(lambda: self.session.load(path), restore, f"could not load {path}"):
            self.pending_doc = None
            self.console.print(f"Loaded {len(self.session.messages)} messages; {self._settings_line()}",
                               highlight=False)

    def _replayed(self, action: Callable[[], None], undo: Callable[[], None], failed: str) -> bool:
        """Run an action that re-prefills the conversation; on failure undo it, or clear as a last resort.

        A replay prefills the whole conversation at once, so one that only fitted thanks to eviction
        can overflow n_ctx; the cache would then hold part of it and must not be left that way.
        """
        try:
            action()
            return True
        except (ChatFileError, RuntimeError, ValueError) as e:
            try:
                undo()
                hint = "" if isinstance(e, ChatTemplateError) else f" (does it fit in n_ctx {self.engine.n_ctx}?)"
                self._error(f"{failed}: {e}{hint}; the conversation is as it was")
            except (RuntimeError, ValueError):
                self.session.clear()
                self._error(f"{failed}: {e}; the conversation could not be restored either and was cleared")
            return False

    def _error(self, msg: str) -> None:
        self.console.print(Text(msg, style="red"))


# --- the line reader and the click command -------------------------------------------------------

def run_loop(repl: Repl, read_line: Callable[[str], str]) -> None:
    """Feed `repl` until /exit or EOF. read_line(prompt) returns one line, raises EOFError at the end
    and KeyboardInterrupt for Ctrl-C (which only clears the line being typed)."""
    while True:
        try:
            line = read_line("> ")
            while line.endswith("\\"):  # continuation: works with any reader, pipes included
                line = line[:-1] + "\n" + read_line("… ")
        except KeyboardInterrupt:
            continue
        except EOFError:
            return
        try:
            if not repl.handle(line):
                return
        except KeyboardInterrupt:  # outside a generation (e.g. during a /load replay)
            repl.console.print(Text("interrupted", style="dim"))


def _stdin_reader(prompt: str) -> str:
    """Lines from a non-terminal stdin (pipes, tests): no prompt is echoed."""
    line = sys.stdin.readline()
    if not line:
        raise EOFError
    return line.rstrip("\r\n")


def terminal_reader(input=None, output=None) -> Callable[[str], str]:
    """A prompt_toolkit reader with history in <home>/history and Esc+Enter for a new line
    (input/output: prompt_toolkit objects, for tests; None = the terminal)."""
    from prompt_toolkit import PromptSession
    from prompt_toolkit.history import FileHistory
    from prompt_toolkit.key_binding import KeyBindings

    home = page_local_home()  # $PAGE_LOCAL_HOME read now, so tests and users can redirect it
    home.mkdir(parents=True, exist_ok=True)
    keys = KeyBindings()

    @keys.add("escape", "enter")
    def _newline(event):
        event.current_buffer.insert_text("\n")

    session = PromptSession(history=FileHistory(str(home / "history")), key_bindings=keys,
                            input=input, output=output)
    return lambda prompt: session.prompt(prompt)


@click.command("chat")
@model_option
@click.option("--budget", type=BudgetType(), default="0.25", show_default=True,
              help="cells kept when the gate opens: a ratio in (0, 1] or a count")
@click.option("--evictor", type=click.Choice(sorted(EVICTORS)), default="snapkv", show_default=True)
@click.option("--gate", type=click.Choice(MODES), default="verify", show_default=True,
              help="page: PAGE decides per turn; always/never: forced")
@verify_tokens_option
@click.option("--n-ctx", default=4096, show_default=True, type=click.IntRange(min=1))
@click.option("--threads", default=2, show_default=True, type=click.IntRange(min=1))
@click.option("--system", default=None, help="system prompt")
@click.option("--max-tokens", default=512, show_default=True, type=click.IntRange(min=1))
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(0, 5),
              help="0 = greedy")
@load_options
def chat(model, budget, evictor, gate, verify_tokens, n_ctx, threads, system, max_tokens, temperature, n_gpu_layers,
         allow_long_context):
    """Chat with a local model; PAGE's gate decision is shown after each answer."""
    show_llama_log()
    try:
        path = models.resolve(model)
        engine = Engine(path, n_ctx=n_ctx, budget=budget, evictor=evictor, gate=gate, threads=threads,
                        verify_tokens=verify_tokens, n_gpu_layers=n_gpu_layers, allow_long_context=allow_long_context)
    except (ModelError, models.ModelNotInstalled, PageError, DecodeError, ValueError, OSError) as e:
        raise click.ClickException(str(e)) from None  # one line on stderr, exit code 1
    with engine:
        try:
            repl = Repl(engine, Console(), system=system, max_tokens=max_tokens, temperature=temperature)
        except ValueError as e:  # e.g. a model without a chat template
            raise click.ClickException(str(e)) from None
        tty = sys.stdin.isatty() and sys.stdout.isatty()
        repl.banner(multiline_hint=tty)
        run_loop(repl, terminal_reader() if tty else _stdin_reader)
