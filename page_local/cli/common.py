"""What every `page-local` command shares: the options written once (their defaults come from
page_local.defaults), the --model resolution, reading a prompt, llama.cpp's log on stderr, and
one-line errors (exit codes: 0 ok, 2 usage, 1 runtime error)."""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import click

from page_local import defaults
from page_local.engine.selfcheck import rung_name
from page_local.errors import PageLocalError
from page_local.evictors import EVICTORS
from page_local.gate import GATE_MODES
from page_local.store import models
from page_local.verify import VERIFY_CAP

# --- errors ------------------------------------------------------------------------------------

def fail(message: str, code: int) -> None:
    """One line on stderr and the exit code (1 runtime, 2 usage); never a traceback."""
    click.echo(f"Error: {' '.join(str(message).split())}", err=True)
    click.get_current_context().exit(code)


@contextmanager
def one_line_errors() -> Iterator[None]:
    """Report what a command's body raises on purpose as one line: every PageLocalError (its message
    says what to do) and OSError exit 1; a remaining ValueError is the engine refusing an input
    (a budget too small for the prompt, ...) and exits 2 like a usage error."""
    try:
        yield
    except (PageLocalError, OSError) as e:  # before ValueError: ModelError, ChatTemplateError... are both
        fail(str(e), 1)
    except ValueError as e:
        fail(str(e), 2)


# --- options -----------------------------------------------------------------------------------

def model_option(f):
    return click.option(
        "--model", "model", metavar="NAME|PATH", default=None,
        help="A model by name — registered (smollm2, ...), or kept by Ollama (llama3.2:3b), LM Studio or the "
             "Hugging Face cache (ORG/REPO:QUANT): `page-local models` lists them, `page-local pull` gets more — "
             "or a GGUF file's path; default: $PAGE_LOCAL_MODEL or the embedded SmolLM2.")(f)


def parse_budget(text: str) -> float | int:
    """'0.25' -> 0.25 (ratio of the positions), '1024' -> 1024 (absolute count); validated."""
    from page_local.evictors.base import resolve_budget

    text = text.strip()
    try:
        value: float | int = int(text) if re.fullmatch(r"[+-]?\d+", text) else float(text)
    except ValueError:
        raise ValueError(f"budget {text!r} is neither a ratio like 0.25 nor a count like 1024") from None
    resolve_budget(value, 10_000)  # validation only (T is not known yet): ValueError says what is wrong
    return value


class _Parsed(click.ParamType):
    """A click type over a parse function whose ValueError is the user's one-line error."""

    parse = staticmethod(lambda text: text)

    def convert(self, value, param, ctx):
        if not isinstance(value, str):
            return value
        try:
            return self.parse(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)


class BudgetType(_Parsed):
    """A ratio with a decimal point ("0.25": keep a quarter) or an absolute count ("1024")."""

    name = "budget"
    parse = staticmethod(parse_budget)


