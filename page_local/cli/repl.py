"""The REPL of `page-local chat`: a conversation on one Engine, with what the cache went through after
each answer (narrate.status) and `/why` to explain it (narrate.why).

Two layers, so the REPL can be tested with scripted input and a fake engine (tests/fakes.py):
* `Repl` holds the conversation (a ChatSession) and the settings; `Repl.handle(line)` runs one
  complete input (a message or a slash command), writes to a rich Console and returns False when the
  user exits.
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
from pathlib import Path
from typing import Callable

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from page_local.chat.session import MAX_TOKENS, ChatSession
from page_local.engine import narrate
from page_local.cli.common import parse_budget, speed_words
from page_local.engine import Decision, Result, Sampling
from page_local.engine.room import check_on_full
from page_local.errors import ChatFileError, ChatTemplateError, ContextFull, PageLocalError
from page_local.native.runtime import describe_placement
from page_local.store.home import page_local_home

MAX_READ_BYTES = 16 * 1024 * 1024  # /read refuses larger files before reading them
SETTINGS = ("budget", "park", "evictor", "gate", "verify_tokens", "on_full", "temperature", "max_tokens")

HELP = """\
Type a message and press Enter. Esc+Enter, or a line ending in \\, continues on a new line.
Ctrl-C stops an answer (the partial answer stays); Ctrl-C at the prompt clears the line; Ctrl-D exits.

/help                 this text
/clear                start a new conversation (drops a pending /read document too)
/system [TEXT]        set the system prompt (re-prefills the conversation); alone: show it; '-' removes it
/set [KEY VALUE]      budget (0.25 = ratio, 1024 = cells; 1.0: the whole conversation attended), park (on: the
                      budget sets cells aside, each message chooses again; off: it deletes them), evictor,
                      gate (verify|page|page+verify|always|never), verify-tokens (1-256), on-full (evict|refuse),
                      temperature, max-tokens;
                      alone: show the settings. They apply from the next turn.
/why (or /gate)       what happened to the cache on the last turn, and why, in plain words
/stats                the last turn's decision in full, with timings
/read FILE [QUESTION] put the file's text into the next message (QUESTION, or your next line, follows it)
/save FILE, /load FILE  the conversation and the settings: JSON, or with the KV cache once a turn evicted
                      (it then continues with identical tokens); FILE is the rest of the line, or quoted
