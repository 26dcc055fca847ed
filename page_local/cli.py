"""`page-local` command line: a thin shell over the engine (exit codes: 0 ok, 2 usage, 1 runtime error)."""

from __future__ import annotations

import json
import sys

import click

from . import models


def _model_option(f):
    return click.option("--model", "model", type=click.Path(dir_okay=False), default=None,
                        help="GGUF file (default: $PAGE_LOCAL_MODEL or the embedded SmolLM2).")(f)


def _resolve_model(path):
    try:
        return path or models.default_model_path()
    except models.ModelNotInstalled as e:
        raise click.ClickException(str(e)) from e


@click.group()
@click.version_option(package_name="page-local")
def main():
    """page-local: KV-cache eviction for llama.cpp, gated per input by PAGE."""


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


if __name__ == "__main__":
    sys.exit(main())
