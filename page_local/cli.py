"""`page-local` command line: a thin shell over the engine (exit codes: 0 ok, 2 usage, 1 runtime error)."""

from __future__ import annotations

import json
import sys

import click

from .cli_common import (BudgetType, fail, load_options, model_option, n_gpu_layers_option, read_prompt,
                         resolve_model, runtime_errors, show_llama_log, verify_tokens_option)
from .engine import GATE_MODES
from .verify import VERIFY_CAP, describe
from .evictors import EVICTORS as _EVICTORS

_EVICTOR_NAMES = list(_EVICTORS)


@click.group()
@click.version_option(package_name="page-local")
def main():
    """page-local: KV-cache eviction for llama.cpp, gated per input by PAGE."""
    show_llama_log()


@main.command("run")
@model_option
@click.option("--prompt", "prompt", default=None, help="The prompt text.")
@click.option("--prompt-file", "prompt_file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Read the prompt from a UTF-8 text file.")
@click.option("--budget", default="0.25", show_default=True, type=BudgetType(),
              help="Kept positions when the gate opens: a ratio (0.25) or a count (1024).")
@click.option("--evictor", default="snapkv", show_default=True, type=click.Choice(sorted(_EVICTOR_NAMES)))
@click.option("--gate", "gate", default="verify", show_default=True, type=click.Choice(list(GATE_MODES)),
              help="verify: evict, and keep the eviction only if the answer's start matches the full cache's; "
                   "page: evict when PAGE says it is safe; always / never: force it.")
@verify_tokens_option
@click.option("--max-tokens", default=256, show_default=True, type=click.IntRange(min=1))
@click.option("--n-ctx", default=4096, show_default=True, type=click.IntRange(min=1))
@click.option("--threads", default=2, show_default=True, type=click.IntRange(min=1))
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(0, 5),
              help="0 = greedy.")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(min=0))
@load_options
@click.option("--json", "as_json", is_flag=True,
              help='print one JSON object {"text", "finish_reason", "decision", "tokens_per_s", "device"}')
def run(model, prompt, prompt_file, budget, evictor, gate, verify_tokens, max_tokens, n_ctx, threads, temperature,
        seed, n_gpu_layers, allow_long_context, as_json):
    """Answer one prompt; with --json, also what the gate and the evictor did."""
    prompt = read_prompt(prompt, prompt_file)

    from .engine import Engine, Sampling
    from .runtime import describe_placement

    try:
        with Engine(resolve_model(model), n_ctx=n_ctx, budget=budget, evictor=evictor, gate=gate,
                    threads=threads, seed=seed, verify_tokens=verify_tokens, n_gpu_layers=n_gpu_layers,
                    allow_long_context=allow_long_context) as eng:
            device = eng.placement
            if eng.profile_warning:
                click.echo(f"warning: {eng.profile_warning}", err=True)
            sampling = Sampling(temperature=temperature, seed=seed)
            for piece in eng.stream(prompt, max_tokens=max_tokens, sampling=sampling):
                if not as_json:
                    click.echo(piece, nl=False)
            res = eng.last_result
    except runtime_errors() as e:
        fail(str(e), 1)
    except ValueError as e:  # the engine's input checks
        fail(str(e), 2)
    d = res.decision
    if as_json:
        click.echo(json.dumps({"text": res.text, "finish_reason": res.finish_reason, "decision": d.to_dict(),
                               "tokens_per_s": round(res.tokens_per_s, 2), "device": device}))
    else:
        click.echo("")
        if d.gate_note:
            click.echo(f"warning: {d.gate_note}", err=True)
        D = "n/a" if d.D is None else f"{d.D:.4f}"
        if d.gate_mode in ("verify", "page+verify") and d.verify_score is not None and d.verify_m:
            span = f"{d.verify_m} tokens" + (" and the answer's end" if d.verify_until == "end" else "")
            what = (f"verify {'committed' if d.evicted else 'kept the full cache'} "
                    f"({describe(d.verify_rule, d.verify_score, d.verify_threshold)} over {span}, D = {D})")
        elif d.gate_mode in ("verify", "page+verify") and d.open and d.T <= d.B:
            what = f"verify: nothing to evict (T = {d.T} <= B = {d.B}, D = {D})"
        else:
            what = f"gate {'open' if d.open else 'closed'} (D = {D}, {d.rule})"
        click.echo(f"[{what}; kept {d.kept} of {d.T} positions; {len(res.tokens)} tokens at "
                   f"{res.tokens_per_s:.1f} tok/s; finish: {res.finish_reason}; {describe_placement(device)}]",
                   err=True)


