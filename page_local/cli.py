"""`page-local` command line: a thin shell over the engine (exit codes: 0 ok, 2 usage, 1 runtime error)."""

from __future__ import annotations

import json
import sys

import click

from . import models
from .engine import GATE_MODES
from .evictors import EVICTORS as _EVICTORS

_EVICTOR_NAMES = list(_EVICTORS)


def _model_option(f):
    return click.option("--model", "model", type=click.Path(dir_okay=False), default=None,
                        help="GGUF file (default: $PAGE_LOCAL_MODEL or the embedded SmolLM2).")(f)


def _resolve_model(path):
    try:
        return models.resolve(path)
    except models.ModelNotInstalled as e:
        raise click.ClickException(str(e)) from e


class BudgetType(click.ParamType):
    """A ratio with a decimal point ("0.25": keep a quarter) or an absolute count ("1024")."""

    name = "budget"

    def convert(self, value, param, ctx):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            budget = value
        else:
            text = str(value).strip()
            try:
                budget = int(text) if text.lstrip("+-").isdigit() else float(text)
            except ValueError:
                self.fail(f"{value!r} is neither a ratio like 0.25 nor a count like 1024", param, ctx)
        from .evictors.base import resolve_budget

        try:
            resolve_budget(budget, 10_000)  # validation only: T is not known yet
        except ValueError as e:
            self.fail(str(e), param, ctx)
        return budget


def _fail(message: str, code: int) -> None:
    """One line on stderr and the exit code (1 runtime, 2 usage); never a traceback."""
    click.echo(f"Error: {' '.join(str(message).split())}", err=True)
    click.get_current_context().exit(code)


def _runtime_errors():
    """The exceptions `run` reports as one line with exit code 1 (ValueError from input checks: 2)."""
    from .engine import ContextFull, EngineBusy
    from .native import PageError
    from .runtime import DecodeError, ModelError

    return (ContextFull, EngineBusy, ModelError, PageError, DecodeError, models.ModelNotInstalled, OSError)


@click.group()
@click.version_option(package_name="page-local")
def main():
    """page-local: KV-cache eviction for llama.cpp, gated per input by PAGE."""


@main.command("run")
@_model_option
@click.option("--prompt", "prompt", default=None, help="The prompt text.")
@click.option("--prompt-file", "prompt_file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Read the prompt from a UTF-8 text file.")
@click.option("--budget", default="0.25", show_default=True, type=BudgetType(),
              help="Kept positions when the gate opens: a ratio (0.25) or a count (1024).")
@click.option("--evictor", default="snapkv", show_default=True, type=click.Choice(sorted(_EVICTOR_NAMES)))
@click.option("--gate", "gate", default="page", show_default=True, type=click.Choice(list(GATE_MODES)),
              help="page: evict when PAGE says it is safe; always / never: force it.")
@click.option("--max-tokens", default=256, show_default=True, type=click.IntRange(min=1))
@click.option("--n-ctx", default=4096, show_default=True, type=click.IntRange(min=1))
@click.option("--threads", default=2, show_default=True, type=click.IntRange(min=1))
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(0, 5),
              help="0 = greedy.")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(min=0))
@click.option("--json", "as_json", is_flag=True,
              help='print one JSON object {"text", "finish_reason", "decision", "tokens_per_s"}')
def run(model, prompt, prompt_file, budget, evictor, gate, max_tokens, n_ctx, threads, temperature, seed,
        as_json):
    """Answer one prompt; with --json, also what the gate and the evictor did."""
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

    from .engine import Engine, Sampling

    runtime_errors = _runtime_errors()
    try:
        with Engine(_resolve_model(model), n_ctx=n_ctx, budget=budget, evictor=evictor, gate=gate,
                    threads=threads, seed=seed) as eng:
            if eng.profile_warning:
                click.echo(f"warning: {eng.profile_warning}", err=True)
            sampling = Sampling(temperature=temperature, seed=seed)
            for piece in eng.stream(prompt, max_tokens=max_tokens, sampling=sampling):
                if not as_json:
                    click.echo(piece, nl=False)
            res = eng.last_result
    except runtime_errors as e:
        _fail(str(e), 1)
    except ValueError as e:  # the engine's input checks
        _fail(str(e), 2)
    d = res.decision
    if as_json:
        click.echo(json.dumps({"text": res.text, "finish_reason": res.finish_reason, "decision": d.to_dict(),
                               "tokens_per_s": round(res.tokens_per_s, 2)}))
    else:
        click.echo("")
        D = "n/a" if d.D is None else f"{d.D:.4f}"
        click.echo(f"[gate {'open' if d.open else 'closed'} (D = {D}, {d.rule}); kept {d.kept} of {d.T} "
                   f"positions; {len(res.tokens)} tokens at {res.tokens_per_s:.1f} tok/s; "
                   f"finish: {res.finish_reason}]", err=True)


