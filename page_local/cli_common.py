"""What every `page-local` command shares: the --model option and its resolution, the model-loading
options (--n-gpu-layers, --allow-long-context), budget parsing, reading a prompt, llama.cpp's log on
stderr, and one-line errors (exit codes: 0 ok, 2 usage, 1 runtime error)."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import click

from . import models


def model_option(f):
    return click.option(
        "--model", "model", metavar="PATH|NAME", default=None,
        help="A GGUF file or a registered model name (see `page-local models`); "
             "default: $PAGE_LOCAL_MODEL or the embedded SmolLM2.")(f)


class GpuLayersType(click.ParamType):
    """--n-gpu-layers: a whole number of layers (0 or more) or 'all'."""

    name = "N|all"

    def convert(self, value, param, ctx):
        from .runtime import parse_n_gpu_layers

        if value is None or isinstance(value, int):
            return value
        try:
            return parse_n_gpu_layers(value)
        except ValueError:
            self.fail(f"{value!r} is neither a number of layers (0 or more) nor 'all'", param, ctx)


def n_gpu_layers_option(f):
    return click.option(
        "--n-gpu-layers", "n_gpu_layers", type=GpuLayersType(), default=None, metavar="N|all",
        help="Layers to offload to the GPU: a count or 'all'. Default: $PAGE_LOCAL_N_GPU_LAYERS, else all "
             "when the library has a GPU backend and a device (a CUDA or Metal build), else 0.")(f)


def allow_long_context_option(f):
    return click.option(
        "--allow-long-context", "allow_long_context", is_flag=True,
        help="Run with an --n-ctx larger than the model's trained context (refused otherwise: answers past "
             "the trained length are unreliable).")(f)


def load_options(f):
    """--n-gpu-layers and --allow-long-context, for commands that load a model into an Engine."""
    return n_gpu_layers_option(allow_long_context_option(f))


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
    from .llama_log import LOGGER_NAME, verbose

    logger = logging.getLogger(LOGGER_NAME)
    if not any(isinstance(h, _EchoHandler) for h in logger.handlers):
        h = _EchoHandler()
        logger.addHandler(h)
    for h in logger.handlers:
        if isinstance(h, _EchoHandler):
            h.setLevel(logging.DEBUG if verbose() else logging.WARNING)


def verify_tokens_option(f):
    from .verify import VERIFY_CAP

    return click.option(
        "--verify-tokens", "verify_tokens", default=VERIFY_CAP, show_default=True, type=click.IntRange(1, 256),
        help="verify / page+verify: the most answer tokens decoded from the full cache and checked under "
             "the evicted one before the eviction is committed (the check ends earlier when the answer "
             "does). Answers longer than this are checked only on their start; the tokens before the "
             "decision are decoded at full-cache speed.")(f)


def fail(message: str, code: int) -> None:
    """One line on stderr and the exit code (1 runtime, 2 usage); never a traceback."""
    click.echo(f"Error: {' '.join(str(message).split())}", err=True)
    click.get_current_context().exit(code)


def runtime_errors() -> tuple[type[BaseException], ...]:
    """The exceptions reported as one line with exit code 1 (ValueError from input checks: 2)."""
    from .chat_template import ChatTemplateError  # a ValueError, but the model file is at fault
    from .engine import ContextFull, EngineBusy
    from .native import PageError
    from .runtime import ContextTooLong, DecodeError, ModelError

    return (ChatTemplateError, ContextFull, ContextTooLong, EngineBusy, ModelError, PageError, DecodeError,
            models.ModelNotInstalled, OSError)


def resolve_model(model: str | None) -> Path:
    """--model (a path, a registry name, or None) -> a GGUF path; exit 1 if it is not installed."""
    try:
        return models.resolve(model)
    except models.ModelNotInstalled as e:
        fail(str(e), 1)
    except ValueError as e:
        fail(str(e), 2)


def parse_budget(text: str) -> float | int:
    """'0.25' -> 0.25 (ratio of the positions), '1024' -> 1024 (absolute count); validated."""
    from .evictors.base import resolve_budget

    text = text.strip()
    try:
        value: float | int = int(text) if re.fullmatch(r"[+-]?\d+", text) else float(text)
    except ValueError:
        raise ValueError(f"budget {text!r} is neither a ratio like 0.25 nor a count like 1024") from None
    resolve_budget(value, 10_000)  # validation only (T is not known yet): ValueError says what is wrong
    return value


class BudgetType(click.ParamType):
    """A ratio with a decimal point ("0.25": keep a quarter) or an absolute count ("1024")."""

    name = "budget"

    def convert(self, value, param, ctx):
        if not isinstance(value, str):
            return value
        try:
            return parse_budget(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)


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