@main.group()
def bench():
    """Benchmarks (run them alone: they print ratios measured side by side)."""


def _bench(as_json: bool, run, describe) -> None:
    """Run a benchmark: one JSON line with --json, else describe(result); one-line errors."""
    try:
        res = run()
    except (*runtime_errors(), RuntimeError) as e:
        fail(str(e), 1)
    except ValueError as e:
        fail(str(e), 2)
    click.echo(json.dumps(res) if as_json else describe(res))


def _json_option(f):
    return click.option("--json", "as_json", is_flag=True, help="print one JSON line")(f)


def _threads_option(f):
    return click.option("--threads", default=2, show_default=True, type=click.IntRange(min=1))(f)


@bench.command("probe")
@model_option
@click.option("--tokens", default=4096, show_default=True, type=click.IntRange(min=33))
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(min=1))
@_threads_option
@n_gpu_layers_option
@_json_option
def bench_probe(model, tokens, repeats, threads, n_gpu_layers, as_json):
    """Prefill time with the probe armed on the last 32 positions vs unarmed (target ratio <= 1.05)."""
    from .bench import probe_overhead

    from .runtime import describe_placement

    _bench(as_json, lambda: probe_overhead(resolve_model(model), tokens=tokens, repeats=repeats, threads=threads,
                                           n_gpu_layers=n_gpu_layers),
           lambda r: f"{tokens}-token prefill: unarmed {r['unarmed_s']:.3f} s, armed {r['armed_s']:.3f} s "
                     f"(median of {repeats}), ratio {r['ratio']:.3f}; {describe_placement(r['device'])}")


@bench.command("decode")
@model_option
@click.option("--tokens", default=8192, show_default=True, type=click.IntRange(min=33))
@click.option("--budget", default="0.25", show_default=True, type=BudgetType())
@click.option("--new-tokens", default=64, show_default=True, type=click.IntRange(min=1))
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(min=1))
@_threads_option
@n_gpu_layers_option
@_json_option
def bench_decode(model, tokens, budget, new_tokens, repeats, threads, n_gpu_layers, as_json):
    """Decode tok/s after eviction to the budget (SnapKV, gate forced open) vs the full cache."""
    from .bench import decode_speedup
    from .runtime import describe_placement

    _bench(as_json, lambda: decode_speedup(resolve_model(model), tokens=tokens, budget=budget,
                                           new_tokens=new_tokens, repeats=repeats, threads=threads,
                                           n_gpu_layers=n_gpu_layers),
           lambda r: f"{tokens}-token prompt, {new_tokens} new tokens: full cache {r['full_tok_s']:.1f} tok/s, "
                     f"evicted to {r['kept']} {r['evicted_tok_s']:.1f} tok/s (median of {repeats}), "
                     f"speedup {r['speedup']:.3f}; gate decision {r['gate_ms']:.2f} ms; "
                     f"{describe_placement(r['device'])}")


@bench.command("verify")
@model_option
@click.option("--tokens", default=2048, show_default=True, type=click.IntRange(min=256))
@click.option("--m", "m", default=VERIFY_CAP, show_default=True, type=click.IntRange(1, 256),
              help="verify's cap: the answer is checked up to its end or this many tokens.")
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(min=1))
@click.option("--prompt", "prompt", default="needle", show_default=True, type=click.Choice(["needle", "random"]),
              help="needle: a short answer (the check ends with it); random: random tokens, the check runs to --m.")
@_threads_option
@n_gpu_layers_option
@_json_option
def bench_verify(model, tokens, m, repeats, prompt, threads, n_gpu_layers, as_json):
    """Self-verification's extra decode as a fraction of the prefill (target <= 0.05)."""
    from .bench import verify_cost

    _bench(as_json, lambda: verify_cost(resolve_model(model), tokens=tokens, m=m, repeats=repeats, threads=threads,
                                        prompt=prompt, n_gpu_layers=n_gpu_layers),
           lambda r: f"{r['tokens']}-token prompt: verification of {r['m_checked']} tokens {r['verify_ms']:.1f} ms, prefill "
                     f"{r['prefill_ms']:.0f} ms, ratio {r['ratio']:.4f} (median of {repeats})")


