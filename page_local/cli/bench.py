"""`page-local bench`: benchmarks that print ratios measured side by side in one run (run them alone on
the machine); --json prints one JSON line, whose fields tests/test_cli.py pins at a tiny size."""

from __future__ import annotations

import json

import click

from page_local import defaults
from page_local.cli.common import (
    BudgetType,
    LadderType,
    attention_options,
    evictor_option,
    fail,
    gate_option,
    json_option,
    ladder_option,
    model_option,
    n_gpu_layers_option,
    one_line_errors,
    resolve_model,
    threads_option,
    verify_tokens_option,
)
from page_local.verify import VERIFY_CAP


@click.group("bench")
def bench_group():
    """Benchmarks (run them alone: they print ratios measured side by side)."""


# Every benchmark takes --n-gpu-layers, --rpc, --flash-attn and --cache-type (n_gpu_layers_option,
# attention_options): its command gets them as `load` (n_gpu_layers, rpc, attention_settings, resolved by the
# options) and passes them on as they are.

def _bench(as_json: bool, run, describe) -> None:
    """Run a benchmark: one JSON line with --json, else describe(result); one-line errors."""
    with one_line_errors():
        try:
            res = run()
        except RuntimeError as e:  # bench.speed's "this run measured nothing" (e.g. the answer ended at once)
            fail(str(e), 1)
    click.echo(json.dumps(res) if as_json else describe(res))


@bench_group.command("probe")
@model_option
@click.option("--tokens", default=4096, show_default=True, type=click.IntRange(min=33))
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(min=1))
@threads_option
@n_gpu_layers_option
@attention_options
@json_option()
def bench_probe(model, tokens, repeats, threads, as_json, **load):
    """Prefill time with the probe armed on the last 32 positions vs unarmed (target ratio <= 1.05)."""
    from page_local.bench.speed import probe_overhead
    from page_local.native.runtime import describe_placement

    path = resolve_model(model)
    _bench(as_json, lambda: probe_overhead(path, tokens=tokens, repeats=repeats, threads=threads, **load),
           lambda r: f"{tokens}-token prefill: unarmed {r['unarmed_s']:.3f} s, armed {r['armed_s']:.3f} s "
                     f"(median of {repeats}), ratio {r['ratio']:.3f}; {describe_placement(r['device'])}")


@bench_group.command("decode")
@model_option
@click.option("--tokens", default=8192, show_default=True, type=click.IntRange(min=33))
@click.option("--budget", default=str(defaults.BUDGET), show_default=True, type=BudgetType())
@click.option("--new-tokens", default=64, show_default=True, type=click.IntRange(min=1))
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(min=1))
@click.option("--peer-bin", default=None, type=click.Path(file_okay=False),
              help="folder with stock llama-server (default: $PAGE_LOCAL_PEER_BIN or build-peer/bin, which `make "
                   "peer-server` builds)")
@click.option("--fill", default="prefill", show_default=True, type=click.Choice(["prefill", "state"]),
              help="how the cache is filled: prefill reads the prompt (and times it: TTFT); state repeats the cells "
                   "of its first 512 tokens to --tokens and gives page-local and stock llama-server (its slot file) "
                   "the same cache in seconds: decode speed at 16K-32K cells without a 32K-token read, no TTFT")
@threads_option
@n_gpu_layers_option
@attention_options
@json_option()
def bench_decode(model, tokens, budget, new_tokens, repeats, peer_bin, fill, threads, as_json, **load):
    """TTFT and decode tok/s: page-local (full cache, evicted to the budget, parked to the budget) beside stock
    llama.cpp's default and best configuration."""
    from page_local.bench.speed import decode_speedup

    path = resolve_model(model)
    _bench(as_json, lambda: decode_speedup(path, tokens=tokens, budget=budget,
                                           new_tokens=new_tokens, repeats=repeats, threads=threads,
                                           peer_bin=peer_bin, fill=fill, **load), _decode_text)


def _secs(v) -> str:
    return "not measured" if v is None else f"{v:.2f} s"


def _times(v) -> str:
    return "–" if v is None else f"{v:.2f}x"


