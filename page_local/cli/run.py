"""`page-local run`: answer one prompt; the answer streams to stdout, what the cache went through to
stderr (or everything as one JSON object with --json). The prompt is a user message in the model's chat template
(as `ollama run` and llama-cli's conversation mode send it); --raw sends it as it is, a text to continue."""

from __future__ import annotations

import json

import click

from page_local import defaults
from page_local.engine import narrate
from page_local.cli.common import (
    console,
    disk_cache_options,
    engine_options,
    ladder_option,
    model_option,
    one_line_errors,
    prompt_options,
    read_prompt,
    resolve_model,
    tuning_progress,
)


@click.command("run")
@model_option
@prompt_options
@engine_options
@ladder_option
@disk_cache_options
@click.option("--max-tokens", default=defaults.MAX_TOKENS, show_default=True, type=click.IntRange(min=1))
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(0, 5), help="0 = greedy.")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(min=0))
@click.option("--raw", is_flag=True,
              help="Send the prompt as it is, a text to continue, without the model's chat template.")
@click.option("--json", "as_json", is_flag=True,
              help='print one JSON object {"text", "finish_reason", "decision", "tokens_per_s", "device", "attention"}')
def run_cmd(model, prompt, prompt_file, budget, evictor, gate, verify_tokens, on_full, n_ctx, threads, n_gpu_layers,
            rpc, attention_settings, allow_long_context, ladder, disk_cache, max_tokens, temperature, seed, raw, as_json):
    """Answer one prompt (a user message in the model's chat template; --raw: a text to continue); with --json,
    also what the gate and the evictor did."""
    prompt = read_prompt(prompt, prompt_file)
    path = resolve_model(model, answers="run")

    from page_local.chat.session import ChatSession
    from page_local.engine.engine import Engine, Sampling
    from page_local.native.runtime import describe_placement

    with one_line_errors():
        with tuning_progress(console(stderr=True)) as tune_progress:
            eng = Engine(path, n_ctx=n_ctx, budget=budget, evictor=evictor, gate=gate, threads=threads, seed=seed,
                         verify_tokens=verify_tokens, n_gpu_layers=n_gpu_layers, rpc=rpc,
                         attention_settings=attention_settings, on_full=on_full, ladder=ladder,
                         allow_long_context=allow_long_context, tune_progress=tune_progress, disk_cache=disk_cache)
        with eng:
            device = eng.placement
            for warning in (eng.profile_warning, eng.attention_warning):
                if warning:
                    click.echo(f"warning: {warning}", err=True)
            attention = eng.attention.to_dict()
            sampling = Sampling(temperature=temperature, seed=seed)
            stream = (eng.stream(prompt, max_tokens=max_tokens, sampling=sampling) if raw else
                      ChatSession(eng).send(prompt, max_tokens=max_tokens, sampling=sampling))
            for piece in stream:
                if not as_json:
                    click.echo(piece, nl=False)
            res = stream.result
    d = res.decision
    if as_json:
        click.echo(json.dumps({"text": res.text, "finish_reason": res.finish_reason, "decision": d.to_dict(),
                               "tokens_per_s": round(res.tokens_per_s, 2), "device": device,
                               "attention": attention}))
        return
    click.echo("")
    if d.gate_note:
        click.echo(f"warning: {d.gate_note}", err=True)
    click.echo(f"[{narrate.summary(res)}; {describe_placement(device)}]", err=True)