@main.group()
def bench():
    """Benchmarks (run them alone: they print ratios measured side by side)."""


@bench.command("probe")
@_model_option
@click.option("--tokens", default=4096, show_default=True, type=click.IntRange(min=33))
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(min=1))
@click.option("--threads", default=2, show_default=True, type=click.IntRange(min=1))
@click.option("--json", "as_json", is_flag=True, help="print one JSON line")
def bench_probe(model, tokens, repeats, threads, as_json):
    """Prefill time with the probe armed on the last 32 positions vs unarmed (target ratio <= 1.05)."""
    from .bench import probe_overhead

    res = probe_overhead(_resolve_model(model), tokens=tokens, repeats=repeats, threads=threads)
    if as_json:
        click.echo(json.dumps(res))
    else:
        click.echo(f"{tokens}-token prefill: unarmed {res['unarmed_s']:.3f} s, armed {res['armed_s']:.3f} s "
                   f"(median of {repeats}), ratio {res['ratio']:.3f}")


@bench.command("decode")
@_model_option
@click.option("--tokens", default=8192, show_default=True, type=click.IntRange(min=33))
@click.option("--budget", default="0.25", show_default=True, type=BudgetType())
@click.option("--new-tokens", default=64, show_default=True, type=click.IntRange(min=1))
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(min=1))
@click.option("--threads", default=2, show_default=True, type=click.IntRange(min=1))
@click.option("--json", "as_json", is_flag=True, help="print one JSON line")
def bench_decode(model, tokens, budget, new_tokens, repeats, threads, as_json):
    """Decode tok/s after eviction to the budget (SnapKV, gate forced open) vs the full cache."""
    from .bench import decode_speedup

    runtime_errors = _runtime_errors()
    try:
        res = decode_speedup(_resolve_model(model), tokens=tokens, budget=budget, new_tokens=new_tokens,
                             repeats=repeats, threads=threads)
    except runtime_errors as e:
        _fail(str(e), 1)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    if as_json:
        click.echo(json.dumps(res))
    else:
        click.echo(f"{tokens}-token prompt, {new_tokens} new tokens: full cache {res['full_tok_s']:.1f} tok/s, "
                   f"evicted to {res['kept']} {res['evicted_tok_s']:.1f} tok/s (median of {repeats}), "
                   f"speedup {res['speedup']:.3f}; gate decision {res['gate_ms']:.2f} ms")


@bench.command("verify")
@_model_option
@click.option("--tokens", default=2048, show_default=True, type=click.IntRange(min=256))
@click.option("--m", "m", default=16, show_default=True, type=click.IntRange(1, 256))
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(min=1))
@click.option("--threads", default=2, show_default=True, type=click.IntRange(min=1))
@click.option("--json", "as_json", is_flag=True, help="print one JSON line")
def bench_verify(model, tokens, m, repeats, threads, as_json):
    """Self-verification's extra decode as a fraction of the prefill (target <= 0.05)."""
    from .bench import verify_cost

    try:
        res = verify_cost(_resolve_model(model), tokens=tokens, m=m, repeats=repeats, threads=threads)
    except (*_runtime_errors(), RuntimeError) as e:
        _fail(str(e), 1)
    if as_json:
        click.echo(json.dumps(res))
    else:
        click.echo(f"{res['tokens']}-token prompt: verification {res['verify_ms']:.1f} ms, prefill "
                   f"{res['prefill_ms']:.0f} ms, ratio {res['ratio']:.4f} (median of {repeats})")


@bench.command("memory")
@_model_option
@click.option("--tokens", default=8192, show_default=True, type=click.IntRange(min=256))
@click.option("--threads", default=2, show_default=True, type=click.IntRange(min=1))
@click.option("--json", "as_json", is_flag=True, help="print one JSON line")
def bench_memory(model, tokens, threads, as_json):
    """Peak RSS of page-local vs stock llama-cpp-python on the same prompt (target ratio <= 1.05)."""
    from .bench import peak_memory

    try:
        res = peak_memory(_resolve_model(model), tokens=tokens, threads=threads)
    except (*_runtime_errors(), RuntimeError) as e:
        _fail(str(e), 1)
    if as_json:
        click.echo(json.dumps(res))
    else:
        click.echo(f"peak RSS: page-local {res['page_local_peak_rss_mb']:.0f} MB, llama-cpp-python "
                   f"{res['stock_peak_rss_mb']:.0f} MB, ratio {res['ratio']:.3f}; free cells in n_ctx "
                   f"{res['n_ctx']}: {res['free_cells_full_cache']} full, {res['free_cells_after_eviction']} after eviction")


def _register() -> None:
    from .repl import chat

    main.add_command(chat)
    from .cli_eval import register_eval; register_eval(main)  # noqa: E702
    from .cli_tools import register_tools; register_tools(main)  # noqa: E702


_register()

if __name__ == "__main__":
    sys.exit(main())