def _decode_text(r: dict) -> str:
    from page_local.native.runtime import describe_placement

    filled = (" (cache filled from a state: the first 512 tokens' cells repeated; no TTFT)"
              if r["fill"] == "state" else "")
    return (f"{r['tokens']}-token prompt{filled}, {r['new_tokens']} new tokens, medians of {r['repeats']}; page-local: flash "
                     f"attention {r['attention']['flash_attn']} ({r['attention']['source']}), TTFT "
                     f"{_secs(r['ttft_s'])}, full cache {r['full_tok_s']:.1f} tok/s, evicted to {r['kept']} "
                     f"{r['evicted_tok_s']:.1f} tok/s, parked to {r['kept']} {r['parked_tok_s']:.1f} tok/s "
                     f"({r['parked_vs_evicted']:.2f}x evicted; parking {r['park_ms']:.1f} ms, compaction "
                     f"{r['compact_ms']:.1f} ms).\nStock llama.cpp ({r['stock_source']}): default (flash "
                     f"attention on) TTFT {_secs(r['stock_default_ttft_s'])}, {r['stock_default_tok_s']:.1f} tok/s; "
                     f"best TTFT {_secs(r['stock_best_ttft_s'])} (flash attention {r['stock_best_ttft_flash_attn']}), "
                     f"best decode {r['stock_best_tok_s']:.1f} tok/s (flash attention {r['stock_best_flash_attn']}).\n"
                     f"page-local / stock best: TTFT {_times(r['ttft_vs_stock_best'])} as fast, full cache "
                     f"{r['full_vs_stock_best']:.2f}x, parked {r['parked_vs_stock_best']:.2f}x (bound {_times(r['bound'])}), "
                     f"evicted {r['evicted_vs_stock_best']:.2f}x "
                     f"({r['evicted_vs_stock_default']:.2f}x the default); same greedy tokens as stock (full "
                     f"cache): {r['same_full_tokens_as_stock']} (tokens agreeing: {r['tokens_agreeing_with_stock']}; stock's "
                     f"two paths with each other: {r['stock_paths_agreeing_tokens']}); gate decision {r['gate_ms']:.2f} ms; "
                     f"memory: page-local {r['rss_mb']:.0f} MB, stock {r['stock_rss_mb'] or 0:.0f} MB; "
                     f"{describe_placement(r['device'])}")


@bench_group.command("verify")
@model_option
@click.option("--tokens", default=2048, show_default=True, type=click.IntRange(min=256))
@click.option("--m", "m", default=VERIFY_CAP, show_default=True, type=click.IntRange(1, 256),
              help="verify's cap: the answer is checked up to its end or this many tokens.")
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(min=1))
@click.option("--prompt", "prompt", default="needle", show_default=True, type=click.Choice(["needle", "random", "tasks"]),
              help="needle: a short answer (the check ends with it); random: random tokens, the check runs to --m "
                   "(both: every check passes); tasks: --repeats prompts of each budget-search task family, decided "
                   "as in use.")
@click.option("--ladder", default=None, type=LadderType(),
              help="measure gate 'search' over this ladder (e.g. 1/16,1/8,1/4,1/2): every rung's first chunk in one "
                   "batch, then smallest first")
@click.option("--evictor", default="snapkv", show_default=True, type=click.Choice(["snapkv", "lorekv-answer"]),
              help="lorekv-answer: the check also scores the prompt by the answer (one more batch)")
@click.option("--budget", default=str(defaults.BUDGET), show_default=True, type=BudgetType(),
              help="verify's budget (without --ladder)")
@threads_option
@n_gpu_layers_option
@attention_options
@json_option()
def bench_verify(model, tokens, m, repeats, prompt, ladder, evictor, budget, threads, as_json, **load):
    """Self-verification's extra decode as a fraction of the prefill (target <= 0.05); with --ladder, budget
    search's."""
    from page_local.bench.speed import verify_cost

    path = resolve_model(model)
    _bench(as_json, lambda: verify_cost(path, tokens=tokens, m=m, repeats=repeats, threads=threads,
                                        prompt=prompt, ladder=ladder, evictor=evictor, budget=budget, **load),
           lambda r: f"{r['tokens']}-token prompt ({r['prompt']}): the check of {r['m_checked']} answer tokens on "
                     f"{r['candidates']} candidate(s) decoded {r['forced_mean']:.0f} tokens in {r['verify_ms']:.1f} ms, "
                     f"prefill {r['prefill_ms']:.0f} ms, ratio {r['ratio']:.4f} (median of {r['runs']} runs; "
                     f"mean {r['ratio_mean']:.4f}, max {r['ratio_max']:.4f})")