@bench.command("lorekv")
@model_option
@click.option("--tokens", default=2048, show_default=True, type=click.IntRange(min=256))
@click.option("--budget", default="0.25", show_default=True, type=BudgetType())
@click.option("--futures", default=4, show_default=True, type=click.IntRange(1, 8))
@click.option("--lookahead-tokens", default=32, show_default=True, type=click.IntRange(1, 512))
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(min=1))
@_threads_option
@n_gpu_layers_option
@_json_option
def bench_lorekv(model, tokens, budget, futures, lookahead_tokens, repeats, threads, n_gpu_layers, as_json):
    """LORE-KV's one-time cost (prompt to eviction) as a ratio to SnapKV's (paper: 1.46-2.77x)."""
    from .bench import lorekv_overhead

    _bench(as_json, lambda: lorekv_overhead(resolve_model(model), tokens=tokens, budget=budget, futures=futures,
                                            lookahead_tokens=lookahead_tokens, repeats=repeats, threads=threads,
                                            n_gpu_layers=n_gpu_layers),
           lambda r: f"{r['tokens']}-token prompt to eviction: SnapKV {r['snapkv_ms']:.0f} ms, LORE-KV "
                     f"{r['lorekv_ms']:.0f} ms ({r['futures']} futures x {r['lookahead_tokens']} tokens: "
                     f"{r['lookahead_ms']:.0f} ms), ratio {r['ratio']:.2f} (median of {repeats})")


@bench.command("memory")
@model_option
@click.option("--tokens", default=8192, show_default=True, type=click.IntRange(min=256))
@click.option("--compact/--no-compact", default=True, show_default=True,
              help="compact the cache after eviction, as the engine does by default")
@_threads_option
@n_gpu_layers_option
@_json_option
def bench_memory(model, tokens, compact, threads, n_gpu_layers, as_json):
    """Peak RSS of page-local vs stock llama-cpp-python on the same prompt (target ratio <= 1.05)."""
    from .bench import peak_memory

    _bench(as_json, lambda: peak_memory(resolve_model(model), tokens=tokens, threads=threads, compact=compact,
                                        n_gpu_layers=n_gpu_layers),
           lambda r: f"peak RSS: page-local {r['page_local_peak_rss_mb']:.0f} MB, llama-cpp-python "
                     f"{r['stock_peak_rss_mb']:.0f} MB, ratio {r['ratio']:.3f}; free cells in n_ctx {r['n_ctx']}: "
                     f"{r['free_cells_full_cache']} full, {r['free_cells_after_eviction']} after eviction")


@bench.command("peer")
@model_option
@click.option("--tokens", default=2048, show_default=True, type=click.IntRange(min=256),
              help="Prompt length target (chat template included), as `eval run --length`.")
@click.option("--budget", default=0.25, show_default=True, type=click.FloatRange(0, 1, min_open=True, max_open=True),
              help="Kept ratio; kvpress gets compression_ratio = 1 - budget.")
@click.option("--n", "n", default=20, show_default=True, type=click.IntRange(min=1), help="Needle prompts.")
@click.option("--gen", default=32, show_default=True, type=click.IntRange(min=1), help="Greedy tokens per prompt.")
@click.option("--seed", default=42, show_default=True, type=click.IntRange(min=0))
@click.option("--kvpress-window", default=None, type=click.IntRange(min=1),
              help="SnapKVPress window_size (default: kvpress's, 64; page-local's is 32).")
@click.option("--kvpress-kernel", default=None, type=click.IntRange(min=1),
              help="SnapKVPress kernel_size, odd (default: kvpress's, 5; 1 = no pooling, as page-local).")
@_threads_option
@n_gpu_layers_option
@_json_option
def bench_peer(model, tokens, budget, n, gen, seed, kvpress_window, kvpress_kernel, threads, n_gpu_layers, as_json):
    """page-local vs NVIDIA kvpress (SnapKVPress, PyTorch) on the same GGUF, budget and needle prompts:
    time per prompt and accuracy. Needs the optional extra: pip install 'page-local[peer]'."""
    from .bench_peer import describe, peer_benchmark

    path = resolve_model(model)
    _bench(as_json, lambda: peer_benchmark(path, tokens=tokens, budget=budget, n=n, gen=gen, threads=threads,
                                           seed=seed, kvpress_window=kvpress_window, kvpress_kernel=kvpress_kernel,
                                           progress=lambda m: click.echo(m, err=True), n_gpu_layers=n_gpu_layers),
           describe)


def _register() -> None:
    from .repl import chat

    main.add_command(chat)
    from .cli_eval import register_eval; register_eval(main)  # noqa: E702
    from .cli_tools import register_tools; register_tools(main)  # noqa: E702


_register()

if __name__ == "__main__":
    sys.exit(main())
