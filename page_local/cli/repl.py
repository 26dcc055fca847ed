"""The REPL of `page-local chat`: a conversation on one Engine, with what the cache went through after
each answer (narrate.status) and `/why` to explain it (narrate.why).

Three parts, so the REPL can be tested with scripted input and a fake engine (tests/fakes.py):
* `Repl` holds the conversation (a ChatSession) and the settings; `Repl.handle(line)` runs one
  complete input (a message or a slash command), writes to a rich Console and returns False when the
  user exits. A message is a turn (`send`, then the status line); a slash command goes to its handler.
* cli/repl_commands.py: the slash commands, one small handler each, named in one table (COMMANDS)
  from which /help is written. A new command is a handler and a row there.
* `run_loop` only reads lines (prompt_toolkit on a terminal, plain stdin otherwise), joins
  continuation lines and feeds them to `handle`.

    with Engine(n_ctx=2048) as eng:
        repl = Repl(eng, Console())
        repl.handle("What is KV-cache eviction?")
        repl.handle("/why")
"""

from __future__ import annotations

import re
import sys
from typing import Callable

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.text import Text

from page_local.chat.session import MAX_TOKENS, ChatSession
from page_local.cli import repl_commands
from page_local.cli.common import parse_budget, speed_words
from page_local.engine import Decision, Result, Sampling, narrate
from page_local.engine.room import check_on_full
from page_local.errors import ChatTemplateError, ContextFull, PageLocalError
from page_local.native.runtime import describe_placement
from page_local.store.home import page_local_home

SETTINGS = ("budget", "park", "evictor", "gate", "verify_tokens", "on_full", "temperature", "max_tokens")


def _int(value):
    """'16' -> 16; anything else unchanged, for the setter to refuse by name."""
    return int(value) if isinstance(value, str) and re.fullmatch(r"\s*\d+\s*", value) else value