@bench_group.command("forced")
@model_option
@click.option("--tokens", default=2048, show_default=True, type=click.IntRange(min=64))
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(min=1))
@threads_option
@n_gpu_layers_option
@attention_options
@json_option()
def bench_forced(model, tokens, repeats, threads, as_json, **load):
    """What a token forced by the check costs, in chunks of 1-64, beside a prefill token (the check's floor)."""
    from page_local.bench.speed import forced_cost
    from page_local.native.runtime import describe_placement

    path = resolve_model(model)
    _bench(as_json, lambda: forced_cost(path, tokens=tokens, repeats=repeats, threads=threads, **load),
           lambda r: f"after a {tokens}-token prompt (prefill {r['prefill_ms_per_token']:.2f} ms per token): a forced "
                     "token costs " + ", ".join(f"{r['ms_per_forced_token'][n]:.2f} ms ({r['ratio'][n]:.1f}x) in chunks "
                                                f"of {n}" for n in r["ratio"])
                     + f" (medians of {repeats}); {describe_placement(r['device'])}")


@bench_group.command("lorekv")
@model_option
@click.option("--tokens", default=2048, show_default=True, type=click.IntRange(min=256))
@click.option("--budget", default=str(defaults.BUDGET), show_default=True, type=BudgetType())
@click.option("--futures", default=4, show_default=True, type=click.IntRange(1, 8))
@click.option("--lookahead-tokens", default=32, show_default=True, type=click.IntRange(1, 512))
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(min=1))
@threads_option
@n_gpu_layers_option
@attention_options
@json_option()
def bench_lorekv(model, tokens, budget, futures, lookahead_tokens, repeats, threads, as_json, **load):
    """LORE-KV's one-time cost (prompt to eviction) as a ratio to SnapKV's (paper: 1.46-2.77x)."""
    from page_local.bench.speed import lorekv_overhead

    path = resolve_model(model)
    _bench(as_json, lambda: lorekv_overhead(path, tokens=tokens, budget=budget, futures=futures,
                                            lookahead_tokens=lookahead_tokens, repeats=repeats, threads=threads,
                                            **load),
           lambda r: f"{r['tokens']}-token prompt to eviction: SnapKV {r['snapkv_ms']:.0f} ms, LORE-KV "
                     f"{r['lorekv_ms']:.0f} ms ({r['futures']} futures x {r['lookahead_tokens']} tokens: "
                     f"{r['lookahead_ms']:.0f} ms), ratio {r['ratio']:.2f} (median of {repeats})")


@bench_group.command("memory")
@model_option
@click.option("--tokens", default=8192, show_default=True, type=click.IntRange(min=256))
@click.option("--compact/--no-compact", default=True, show_default=True,
              help="compact the cache after eviction, as the engine does by default")
@click.option("--park/--no-park", default=False, show_default=True,
              help="park the other 75 %% (kept in memory, out of the attention) instead of evicting them")
@threads_option
@n_gpu_layers_option
@attention_options
@json_option()
def bench_memory(model, tokens, compact, park, threads, as_json, **load):
    """Peak RSS of page-local vs stock llama-cpp-python on the same prompt (target ratio <= 1.05)."""
    from page_local.bench.speed import peak_memory

    path = resolve_model(model)
    _bench(as_json, lambda: peak_memory(path, tokens=tokens, threads=threads, compact=compact, park=park, **load),
           lambda r: f"peak RSS: page-local {r['page_local_peak_rss_mb']:.0f} MB, llama-cpp-python "
                     f"{r['stock_peak_rss_mb']:.0f} MB, ratio {r['ratio']:.3f}; free cells in n_ctx {r['n_ctx']}: "
                     f"{r['free_cells_full_cache']} full, {r['free_cells_after_eviction']} after eviction")


@bench_group.command("peer")
@model_option
@click.option("--tokens", default=2048, show_default=True, type=click.IntRange(min=256),
              help="Prompt length target (chat template included), as `eval run --length`.")
@click.option("--budget", default=defaults.BUDGET, show_default=True,
              type=click.FloatRange(0, 1, min_open=True, max_open=True),
              help="Kept ratio; kvpress gets compression_ratio = 1 - budget.")
@click.option("--n", "n", default=20, show_default=True, type=click.IntRange(min=1), help="Needle prompts.")
@click.option("--gen", default=32, show_default=True, type=click.IntRange(min=1), help="Greedy tokens per prompt.")
@click.option("--seed", default=42, show_default=True, type=click.IntRange(min=0))
@click.option("--kvpress-window", default=None, type=click.IntRange(min=1),
              help="SnapKVPress window_size (default: kvpress's, 64; page-local's is 32).")
@click.option("--kvpress-kernel", default=None, type=click.IntRange(min=1),
              help="SnapKVPress kernel_size, odd (default: kvpress's, 5; 1 = no pooling, as page-local).")
