"""What every `page-local` command shares: the --model option and its resolution, budget parsing,
reading a prompt, and one-line errors (exit codes: 0 ok, 2 usage, 1 runtime error)."""

from __future__ import annotations

import re
from pathlib import Path

import click

from . import models


def model_option(f):
    return click.option(
        "--model", "model", metavar="PATH|NAME", default=None,
        help="A GGUF file or a registered model name (see `page-local models`); "
             "default: $PAGE_LOCAL_MODEL or the embedded SmolLM2.")(f)


def verify_tokens_option(f):
    from .engine import VERIFY_M

    return click.option(
        "--verify-tokens", "verify_tokens", default=VERIFY_M, show_default=True, type=click.IntRange(1, 256),
        help="verify / page+verify: answer tokens decoded from the full cache and checked under the evicted "
             "one before the eviction is committed. Only the start of a longer answer is checked: raise it "
             "for long exact answers (IDs, code, numbers); the check costs one batch decode of this many "
             "tokens.")(f)


def fail(message: str, code: int) -> None:
    """One line on stderr and the exit code (1 runtime, 2 usage); never a traceback."""
    click.echo(f"Error: {' '.join(str(message).split())}", err=True)
    click.get_current_context().exit(code)


def runtime_errors() -> tuple[type[BaseException], ...]:
    """The exceptions reported as one line with exit code 1 (ValueError from input checks: 2)."""
    from .chat_template import ChatTemplateError  # a ValueError, but the model file is at fault
    from .engine import ContextFull, EngineBusy
    from .native import PageError
    from .runtime import DecodeError, ModelError

    return (ChatTemplateError, ContextFull, EngineBusy, ModelError, PageError, DecodeError, models.ModelNotInstalled,
            OSError)


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