/exit                 quit"""


def _path_arg(rest: str) -> str:
    """The FILE of /save and /load: the whole rest of the line ('my chat.json'), or a quoted path."""
    rest = rest.strip()
    if len(rest) >= 2 and rest[0] in "'\"" and rest[-1] == rest[0]:
        return rest[1:-1]
    return rest


def _one_line(e: object) -> str:
    """An exception's message on one line (llama.cpp's reasons and OS messages can hold newlines)."""
    return " ".join(str(e).split()) or type(e).__name__


def _int(value):
    """'16' -> 16; anything else unchanged, for the setter to refuse by name."""
    return int(value) if isinstance(value, str) and re.fullmatch(r"\s*\d+\s*", value) else value


def _split_path(rest: str) -> tuple[str, str]:
    """'"my file.txt" why?' -> ('my file.txt', 'why?'); 'a.txt why?' -> ('a.txt', 'why?')."""
    rest = rest.strip()
    if rest[:1] in ("'", '"'):
        end = rest.find(rest[0], 1)
        if end > 0:
            return rest[1:end], rest[end + 1 :].strip()
    path, _, tail = rest.partition(" ")
    return path, tail.strip()


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
                                f"{describe_placement(e.placement)} · " + self._settings_line(), style="bold"),
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
            self._send(text)
            return True
        cmd, arg = (text.split(None, 1) + [""])[:2]  # the argument keeps its inner newlines
        cmd, arg = cmd.lower(), arg.strip()
        if cmd in ("/exit", "/quit"):
            return False
        action = {
            "/help": lambda a: self.console.print(Text(HELP)),
            "/clear": self._clear, "/system": self._system, "/set": self._set, "/stats": self._stats,
            "/why": self._why, "/gate": self._why, "/read": self._read, "/save": self._save, "/load": self._load,
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
            return self._error(f"the message was not sent: {e}")
        except PageLocalError as e:  # a decode failure: the cache may be out of step
            return self._error(f"the turn failed: {e}. /clear starts over.")
        except ValueError as e:  # the engine refused the input before prefilling it
            return self._error(f"the message was not sent: {e}")
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
            self._error(f"the cache could not be restored ({e}); the conversation was cleared")

    def _status(self, interrupted: bool) -> None:
        """What the cache went through first (narrate.status), then speed, cells and how the answer ended."""
        r, d, e = self.result, self.decision, self.engine
        if r is None or d is None:
            return
        parts = [narrate.status(d), f"{r.tokens_per_s:.1f} tok/s", f"{_cells(e)} cells"]
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
        if self.engine.on_full == "refuse":
            tip = ("What you can do: '/set on-full evict' so that earlier turns are evicted to make room, "
                   "/clear to start a new conversation, or restart with a larger --n-ctx")
        else:  # room was made and it still does not fit: what may not be evicted is too large
            tip = ("Even with earlier turns evicted it does not fit: shorten the message or the system prompt, "
                   "/clear, or restart with a larger --n-ctx")
        self.console.print(f"{tip} (now {e.n_ctx}).", highlight=False)

    # --- commands ----------------------------------------------------------------------------
    def _clear(self, _arg: str) -> None:
        self.session.clear()
        self.pending_doc = None
        self.decision = self.result = None
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
        return {"budget": e.budget, "park": bool(getattr(e, "park", False)), "evictor": e.evictor,
                "gate": e.gate_mode, "verify_tokens": e.verify_tokens, "on_full": e.on_full,
                "temperature": self.sampling.temperature, "max_tokens": self.max_tokens}

    def _settings_line(self) -> str:
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

    def _no_turn(self) -> bool:
        if self.decision is None:
            self.console.print("No turn yet (the gate decides after each message's prefill)."
                               + (f" The conversation was {self.replaced} since." if self.session.messages else ""))
        return self.decision is None

    def _stats(self, _arg: str) -> None:
        if self._no_turn():
            return self.console.print(f"cells {_cells(self.engine)}", highlight=False)
        d, r = self.decision, self.result
        t = Table(title="last decision", show_header=False)
        t.add_column("field", style="bold")
        t.add_column("value", overflow="fold")
        t.add_row("outcome", narrate.status(d))
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
        for k, v in (("prompt_tokens", r.prompt_tokens), ("generated", f"{len(r.tokens)} ({r.finish_reason})"),
                     ("tokens/s", f"{r.tokens_per_s:.1f}")):
            t.add_row(k, str(v))
        t.add_row("cells", _cells(self.engine))
        t.add_row("device", describe_placement(self.engine.placement))
        self.console.print(t)

    def _why(self, _arg: str) -> None:
        if not self._no_turn():
            self.console.print(Text(narrate.why(self.decision)))

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
        path = Path(_path_arg(arg)).expanduser()
        folder = next((p for p in path.parents if p.exists()), path)  # the save creates the folders below it

        def failed(why: str) -> None:
            self._error(f"could not save to {path}: {why}; the conversation is kept")

        if path.is_dir():
            return failed("it is a folder (/save takes a file name)")
        if not folder.is_dir():
            return failed(f"{folder} is a file, not a folder")
        with_cache = self.session.evicted  # ChatSession.save then writes the KV cache, not JSON
        try:
            self.session.save(path, settings=self.settings())
        except OSError as e:  # written through a temp file: nothing was half written
            return failed(_one_line(e.strerror or e))
        except (PageLocalError, RuntimeError) as e:  # e.g. llama.cpp could not copy the cache out
            return failed(_one_line(e))
        n = len(self.session.messages)
        if with_cache:
            size = path.stat().st_size / 2**20
            self.console.print(f"Saved {n} messages and the evicted KV cache ({size:.1f} MiB) to {path}; "
                               "/load continues it with identical tokens", highlight=False)
        else:
            self.console.print(f"Saved {n} messages to {path}", highlight=False)

    def _load(self, arg: str) -> None:
        if not arg:
            return self._error("usage: /load FILE")
        path = Path(_path_arg(arg)).expanduser()
        keep = "the current conversation is unchanged"
        if path.is_dir():
            return self._error(f"could not load: {path} is a folder, not a file written by /save; {keep}")
        try:
            data = self.session.read(path)  # validate before touching the current conversation
        except ChatFileError as e:
            return self._error(f"could not load: {_one_line(e)}; {keep}")
        old_settings, old_messages = self.settings(), list(self.session.messages)
        try:
            self.apply_settings(data.get("settings") or {})  # before the replay: its prefill runs the gate
        except ValueError as e:
            return self._error(f"could not load {path}: bad settings ({_one_line(e)}); {keep}")
        try:
            self.session.load(path)  # a load that fails leaves the conversation as it was
        except (PageLocalError, ValueError, KeyboardInterrupt) as e:
            self.apply_settings(old_settings)
            why = "interrupted" if isinstance(e, KeyboardInterrupt) else _one_line(e)
            if list(self.session.messages) != old_messages:  # only when it could not be put back
                keep = "the conversation was cleared"
            return self._error(f"could not load {path}: {why}; {keep}")
        self.decision = self.result = None  # the cache was replaced: the last turn no longer describes it
        n = len(self.session.messages)
        if data.get("cache"):
            self.replaced = "restored from a cache file"
            self.console.print(f"Loaded {n} messages and their KV cache ({self.engine.cells_used()} cells, "
                               f"as saved); {self._settings_line()}", highlight=False)
        else:
            self.replaced = "re-prefilled"
            self.console.print(f"Loaded {n} messages; {self._settings_line()}", highlight=False)

    def _replayed(self, action: Callable[[], object], undo: Callable[[], None], failed: str) -> bool:
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
                self._error(f"{failed}: {e}{hint}; the conversation is as it was")
            except (PageLocalError, ValueError):
                self.session.clear()
                self._error(f"{failed}: {e}; the conversation could not be restored either and was cleared")
            return False

    def _error(self, msg: str) -> None:
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


def _cells(engine) -> str:
    """'42/2048', or with cells parked (engine/parking.py) '580 attended + 1741 set aside/4096'."""
    parking = getattr(engine, "parking", None)
    parked = parking.count() if parking is not None else 0
    used = f"{engine.cells_used()} attended + {parked} set aside" if parked else str(engine.cells_used())
    return f"{used}/{engine.n_ctx}"