@threads_option
@n_gpu_layers_option
@attention_options
@json_option()
def bench_peer(model, tokens, budget, n, gen, seed, kvpress_window, kvpress_kernel, threads, as_json, **load):
    """page-local vs NVIDIA kvpress (SnapKVPress, PyTorch) on the same GGUF, budget and needle prompts:
    time per prompt and accuracy. Needs the optional extra: pip install 'page-local[peer]'."""
    from page_local.bench.peer import describe, peer_benchmark

    path = resolve_model(model)
    _bench(as_json, lambda: peer_benchmark(path, tokens=tokens, budget=budget, n=n, gen=gen, threads=threads,
                                           seed=seed, kvpress_window=kvpress_window, kvpress_kernel=kvpress_kernel,
                                           progress=lambda m: click.echo(m, err=True), **load),
           describe)


@bench_group.command("chat")
@model_option
@click.option("--turns", default=10, show_default=True, type=click.IntRange(min=2))
@click.option("--n-ctx", "n_ctx", default=1024, show_default=True, type=click.IntRange(min=128),
              help="page-local's context; the full cache gets one large enough for the whole chat.")
@click.option("--outgrow", default=3.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="The chat's messages add up to this many times --n-ctx (below 1: the chat stays inside the "
                   "context, for speed without the wall).")
@click.option("--gen", default=32, show_default=True, type=click.IntRange(min=1), help="Greedy answer tokens, at most.")
@click.option("--repeats", default=1, show_default=True, type=click.IntRange(min=1))
@click.option("--budget", default=str(defaults.CHAT_BUDGET), show_default=True, type=BudgetType(),
              help="page-local's speed budget, chat's default (1.0: room on demand only).")
@click.option("--park/--no-park", default=defaults.CHAT_PARK, show_default=True,
              help="The speed budget parks cells (each message chooses again) instead of evicting them for good.")
@click.option("--park-from", default=None, type=click.IntRange(min=0),
              help="With --park: below this many cells the full cache is kept (default: the engine's).")
@(lambda f: evictor_option(f, defaults.CHAT_EVICTOR))  # as `page-local chat`
@(lambda f: gate_option(f, defaults.CHAT_GATE))
@(lambda f: ladder_option(f, defaults.CHAT_LADDER))
@verify_tokens_option
@click.option("--peer-bin", default=None, type=click.Path(file_okay=False),
              help="folder with stock llama-server (default: $PAGE_LOCAL_PEER_BIN or build-peer/bin, which `make "
                   "peer-server` builds)")
@threads_option
@n_gpu_layers_option
@attention_options
@json_option()
def bench_chat(model, turns, n_ctx, outgrow, gen, repeats, budget, park, park_from, evictor, gate, ladder,
               verify_tokens, peer_bin, threads, as_json, **load):
    """Time to first token and tok/s per turn of a chat that outgrows n_ctx: page-local vs the full cache, and
    vs stock llama-server (default and best flash-attention path) when it is built."""
    from page_local.bench.chat import chat_speed

    def describe(r: dict) -> str:
        lines = ["turn  tokens  page-local TTFT s  tok/s  cells   full TTFT s  tok/s  cells   TTFT ratio  tok/s ratio"]
        for t in r["per_turn"]:
            p, f = t.get("page_local") or {}, t.get("full") or {}
            lines.append(f"{t['turn']:>4}  {t['conversation_tokens'] or 0:>6}  {p.get('ttft_s', 0):>17.3f}  "
                         f"{p.get('tok_s', 0):>5.1f}  {p.get('cells', 0):>5}   "
                         + (f"{f['ttft_s']:>11.3f}  {f['tok_s']:>5.1f}  {f['cells']:>5}   {t['ttft_ratio']:>10.3f}  "
                            f"{t['tok_s_ratio'] or 0:>11.3f}" if f else f"{'(does not fit)':>25}"))
        lines.append(f"median ratios (page-local / full): TTFT {r['ttft_ratio']}, tok/s {r['tok_s_ratio']}; past the "
                     f"wall (turn {r['first_wall_turn']} on): TTFT {r['ttft_ratio_past_wall']}, tok/s "
                     f"{r['tok_s_ratio_past_wall']}; {r['refusals']} refusals")
        if r.get("stock_source"):
            lines.append("turn  stock read  default (fa on) TTFT s  tok/s   best TTFT s  tok/s   page-local x as fast "
                         "as best: TTFT  tok/s")
            for t in r["per_turn"]:
                st = t["stock"]
                b_t, b_d = st[r["stock_best_ttft_flash_attn"]], st[r["stock_best_flash_attn"]]
                lines.append(f"{t['turn']:>4}  {st['on']['prompt_n']:>10}  {st['on']['ttft_s']:>22.3f}  "
                             f"{st['on']['tok_s']:>5.1f}   {b_t['ttft_s']:>11.3f}  {b_d['tok_s']:>5.1f}   "
                             f"{t.get('ttft_vs_stock_best', 0):>26.3f}  {t.get('tok_s_vs_stock_best', 0):>5.3f}")
            lines.append(f"{r['stock_source']}; best: TTFT with flash attention {r['stock_best_ttft_flash_attn']}, "
                         f"decode with {r['stock_best_flash_attn']}. page-local x as fast as stock best (medians): "
                         f"TTFT {r['ttft_vs_stock_best']}, tok/s {r['tok_s_vs_stock_best']}; past the wall: TTFT "
                         f"{r['ttft_vs_stock_best_past_wall']}, tok/s {r['tok_s_vs_stock_best_past_wall']}; vs stock "
                         f"default: TTFT {r['ttft_vs_stock_default']}, tok/s {r['tok_s_vs_stock_default']}")
        else:
            lines.append("stock llama.cpp: not built (`make peer-server`), not compared")
        return "\n".join(lines)

    path = resolve_model(model)
    _bench(as_json, lambda: chat_speed(path, turns=turns, n_ctx=n_ctx, outgrow=outgrow, gen=gen, repeats=repeats,
                                       threads=threads, budget=budget, park=park, park_from=park_from,
                                       evictor=evictor, gate=gate, ladder=tuple(ladder), verify_tokens=verify_tokens,
                                       peer_bin=peer_bin, **load),
           describe)