class _Reading:
    """The line a long message shows while it is read: tokens read of the total and the time left (rich's
    progress bar, gone once the answer begins). Shown from READING_SHOWN tokens on: a short message is read
    before a bar would be worth drawing. Ctrl-C still stops the turn (the engine reads between batches)."""

    READING_SHOWN = 1024

    def __init__(self, console: Console):
        self.console = console
        self.progress: Progress | None = None
        self.task = None

    def update(self, done: int, total: int) -> None:
        if self.progress is None:
            if total < self.READING_SHOWN or done >= total:
                return
            self.progress = Progress(TextColumn("[dim]reading the message"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("[dim]tokens"), TimeRemainingColumn(), console=self.console,
                                     transient=True)
            self.progress.start()
            self.task = self.progress.add_task("read", total=total)
        self.progress.update(self.task, completed=done, total=total)

    def stop(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


class Repl:
    """A chat on `engine` driven one input at a time; every output goes to `console`.

    `handle(line)` takes one complete input (continuation lines already joined) and returns False
    only for /exit. It never raises for user mistakes (bad settings, missing files, a full context):
    it prints what happened and what to do, and the conversation stays usable.
    `session`: the conversation (default: a ChatSession on `engine`; tests pass a fake).
    """

    def __init__(self, engine, console: Console | None = None, system: str | None = None,
                 max_tokens: int = MAX_TOKENS, temperature: float = 0.0, session=None):
        self.engine = engine
        self.console = console or Console()
        self.session = session if session is not None else ChatSession(engine, system=system)
        self.max_tokens = max_tokens
        self.sampling = Sampling(temperature=temperature)
        self.sampling.validate()
        self.pending_doc: tuple[str, str] | None = None  # (file name, text) from /read
        # the last turn this REPL ran; None before the first and after a re-prefill (/system, /load, /clear),
        # whose cache no turn's decision describes
        self.decision: Decision | None = None
        self.result: Result | None = None
        self.replaced = "re-prefilled"  # what last replaced the cache, for /why and /stats to say

    # --- entry points ------------------------------------------------------------------------
    def banner(self, multiline_hint: bool = True) -> None:
        """The one-time greeting: model, settings, how to continue a line, and a profile warning if any."""
        e = self.engine
        self.console.print(Text(f"page-local chat · {e.model.path.name} · n_ctx {e.n_ctx} · "
                                f"{describe_placement(e.placement)} · " + self.settings_line(), style="bold"),
                           soft_wrap=True)
        hint = "Esc+Enter or a trailing \\ continues a line" if multiline_hint else "a trailing \\ continues a line"
        self.console.print(Text(f"/help for commands · {hint} · Ctrl-C stops an answer · Ctrl-D exits",
                                style="dim"))
        attention = getattr(e, "attention", None)
        if attention is not None:
            self.console.print(Text(f"attention: {attention.why}; {attention.cache_type} cache", style="dim"))
        for warning in (e.profile_warning, getattr(e, "attention_warning", None)):
            if warning:
                self.console.print(Text(f"warning: {warning}", style="yellow"))

    def handle(self, line: str) -> bool:
        """Run one input; False means the user asked to exit."""
        text = line.strip()
        if not text:
            return True
        if not line.startswith("/"):  # " /x" is a message: a leading space escapes the slash
            self.send(text)
            return True
        cmd, arg = (text.split(None, 1) + [""])[:2]  # the argument keeps its inner newlines
        cmd, arg = cmd.lower(), arg.strip()
        command = repl_commands.find(cmd)
        if command is None:
            self.error(f"unknown command {cmd}; /help lists the commands (start a message with a space "
                       "to send text that begins with '/')")
            return True
        return command.handler(self, arg) is not False

    # --- a turn ------------------------------------------------------------------------------
    def send(self, text: str) -> None:
        """One turn: `text` (after a document /read left pending) streamed to the console, then the status line."""
        if self.pending_doc is not None:
            # the document first, then the question: the probe window (the last 32 tokens) then
            # sits on the question, which is what PAGE's gate is meant to look at
            name, doc = self.pending_doc
            self.pending_doc = None
            text = f"{doc.rstrip()}\n\n{text}"
            self.console.print(Text(f"(sending {name} with your message)", style="dim"))
        n_msgs, cells = len(self.session.messages), self.engine.cells_used()
        stream, interrupted = None, False
        reading = _Reading(self.console)
        set_progress = getattr(self.engine, "set_progress", None)  # the fake engine of tests may lack it
        if set_progress is not None:
            set_progress(reading.update)
        try:
            stream = self.session.send(text, max_tokens=self.max_tokens, sampling=self.sampling)
            for piece in stream:
                reading.stop()
                self.console.print(Text(piece), end="", soft_wrap=True)
        except KeyboardInterrupt:
            interrupted = True
        except ContextFull as e:
            return self._context_full(e)
        except ChatTemplateError as e:  # raised while rendering, before anything reached the cache
            return self.error(f"the message was not sent: {e}")
        except PageLocalError as e:  # a decode failure: the cache may be out of step
            return self.error(f"the turn failed: {e}. /clear starts over.")
        except ValueError as e:  # the engine refused the input before prefilling it
            return self.error(f"the message was not sent: {e}")
        finally:
            reading.stop()
            if set_progress is not None:
                set_progress(None)
            # A KeyboardInterrupt raised here (in the console, not inside the stream) leaves the stream
            # suspended; closing it ends the turn, and the session records the partial answer.
            if stream is not None:
                stream.close()
        if len(self.session.messages) == n_msgs:  # Ctrl-C before the prompt was in the cache
            if self.engine.cells_used() != cells:
                self._resync()
            return self.console.print(Text("stopped before the answer began; the message was not sent",
                                           style="dim"))
        self.decision, self.result = stream.decision, stream.result
        self.console.print()
        self._status(interrupted)

    def _resync(self) -> None:
        # A prefill cut between two batches can leave part of the prompt in the cache that the
        # session does not know about; re-prefilling the recorded conversation drops it.
        self.decision = self.result = None
        self.replaced = "re-prefilled"
        try:
            self.session.replay(list(self.session.messages))
        except (PageLocalError, ValueError) as e:
            self.session.clear()
            self.error(f"the cache could not be restored ({e}); the conversation was cleared")

    def _status(self, interrupted: bool) -> None:
        """What the cache went through first (narrate.status), then speed, cells and how the answer ended."""
        r, d = self.result, self.decision
        if r is None or d is None:
            return
        parts = [narrate.status(d), f"{r.tokens_per_s:.1f} tok/s", f"{self.cells()} cells"]
        if interrupted:
            parts.append("stopped by Ctrl-C (the partial answer is kept)")
        elif r.finish_reason == "context":
            parts.append("stopped: the context is full (/clear, or a larger --n-ctx)")
        elif r.finish_reason == "length":
            parts.append(f"stopped at max-tokens {self.max_tokens}")
        self.console.print(Text(" · ".join(parts), style="dim"), soft_wrap=True)

    def _context_full(self, e: ContextFull) -> None:
        self.error(f"this message does not fit: {e.used} of {e.n_ctx} cells are in use and it needs "
                   f"{e.needed} more. Nothing was sent and nothing was dropped.")
        if self.engine.on_full == "refuse":
            tip = ("What you can do: '/set on-full evict' so that earlier turns are evicted to make room, "
                   "/clear to start a new conversation, or restart with a larger --n-ctx")
        else:  # room was made and it still does not fit: what may not be evicted is too large
            tip = ("Even with earlier turns evicted it does not fit: shorten the message or the system prompt, "
                   "/clear, or restart with a larger --n-ctx")
        self.console.print(f"{tip} (now {e.n_ctx}).", highlight=False)

    def cells(self) -> str:
        """'42/2048', or with cells parked (engine/parking.py) '580 attended + 1741 set aside/4096'."""
        e = self.engine
        parking = getattr(e, "parking", None)
        parked = parking.count() if parking is not None else 0
        used = f"{e.cells_used()} attended + {parked} set aside" if parked else str(e.cells_used())
        return f"{used}/{e.n_ctx}"

    # --- the settings (/set, /save, /load) ----------------------------------------------------
    def settings(self) -> dict:
        """The settings that /save writes and /load restores."""
        e = self.engine
        return {"budget": e.budget, "park": bool(getattr(e, "park", False)), "evictor": e.evictor,
                "gate": e.gate_mode, "verify_tokens": e.verify_tokens, "on_full": e.on_full,
                "temperature": self.sampling.temperature, "max_tokens": self.max_tokens}

    def settings_line(self) -> str:
        """The settings in words: the banner's tail, and what /set and /load answer."""
        s, e = self.settings(), self.engine
        budget, gate = speed_words(s["budget"], s["park"], getattr(e, "park_from", None), s["gate"],
                                   getattr(e, "ladder", ()))
        return (f"{budget} · evictor {s['evictor']} · {gate} · "
                f"verify-tokens {s['verify_tokens']} · on-full {s['on_full']} · "
                f"temperature {s['temperature']:g} · max-tokens {s['max_tokens']}")

    def apply_setting(self, key: str, value) -> None:
        """Set one setting from a string (or a JSON value); ValueError leaves every setting unchanged."""
        key = key.lower().replace("-", "_")
        if key == "budget":
            self.engine.set_budget(parse_budget(value) if isinstance(value, str) else value)
        elif key == "evictor":
            self.engine.set_evictor(str(value))
        elif key == "park":
            on = {"on": True, "true": True, "1": True, "yes": True, "off": False, "false": False, "0": False,
                  "no": False}.get(str(value).strip().lower()) if not isinstance(value, bool) else value
            if on is None:
                raise ValueError(f"park must be on or off, got {value!r}")
            if on != bool(getattr(self.engine, "park", False)):
                self.engine.set_park(on, self.engine.park_from)
        elif key == "gate":
            self.engine.set_gate(str(value))
        elif key == "verify_tokens":
            e = self.engine  # only the count changes: the rule and threshold stay as the engine has them
            e.set_verify(_int(value), e.verify_threshold, e.verify_rule)
        elif key == "on_full":
            self.engine.on_full = check_on_full(str(value))
        elif key == "temperature":
            try:
                t = float(value)
            except (TypeError, ValueError):
                t = value  # Sampling.validate names the offending value
            s = Sampling(temperature=t, top_k=self.sampling.top_k, top_p=self.sampling.top_p)
            s.validate()  # ValueError: temperature must be in [0, 5]
            self.sampling = s
        elif key == "max_tokens":
            n = _int(value)
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"max-tokens must be an int >= 1, got {value!r}")
            self.max_tokens = n
        else:
            raise ValueError(f"unknown setting {key!r}; settings: "
                             + ", ".join(k.replace("_", "-") for k in SETTINGS))

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

    # --- what the command handlers share ------------------------------------------------------
    def replayed(self, action: Callable[[], object], undo: Callable[[], None], failed: str) -> bool:
        """Run an action that re-prefills the conversation; on failure undo it, or clear as a last resort.

        A replay prefills the whole conversation at once, so one that only fitted thanks to eviction
        can overflow n_ctx; the cache would then hold part of it and must not be left that way.
        """
        self.decision = self.result = None  # the cache is re-prefilled: the last turn no longer describes it
        self.replaced = "re-prefilled"
        try:
            action()
            return True
        except (PageLocalError, ValueError) as e:
            try:
                undo()
                hint = "" if isinstance(e, ChatTemplateError) else f" (does it fit in n_ctx {self.engine.n_ctx}?)"
                self.error(f"{failed}: {e}{hint}; the conversation is as it was")
            except (PageLocalError, ValueError):
                self.session.clear()
                self.error(f"{failed}: {e}; the conversation could not be restored either and was cleared")
            return False

    def error(self, msg: str) -> None:
        """A user's mistake or a failed step, in red; the conversation stays usable."""
        self.console.print(Text(msg, style="red"))


# --- the line readers ---------------------------------------------------------------------------

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


def stdin_reader(prompt: str) -> str:
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

