"""`page-local chat`: the REPL (cli/repl.py) on an Engine, reading a terminal with prompt_toolkit or
plain lines from a pipe."""

from __future__ import annotations

import sys

import click
from rich.console import Console

from page_local.cli.common import (chat_engine_options, disk_cache_options, model_option, one_line_errors,
                                   resolve_model,
                                   show_llama_log, sized_n_ctx, tuning_progress)
from page_local.cli.repl import MAX_TOKENS, Repl, run_loop, stdin_reader, terminal_reader


@click.command("chat")
@model_option
@chat_engine_options
@disk_cache_options
@click.option("--system", default=None, help="system prompt")
@click.option("--max-tokens", default=MAX_TOKENS, show_default=True, type=click.IntRange(min=1))
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(0, 5), help="0 = greedy")
def chat_cmd(model, reread, park, park_from, budget, evictor, gate, verify_tokens, on_full, n_ctx, threads, n_gpu_layers, rpc,
             attention_settings, allow_long_context, ladder, disk_cache, system, max_tokens, temperature):
    """Chat with a local model; what the cache went through is shown after each answer (/why explains it)."""
    show_llama_log()  # also when the command is invoked on its own, outside the `page-local` group
    path = resolve_model(model, answers="chat")
    n_ctx, _ = sized_n_ctx(path, n_ctx, attention_settings, n_gpu_layers, rpc)

    from page_local.engine import Engine

    with one_line_errors(), tuning_progress(Console(stderr=True)) as tune_progress:
        engine = Engine(path, n_ctx=n_ctx, budget=budget, evictor=evictor, gate=gate, threads=threads,
                        verify_tokens=verify_tokens, n_gpu_layers=n_gpu_layers, rpc=rpc,
                        attention_settings=attention_settings, on_full=on_full, ladder=ladder,
                        allow_long_context=allow_long_context, tune_progress=tune_progress, park=park, reread=reread,
                        disk_cache=disk_cache,
                        **({} if park_from is None else {"park_from": park_from}))
    with engine:
        with one_line_errors():  # a model without a usable chat template
            repl = Repl(engine, Console(), system=system, max_tokens=max_tokens, temperature=temperature)
        tty = sys.stdin.isatty() and sys.stdout.isatty()
        repl.banner(multiline_hint=tty)
        run_loop(repl, terminal_reader() if tty else stdin_reader)