@bench_group.command("disk")
@model_option
@click.option("--tokens", "lengths", default="2048,4096,7936", show_default=True,
              help="document lengths in tokens, comma-separated (each run with n_ctx = length + 256)")
@click.option("--repeats", default=1, show_default=True, type=click.IntRange(min=1),
              help="runs per length (medians; the orders alternate)")
@click.option("--peer-bin", default=None, type=click.Path(file_okay=False),
              help="folder with stock llama-server (default: $PAGE_LOCAL_PEER_BIN or build-peer/bin)")
@threads_option
@n_gpu_layers_option
@attention_options
@json_option('print one JSON object: "rows", per length the seconds to the first token of each way '
             '(bench/diskcache.py)')
def bench_disk(model, lengths, repeats, peer_bin, threads, as_json, **load):
    """Time to the first token of a document asked about again after a restart: page-local from its disk cache,
    reading it again, its in-memory prompt cache; stock llama-server reading it again and with its slot restore
    (with the same --cache-type)."""
    from page_local.bench import diskcache
    from page_local.bench.stock import find_bin

    path = resolve_model(model)
    try:
        ns = [int(x) for x in lengths.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"{lengths!r} is not a list of token counts", param_hint="'--tokens'") from None
    settings = load.get("attention_settings")
    cache_type = settings.cache_type if settings is not None else "f16"
    rows = []
    for n in ns:  # each length's line as soon as it is measured
        with one_line_errors():
            r = (diskcache.measure(path, lengths=[n], threads=threads, peer_bin=find_bin(peer_bin), repeats=repeats,
                                   **load) or [{}])[0]
        rows.append(r)
        if as_json:
            continue
        line = (f"{r['tokens']} tokens ({cache_type}): from disk {r['disk']:.2f} s, reading again {r['read']:.2f} s "
                f"({r['read'] / r['disk']:.1f}x), in-memory cache {r['memory']:.2f} s (disk / memory "
                f"{r['disk'] / r['memory']:.2f}x), first read with the cache {r['first']:.2f} s "
                f"({r['first'] / r['read']:.3f}x reading without; the copy for the disk {r['save_ms']:.0f} ms, "
                f"{r['save_ms'] / 1e3 / r['read']:.1%} of reading), {r['disk_bytes'] / r['tokens'] * 1024 / 1e6:.1f} "
                "MB on disk per 1K tokens")
        if "stock" in r:
            line += (f"; stock llama-server reading again {r['stock']:.2f} s ({r['stock'] / r['disk']:.1f}x from "
                     f"disk), its slot restore {r['stock-slot']:.2f} s (read {r['stock-slot-read']} tokens)")
        click.echo(line)
    if as_json:
        click.echo(json.dumps({"bench": "disk", "model": str(path), "threads": threads, "repeats": repeats,
                               "cache_type": cache_type, "rows": rows}))