def parse_ladder(text: str) -> tuple:
    """'1/16,1/8,1/4,1/2' or '0.0625,0.25' or '256,1024' -> the budgets gate 'search' tries; validated."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        m = re.fullmatch(r"1/(\d+)", part)
        out.append(1 / int(m.group(1)) if m and int(m.group(1)) > 0 else parse_budget(part))
    if not 1 <= len(out) <= 4:
        raise ValueError(f"--ladder takes 1 to 4 budgets, got {len(out)}")
    return tuple(sorted(set(out), key=lambda b: (isinstance(b, int), b)))


class LadderType(_Parsed):
    """Up to four budgets, comma-separated: '1/16,1/8,1/4,1/2'."""

    name = "ladder"
    parse = staticmethod(parse_ladder)


def ladder_text(ladder) -> str:
    """(0.25, 0.5) -> '1/4,1/2': a ladder as --ladder takes it and the status line names its rungs."""
    return ",".join(rung_name(r) for r in ladder)


def speed_words(budget, park: bool, park_from: int, gate: str, ladder) -> tuple[str, str]:
    """('budget 0.25 (set aside from 2048 cells)', 'gate search over 1/4,1/2'): the speed budget and the gate as
    chat's settings line and serve's ready line say them."""
    said_budget = f"budget {budget}"
    if budget != 1:  # what the budget does with what it leaves out: parking (engine/parking.py) or eviction
        said_budget += f" (set aside from {park_from} cells)" if park else " (deleted for good)"
    said_gate = f"gate {gate}" + (f" over {ladder_text(ladder)}" if gate in ("search", "page+search") else "")
    return said_budget, said_gate


def ladder_option(f, default=defaults.LADDER):
    return click.option(
        "--ladder", default=ladder_text(default), show_default=True, type=LadderType(),
        help="--gate search / page+search: the budgets tried on one prefill, each checked on the answer; the "
             "smallest that passes is kept (ratios like 1/8 or 0.125, or counts).")(f)


def budget_option(f, default=defaults.BUDGET):
    return click.option("--budget", default=str(default), show_default=True, type=BudgetType(),
                        help="Kept positions when the cache is evicted: a ratio (0.25) or a count (1024)."
                        + (" 1.0: no eviction for speed, only to make room when the context is full."
                           if default == defaults.CHAT_BUDGET else ""))(f)


def evictor_option(f, default: str = defaults.EVICTOR):
    return click.option("--evictor", default=default, show_default=True, type=click.Choice(sorted(EVICTORS)),
                        help="Which cells the speed budget keeps (docs/algorithms.md); snapkv-spans keeps whole "
                             "sentences.")(f)


def gate_option(f, default: str = defaults.GATE):
    return click.option(
        "--gate", "gate", default=default, show_default=True, type=click.Choice(list(GATE_MODES)),
        help="verify: evict, and keep the eviction only if the answer matches the full cache's; search: the "
             "same for every budget of --ladder, keeping the smallest that passes; page: evict when PAGE says it "
             "is safe; page+verify / page+search: both; always / never: force it.")(f)


def verify_tokens_option(f):
    return click.option(
        "--verify-tokens", "verify_tokens", default=VERIFY_CAP, show_default=True, type=click.IntRange(1, 256),
        help="verify / page+verify: the most answer tokens decoded from the full cache and checked under "
             "the evicted one before the eviction is committed (the check ends earlier when the answer "
             "does). Answers longer than this are checked only on their start; the tokens before the "
             "decision are decoded at full-cache speed.")(f)


def n_ctx_option(f, auto: bool = False):
    """--n-ctx. auto (chat, serve): no default number; the command sizes it (store/sizing.py) and gets None."""
    if auto:
        return click.option("--n-ctx", "n_ctx", default=None, type=click.IntRange(min=1),
                            help="Context size in tokens. Default: the largest of 4096, 8192, 16384, 32768 that the "
                                 "model was trained for and whose cache fits in 1/8 of the memory available "
                                 "(at least 4096).")(f)
    return click.option("--n-ctx", "n_ctx", default=defaults.N_CTX, show_default=True, type=click.IntRange(min=1),
                        help="Context size in tokens; longer prompts do not fit.")(f)


def threads_option(f):
    return click.option("--threads", default=defaults.THREADS, show_default=True, type=click.IntRange(min=1))(f)


def json_option(help: str = "print one JSON line"):
    return click.option("--json", "as_json", is_flag=True, help=help)


class GpuLayersType(click.ParamType):
    """--n-gpu-layers: a whole number of layers (0 or more) or 'all'."""

    name = "N|all"

    def convert(self, value, param, ctx):
        from page_local.native.runtime import parse_n_gpu_layers

        if value is None or isinstance(value, int):
            return value
        try:
            return parse_n_gpu_layers(value)
        except ValueError:
            self.fail(f"{value!r} is neither a number of layers (0 or more) nor 'all'", param, ctx)


def _rpc(ctx: click.Context, param, value) -> tuple[str, ...]:
    """--rpc resolved here, at the edge: the flag, else $PAGE_LOCAL_RPC, else () (local only); the command
    gets the servers as its `rpc` value and passes it down (the environment is not written)."""
    from page_local.native.rpc import default_rpc, parse_rpc

    try:
        return parse_rpc(value, "--rpc") if value is not None else default_rpc()
    except ValueError as e:
        raise click.BadParameter(str(e).removeprefix("--rpc: "), ctx=ctx, param=param) from None


def rpc_option(f):
    return click.option(
        "--rpc", "rpc", metavar="HOST:PORT[,...]", default=None, callback=_rpc,
        help="Put layers and their KV cache on ggml-rpc-server processes as well (docs/rpc.md); default: "
             "$PAGE_LOCAL_RPC. RPC is unauthenticated and unencrypted: loopback or a trusted LAN only.")(f)


def attention_options(f):
    """--flash-attn and --cache-type (engine/attention.py), resolved here, at the edge, into one value: the
    command gets `attention_settings` (an AttentionSettings: each flag, else $PAGE_LOCAL_FLASH_ATTN /
    $PAGE_LOCAL_CACHE_TYPE, else auto / f16) in their place, and passes it down (the environment is not
    written)."""
    from page_local.defaults import CACHE_TYPES, FLASH_ATTN

    @functools.wraps(f)
    def command(*args, flash_attn: str | None, cache_type: str | None, **kwargs):
        from page_local.engine.attention import from_environment

        try:
            settings = from_environment(flash_attn, cache_type)
        except ValueError as e:  # a bad $PAGE_LOCAL_FLASH_ATTN / $PAGE_LOCAL_CACHE_TYPE: the message names it
            raise click.UsageError(str(e)) from None
        return f(*args, attention_settings=settings, **kwargs)

    command = click.option(
        "--cache-type", "cache_type", type=click.Choice(CACHE_TYPES), default=None,
        help="The KV cache's type (K and V). q8_0 / q4_0 hold 1.9x / 3.6x the cells of f16 in the same memory "
             "and need flash attention (llama.cpp quantizes V only on that path). Default: $PAGE_LOCAL_CACHE_TYPE, "
             "else f16.")(command)
    return click.option(
        "--flash-attn", "flash_attn", type=click.Choice(FLASH_ATTN), default=None,
        help="The attention path. auto: what `page-local tune` measured on this machine, else on (on the CPU "
             "with page-local's decode kernel, faster than the plain path where measured). Default: "
             "$PAGE_LOCAL_FLASH_ATTN, else auto.")(command)


def n_gpu_layers_option(f):
    """--n-gpu-layers, and --rpc (remote devices are offload targets as GPUs are): the command gets
    `n_gpu_layers` and `rpc` (rpc_option)."""
    f = rpc_option(f)
    return click.option(
        "--n-gpu-layers", "n_gpu_layers", type=GpuLayersType(), default=None, metavar="N|all",
        help="Layers to offload to the GPU (and the --rpc servers): a count or 'all'. Default: "
             "$PAGE_LOCAL_N_GPU_LAYERS, else all when the library has a GPU backend and a device (a CUDA or "
             "Metal build) or --rpc is given, else 0.")(f)


def load_options(f):
    """--n-gpu-layers, --rpc, --flash-attn, --cache-type and --allow-long-context, for commands that load a
    model into an Engine: the command gets n_gpu_layers, rpc, attention_settings and allow_long_context."""
    f = attention_options(f)
    f = click.option(
        "--allow-long-context", "allow_long_context", is_flag=True,
        help="Run with an --n-ctx larger than the model's trained context (refused otherwise: answers past "
             "the trained length are unreliable).")(f)
    return n_gpu_layers_option(f)


def context_options(f, auto_n_ctx: bool = False):
    """--n-ctx, --threads, --n-gpu-layers and --allow-long-context: what loading a model into a context takes."""
    return n_ctx_option(threads_option(load_options(f)), auto=auto_n_ctx)


def disk_cache_options(f):
    """--kv-cache/--no-kv-cache, --kv-cache-dir, --kv-cache-max-gb as one `disk_cache` argument: a
    store.diskcache.DiskCache, or False (a long prompt read once is kept on disk: engine/prefixes.py)."""
    @functools.wraps(f)
    def command(*args, kv_cache: bool, kv_cache_dir: str | None, kv_cache_max_gb: float | None, **kwargs):
        disk_cache = False
        if kv_cache:
            from page_local.store.diskcache import DiskCache

            with one_line_errors():
                disk_cache = DiskCache(kv_cache_dir, None if kv_cache_max_gb is None else int(kv_cache_max_gb * 2**30))
        return f(*args, disk_cache=disk_cache, **kwargs)

    command = click.option("--kv-cache-max-gb", "kv_cache_max_gb", default=None, type=click.FloatRange(min=0.01),
                           help="the disk cache's size limit; the least recently used prompts go first "
                                "(default: a tenth of the free disk, 1-64 GB)")(command)
    command = click.option("--kv-cache-dir", "kv_cache_dir", default=None, type=click.Path(file_okay=False),
                           help="the disk cache's folder (default: $PAGE_LOCAL_KV_CACHE_DIR, else the user cache "
                                "folder's page-local/kv)")(command)
    return click.option("--kv-cache/--no-kv-cache", "kv_cache", default=True, show_default=True,
                        help="keep a prompt of 1 024 tokens or more on disk once read: a later conversation that "
                             "starts with it (after a restart, in a new chat) reads only the rest "
                             "(`page-local cache` lists them)")(command)


def on_full_option(f):
    return click.option(
        "--on-full", "on_full", default=defaults.ON_FULL, show_default=True, type=click.Choice(["evict", "refuse"]),
        help="A turn that does not fit n_ctx: evict earlier cells to make room (a message longer than the "
             "context is read in parts), or refuse it.")(f)


def engine_options(f, budget=defaults.BUDGET, auto_n_ctx: bool = False, evictor: str = defaults.EVICTOR,
                   gate: str = defaults.GATE):
    """What every command that answers prompts takes: budget, evictor, gate, verify tokens, on-full, then
    context_options (in --help in this order)."""
    return budget_option(evictor_option(gate_option(verify_tokens_option(on_full_option(
        context_options(f, auto_n_ctx))), gate), evictor), budget)


def _no_reread(ctx, param, value):
    if value:
        ctx.params["reread"] = "never"
    return value


def chat_engine_options(f):
    """engine_options for conversations (chat, serve): the budget, evictor, gate and ladder default to defaults.CHAT_*;
    --park, --reread."""
    f = click.option("--park/--no-park", default=defaults.CHAT_PARK, show_default=True,
                     help="The speed budget sets cells aside instead of deleting them: they stay in memory, out of "
                          "the attention, and come back before each message, which chooses again "
                          "(page_local/engine/parking.py). --no-park: the budget evicts for good.")(f)
    f = click.option("--park-from", "park_from", default=None, type=click.IntRange(min=0),
                     help="With --park: below this many cells the full cache is kept, where setting tokens aside "
                          "does not pay (default: from the model, on the CPU where the cells' K and V weigh an eighth of "
                          "its weights: 2048 on SmolLM2, 4864 on Qwen2.5-Coder-0.5B; page_local/engine/parking.py).")(f)
    f = click.option("--reread", "reread", type=click.Choice(defaults.REREADS), is_flag=False, flag_value="always",
                     default=defaults.CHAT_REREAD, show_default=True,
                     help="After a message too long for the context was cut to fit, whether a later message reads the "
                          "conversation again from the first deleted token, keeping what it asks about (a second "
                          "question about a long document), at the cost of that reading: 'words' when the sentence "
                          "its question's words meet best is one the cut deleted, 'always' (a bare --reread) on "
                          "every message, 'never' (or --no-reread) not (page_local/engine/room.py).")(f)
    f = click.option("--no-reread", "no_reread", is_flag=True, expose_value=False, callback=_no_reread,
                     help="The same as --reread never.")(f)
    f = ladder_option(f, defaults.CHAT_LADDER)
    return engine_options(f, defaults.CHAT_BUDGET, auto_n_ctx=True, evictor=defaults.CHAT_EVICTOR,
                          gate=defaults.CHAT_GATE)


# --- inputs ------------------------------------------------------------------------------------

def resolve_model(model: str | None, answers: str | None = None) -> Path:
    """--model (a name, a path, or None) -> a GGUF path (store.models.resolve); exit 1 for a model that is not
    installed, a name that matches none or several. answers: the command's name when what it does is read the
    model's answers (chat, run, serve, eval, calibrate): a synthetic benchmark model (store/synth.py) is refused
    there, with what to do instead."""
    with one_line_errors():
        path = models.resolve(model)
        if answers is not None:
            from page_local.store.synth import refuse_synthetic

            refuse_synthetic(path, answers)
        return path


def sized_n_ctx(path: Path, n_ctx: int | None, attention_settings, n_gpu_layers, rpc, slots: int = 1) -> tuple[int, str]:
    """chat's and serve's --n-ctx: the number given, else sized by memory and the model (store/sizing.py); and
    how it was chosen, in words."""
    if n_ctx is not None:
        return n_ctx, f"{n_ctx} (--n-ctx)"
    from page_local.native.runtime import check_gguf, default_n_gpu_layers
    from page_local.store.sizing import default_n_ctx

    gpu = (default_n_gpu_layers(bool(rpc)) if n_gpu_layers is None else n_gpu_layers) != 0
    cache = attention_settings.cache_type if attention_settings is not None else "f16"
    with one_line_errors():
        check_gguf(path)  # a missing or non-GGUF file is told as loading it would tell it
        return default_n_ctx(path, cache_type=cache, slots=slots, gpu=gpu)


def read_prompt(prompt: str | None, prompt_file: str | None) -> str:
    """Exactly one of --prompt / --prompt-file, as non-empty UTF-8 text (usage errors otherwise)."""
    if (prompt is None) == (prompt_file is None):
        raise click.UsageError("give exactly one of --prompt and --prompt-file")
    if prompt_file is not None:
        try:
            with open(prompt_file, encoding="utf-8") as f:
                prompt = f.read()
        except UnicodeDecodeError as e:
            raise click.BadParameter(f"{prompt_file} is not UTF-8 text ({e.reason} at byte {e.start})",
                                     param_hint="'--prompt-file'") from None
    if not prompt.strip():
        raise click.BadParameter("the prompt is empty", param_hint="'--prompt' / '--prompt-file'")
    return prompt


def prompt_options(f):
    f = click.option("--prompt-file", "prompt_file", type=click.Path(exists=True, dir_okay=False), default=None,
                     help="Read the prompt from a UTF-8 text file.")(f)
    return click.option("--prompt", "prompt", default=None, help="The prompt text.")(f)


def model_name(path: Path) -> str:
    """The model's general.name from its GGUF metadata, else the file's stem."""
    from page_local.store.gguf import gguf_metadata

    try:
        return str(gguf_metadata(path).get("general.name") or path.stem)
    except (OSError, ValueError):
        return path.stem


# --- output ------------------------------------------------------------------------------------

def console(stderr: bool = False):
    """A rich console on the current stdout/stderr; unbounded width when piped, so tables stay greppable."""
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    return Console(file=stream, highlight=False, width=None if stream.isatty() else 512)


def progress(console, *columns):
    """A rich progress display on `console`, shown only on a terminal (pipes and --json stay clean)."""
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn

    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), *columns,
                    console=console, transient=True, disable=not console.is_terminal)


@contextlib.contextmanager
def tuning_progress(console):
    """A callable for Engine(tune_progress=...): the first-use attention tuning's progress bar, started on
    its first report (nothing is shown when a tuning is stored), gone when the block ends."""
    state = {}

    def report(text: str, fraction: float) -> None:
        if "bar" not in state:
            state["bar"] = progress(console)
            state["bar"].start()
            state["task"] = state["bar"].add_task("", total=1.0)
            from page_local.engine.attention import autotune_budget

            console.print("measuring this machine's attention paths, once for this model and thread count "
                          f"(at most {autotune_budget():.0f} s; `page-local tune` redoes it, $PAGE_LOCAL_AUTOTUNE=off "
                          "skips it)", style="dim")
        state["bar"].update(state["task"], description=f"tuning: {text}", completed=fraction)

    try:
        yield report
    finally:
        if "bar" in state:
            state["bar"].stop()


class _EchoHandler(logging.Handler):
    """llama.cpp's records on the current stderr (click's, so that CliRunner captures it), one per line;
    records already quoted in a one-line error (page_local_reported) are skipped."""

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "page_local_reported", False):
            return
        try:
            level = {"DEBUG": "debug", "WARNING": "warning", "ERROR": "error", "CRITICAL": "error"}.get(
                record.levelname, "info")
            click.echo(f"llama.cpp {level}: {record.getMessage()}", err=True)
        except Exception:  # noqa: BLE001
            self.handleError(record)


def show_llama_log() -> None:
    """Show llama.cpp's warnings and errors on stderr (every line with PAGE_LOCAL_VERBOSE); idempotent."""
    from page_local.native.llama_log import LOGGER_NAME, verbose

    logger = logging.getLogger(LOGGER_NAME)
    if not any(isinstance(h, _EchoHandler) for h in logger.handlers):
        logger.addHandler(_EchoHandler())
    for h in logger.handlers:
        if isinstance(h, _EchoHandler):
            h.setLevel(logging.DEBUG if verbose() else logging.WARNING)
