"""The REPL's slash commands (cli/repl.py): one small handler per command and the table that names them.

A handler is `handler(repl, arg) -> None | False`: `repl` is the running Repl, `arg` the rest of the line
(stripped; it keeps its inner newlines), and False ends the REPL. Handlers never raise for user mistakes:
they print what happened and what to do through `repl.error`, and the conversation stays usable.

Adding a command is one function here and one row in COMMANDS: the dispatcher (Repl.handle) finds it by
name or alias, and /help lists it from the row. What a handler may use of the Repl: console, engine,
session, pending_doc, decision/result/replaced (the last turn and what replaced the cache since),
max_tokens, and the methods error, send, cells, settings, settings_line, apply_setting(s), replayed.
This module does not import cli/repl.py, so the table sits below the class that dispatches through it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from rich.table import Table
from rich.text import Text

from page_local.engine import narrate
from page_local.errors import ChatFileError, PageLocalError
from page_local.native.runtime import describe_placement

MAX_READ_BYTES = 16 * 1024 * 1024  # /read refuses larger files before reading them

INTRO = """\
Type a message and press Enter. Esc+Enter, or a line ending in \\, continues on a new line.
Ctrl-C stops an answer (the partial answer stays); Ctrl-C at the prompt clears the line; Ctrl-D exits."""
USAGE_WIDTH = 22  # the column where /help's descriptions start


@dataclass(frozen=True)
class Command:
    """One slash command. `name` and `aliases` (lower case, with the slash) reach `handler`; `usage` and
    `help` make its /help row, where `help` may hold more lines (each printed under the first). help=None
    lists the command on another row only (/load, whose usage sits on /save's row)."""

    name: str
    usage: str
    help: str | None
    handler: Callable[[object, str], bool | None]
    aliases: tuple[str, ...] = ()


# --- helpers the handlers share -------------------------------------------------------------------

def _path_arg(rest: str) -> str:
    """The FILE of /save and /load: the whole rest of the line ('my chat.json'), or a quoted path."""
    rest = rest.strip()
    if len(rest) >= 2 and rest[0] in "'\"" and rest[-1] == rest[0]:
        return rest[1:-1]
    return rest


def _split_path(rest: str) -> tuple[str, str]:
    """'"my file.txt" why?' -> ('my file.txt', 'why?'); 'a.txt why?' -> ('a.txt', 'why?')."""
    rest = rest.strip()
    if rest[:1] in ("'", '"'):
        end = rest.find(rest[0], 1)
        if end > 0:
            return rest[1:end], rest[end + 1 :].strip()
    path, _, tail = rest.partition(" ")
    return path, tail.strip()


def one_line(e: object) -> str:
    """An exception's message on one line (llama.cpp's reasons and OS messages can hold newlines)."""
    return " ".join(str(e).split()) or type(e).__name__


def _no_turn(repl) -> bool:
    """True (having said so) when no turn's decision describes the cache: before the first turn, or after
    a re-prefill (/system, /load, /clear)."""
    if repl.decision is None:
        repl.console.print("No turn yet (the gate decides after each message's prefill)."
                           + (f" The conversation was {repl.replaced} since." if repl.session.messages else ""))
    return repl.decision is None


# --- the handlers, in /help's order ----------------------------------------------------------------

def show_help(repl, _arg: str) -> None:
    repl.console.print(Text(help_text()))


def clear(repl, _arg: str) -> None:
    repl.session.clear()
    repl.pending_doc = None
    repl.decision = repl.result = None
    repl.console.print("New conversation.")


def system(repl, arg: str) -> None:
    if not arg:
        return repl.console.print(Text(f"system prompt: {repl.session.system or '(none)'}"))
    old = repl.session.system
    new = None if arg == "-" else arg
    if repl.replayed(lambda: repl.session.set_system(new), lambda: repl.session.set_system(old),
                     "could not change the system prompt"):
        repl.console.print("System prompt removed." if new is None else "System prompt set.")


def set_(repl, arg: str) -> None:
    if not arg:
        return repl.console.print(repl.settings_line(), highlight=False)
    key, _, value = arg.partition(" ")
    if not value.strip():
        return repl.error(f"usage: /set {key} VALUE")
    try:
        repl.apply_setting(key, value.strip())
    except ValueError as e:
        return repl.error(f"{e}; nothing changed")
    repl.console.print(f"{repl.settings_line()} (from the next turn)", highlight=False)


def why(repl, _arg: str) -> None:
    if not _no_turn(repl):
        repl.console.print(Text(narrate.why(repl.decision)))


def stats(repl, _arg: str) -> None:
    if _no_turn(repl):
        return repl.console.print(f"cells {repl.cells()}", highlight=False)
    d, r = repl.decision, repl.result
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
    t.add_row("cells", repl.cells())
    t.add_row("device", describe_placement(repl.engine.placement))
    repl.console.print(t)


def read(repl, arg: str) -> None:
    if not arg:
        return repl.error("usage: /read FILE [QUESTION]")
    name, question = _split_path(arg)
    path = Path(name).expanduser()
    try:
        if path.stat().st_size > MAX_READ_BYTES:
            return repl.error(f"{path} is larger than {MAX_READ_BYTES // 2**20} MiB; /read is for text documents")
        data = path.read_bytes()
    except FileNotFoundError:
        return repl.error(f"no such file: {path}")
    except OSError as e:
        return repl.error(f"cannot read {path}: {e.strerror or e}")
    try:
        if b"\0" in data:
            raise UnicodeDecodeError("utf-8", data, 0, 1, "NUL byte")
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        return repl.error(f"{path} is not a UTF-8 text file; /read takes text documents only")
    if not text.strip():
        return repl.error(f"{path} is empty")
    repl.pending_doc = (path.name, text)
    if question:
        repl.send(question)
    else:
        repl.console.print(Text(f"Read {path.name} ({len(text)} characters); it is sent with your next "
                                "message, which follows it.", style="dim"))


def save(repl, arg: str) -> None:
    if not arg:
        return repl.error("usage: /save FILE")
    path = Path(_path_arg(arg)).expanduser()
    folder = next((p for p in path.parents if p.exists()), path)  # the save creates the folders below it

    def failed(why: str) -> None:
        repl.error(f"could not save to {path}: {why}; the conversation is kept")

    if path.is_dir():
        return failed("it is a folder (/save takes a file name)")
    if not folder.is_dir():
        return failed(f"{folder} is a file, not a folder")
    with_cache = repl.session.evicted  # ChatSession.save then writes the KV cache, not JSON
    try:
        repl.session.save(path, settings=repl.settings())
    except OSError as e:  # written through a temp file: nothing was half written
        return failed(one_line(e.strerror or e))
    except (PageLocalError, RuntimeError) as e:  # e.g. llama.cpp could not copy the cache out
        return failed(one_line(e))
    n = len(repl.session.messages)
    if with_cache:
        size = path.stat().st_size / 2**20
        repl.console.print(f"Saved {n} messages and the evicted KV cache ({size:.1f} MiB) to {path}; "
                           "/load continues it with identical tokens", highlight=False)
    else:
        repl.console.print(f"Saved {n} messages to {path}", highlight=False)


def load(repl, arg: str) -> None:
    if not arg:
        return repl.error("usage: /load FILE")
    path = Path(_path_arg(arg)).expanduser()
    keep = "the current conversation is unchanged"
    if path.is_dir():
        return repl.error(f"could not load: {path} is a folder, not a file written by /save; {keep}")
    try:
        data = repl.session.read(path)  # validate before touching the current conversation
    except ChatFileError as e:
        return repl.error(f"could not load: {one_line(e)}; {keep}")
    old_settings, old_messages = repl.settings(), list(repl.session.messages)
    try:
        repl.apply_settings(data.get("settings") or {})  # before the replay: its prefill runs the gate
    except ValueError as e:
        return repl.error(f"could not load {path}: bad settings ({one_line(e)}); {keep}")
    try:
        repl.session.load(path)  # a load that fails leaves the conversation as it was
    except (PageLocalError, ValueError, KeyboardInterrupt) as e:
        repl.apply_settings(old_settings)
        why = "interrupted" if isinstance(e, KeyboardInterrupt) else one_line(e)
        if list(repl.session.messages) != old_messages:  # only when it could not be put back
            keep = "the conversation was cleared"
        return repl.error(f"could not load {path}: {why}; {keep}")
    repl.decision = repl.result = None  # the cache was replaced: the last turn no longer describes it
    n = len(repl.session.messages)
    if data.get("cache"):
        repl.replaced = "restored from a cache file"
        repl.console.print(f"Loaded {n} messages and their KV cache ({repl.engine.cells_used()} cells, "
                           f"as saved); {repl.settings_line()}", highlight=False)
    else:
        repl.replaced = "re-prefilled"
        repl.console.print(f"Loaded {n} messages; {repl.settings_line()}", highlight=False)


def exit_(_repl, _arg: str) -> bool:
    return False


# --- the table --------------------------------------------------------------------------------------

COMMANDS: tuple[Command, ...] = (
    Command("/help", "/help", "this text", show_help),
    Command("/clear", "/clear", "start a new conversation (drops a pending /read document too)", clear),
    Command("/system", "/system [TEXT]", "set the system prompt (re-prefills the conversation); alone: show it; "
            "'-' removes it", system),
    Command("/set", "/set [KEY VALUE]",
            "budget (0.25 = ratio, 1024 = cells; 1.0: the whole conversation attended), park (on: the\n"
            "budget sets cells aside, each message chooses again; off: it deletes them), evictor,\n"
            "gate (verify|page|page+verify|always|never), verify-tokens (1-256), on-full (evict|refuse),\n"
            "temperature, max-tokens;\n"
            "alone: show the settings. They apply from the next turn.", set_),
    Command("/why", "/why (or /gate)", "what happened to the cache on the last turn, and why, in plain words", why,
            aliases=("/gate",)),
    Command("/stats", "/stats", "the last turn's decision in full, with timings", stats),
    Command("/read", "/read FILE [QUESTION]",
            "put the file's text into the next message (QUESTION, or your next line, follows it)", read),
    Command("/save", "/save FILE, /load FILE",
            "the conversation and the settings: JSON, or with the KV cache once a turn evicted\n"
            "(it then continues with identical tokens); FILE is the rest of the line, or quoted", save),
    Command("/load", "/load FILE", None, load),
    Command("/exit", "/exit", "quit", exit_, aliases=("/quit",)),
)



def find(name: str) -> Command | None:
    """The command `name` ('/why', any case) or one of its aliases reaches; None for an unknown name.
    The table is read on each call (a dozen rows), so a row added to COMMANDS is found at once."""
    name = name.lower()
    return next((c for c in COMMANDS if name == c.name or name in c.aliases), None)


def help_text() -> str:
    """/help: how to type, then one row per command (usage, then its help from column USAGE_WIDTH)."""
    rows = [INTRO, ""]
    for c in COMMANDS:
        if c.help is None:
            continue
        # a usage that fills the column gets two spaces, so that it does not run into its text
        head = c.usage.ljust(USAGE_WIDTH) if len(c.usage) < USAGE_WIDTH else c.usage + "  "
        first, *more = c.help.split("\n")
        rows.append(head + first)
        rows.extend(" " * USAGE_WIDTH + line for line in more)
    return "\n".join(rows)
