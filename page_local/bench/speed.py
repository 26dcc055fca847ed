"""Benchmarks that print ratios measured side by side in one run (medians of alternated runs).

Run them alone on the machine: with 2 threads on 2 cores, any other busy process ruins llama.cpp's
thread synchronisation.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np

from page_local.engine.attention import AttentionSettings
from page_local.engine.turn import N_SINK, TOP_K, W, armed_tail
from page_local.errors import BenchError
from page_local.native.runtime import Context, ContextConfig, Model
from page_local.verify import VERIFY_CAP


# Every benchmark takes n_gpu_layers, rpc and attention_settings as an Engine does (None: the environment's,
# read once, where the benchmark starts: _chosen, or the Engine it makes), and passes them down as values.

def _chosen(model_path, model, threads: int, n_ctx: int, attention_settings: AttentionSettings | None):
    """The Attention an Engine would choose for a context on `model` (engine/attention.py)."""
    from page_local.engine import attention

    return attention.choose(model_path, model, threads, n_ctx, attention_settings or attention.from_environment())[0]


def _attention(model_path, model, threads: int, n_ctx: int, attention_settings: AttentionSettings | None) -> dict:
    """ContextConfig's flash_attn and type_kv (native's name of the cache type) as an Engine would choose them."""
    a = _chosen(model_path, model, threads, n_ctx, attention_settings)
    return {"flash_attn": a.flash_attn, "type_kv": a.cache_type}


def probe_overhead(model_path, tokens: int = 4096, repeats: int = 3, threads: int = 2, seed: int = 0,
                   n_gpu_layers: int | str | None = None, rpc=None,
                   attention_settings: AttentionSettings | None = None) -> dict:
    """Wall time of a `tokens`-token prefill with the probe armed as the engine arms it (on the last W queries
    of the prompt's last ubatch: turn.armed_tail) and without it (the prompt in one call, llama.cpp's split)."""
    if tokens <= W:
        raise ValueError(f"--tokens must exceed the probe window ({W}), got {tokens}")
    if repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {repeats}")
    prompt = np.random.default_rng(seed).integers(100, 4000, size=tokens).tolist()
    times: dict[bool, list[float]] = {False: [], True: []}
    # random tokens, timed: positions past the trained context cost the same, so the length is not refused
    with Model(model_path, n_gpu_layers=n_gpu_layers, rpc=rpc) as model, \
            Context(model, ContextConfig(n_ctx=tokens + 64, threads=threads, allow_long_context=True,
                                         **_attention(model_path, model, threads, tokens + 64,
                                                      attention_settings))) as ctx:
        device = ctx.placement()
        ctx.decode(prompt[:64], 0, logits="none")  # warm-up: first graph build and allocation
        for i in range(2 * repeats):
            armed = bool(i % 2)
            ctx.clear()
            t0 = time.perf_counter()
            if armed:
                m = armed_tail(tokens, ctx.n_ubatch)
                if tokens > m:  # a prompt of one ubatch is the armed batch alone
                    ctx.decode(prompt[: tokens - m], 0, logits="none")
                ctx.page.arm_probe(0, TOP_K, last=W if m > W else 0)
                ctx.decode(prompt[tokens - m:], tokens - m)
                ctx.page.read_probe()
            else:
                ctx.decode(prompt, 0, logits="last")
            times[armed].append(time.perf_counter() - t0)
    armed_s, plain_s = statistics.median(times[True]), statistics.median(times[False])
    return {
        "bench": "probe",
        "tokens": tokens,
        "threads": threads,
        "repeats": repeats,
        "unarmed_s": round(plain_s, 4),
        "armed_s": round(armed_s, 4),
        "ratio": round(armed_s / plain_s, 4),
        "unarmed_runs": [round(t, 4) for t in times[False]],
        "armed_runs": [round(t, 4) for t in times[True]],
        "device": device,
    }


def decode_speedup(model_path, tokens: int = 8192, budget: float | int = 0.25, new_tokens: int = 64,
                   repeats: int = 3, threads: int = 2, seed: int = 0, n_gpu_layers: int | str | None = None,
                   peer_bin=None, rpc=None, attention_settings: AttentionSettings | None = None,
                   fill: str = "prefill") -> dict:
    """Time to first token and greedy decode tok/s for one `tokens`-token prompt (a needle text), side by
    side in one run: page-local's own choice of path (engine/attention.py) with the full cache and after the
    engine's eviction (gate forced open, SnapKV) to `budget`; and stock llama.cpp on both flash-attention
    paths: its default (flash attention "auto", on for the CPU and GPU backends) and its best (the faster
    of on and off, per figure). Medians of `repeats`.

    Stock llama.cpp is its own llama-server built unpatched from the pinned tree (bench/stock.py; `make
    peer-server`, or peer_bin). Without that build the stock figures come from page-local's own library with
    llama.cpp's attention kernels ($PAGE_LOCAL_FA_KERNEL=llama.cpp) and the engine's prefill, and say so
    ("stock_source").

    page-local prefills once through the engine's own steps (turn.Pipeline: the probe armed on the last W
    positions; its time is the TTFT); its sequence state is saved and restored before every run, so each run
    starts from the same cache. The evicted runs do what Engine does when the gate opens: Pipeline.select
    and Pipeline.evict_in_place (evict, compact, re-decode the last prompt token). Also returns the gate
    decision latency: D + gate on the real probe (median).

    fill "state" (issue 54: a long cache without a long prefill, bench/fill.py): page-local reads the prompt's
    first FILL_SEED tokens, repeats their cells to all but the last W tokens, and reads those W with the probe
    armed; stock llama-server restores the same cells from a slot file and reads the same W tokens. Decode over
    the same number of cells; the time to first token is not measured (None), and which cells an eviction keeps
    means nothing (the repeated cells' attention is noise): speed only. Also returns the memory (RSS) of each
    engine, and the bound that memory traffic sets on a cache cut to `kept` cells: (weights + K/V of all cells) ÷
    (weights + K/V of the kept ones).
    """
    import os

    from page_local.bench import stock
    from page_local.evictors.base import resolve_budget

    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens <= W:
        raise ValueError(f"--tokens must be an int above the probe window ({W}), got {tokens!r}")
    if fill not in FILLS:
        raise ValueError(f"fill must be one of {', '.join(FILLS)}, got {fill!r}")
    for name, v in (("new_tokens", new_tokens), ("repeats", repeats), ("threads", threads)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be an int >= 1, got {v!r}")
    bin_dir = stock.find_bin(peer_bin)
    n_ctx = tokens + new_tokens + 64
    with Model(model_path, n_gpu_layers=n_gpu_layers, rpc=rpc) as model:
        prompt = model.tokenize(_needle_prompt(model, tokens))
        T = len(prompt)
        B = resolve_budget(budget, T, W, N_SINK)
        if B >= T:
            raise ValueError(f"budget {budget!r} keeps all {T} tokens: nothing to evict")
        chosen = _chosen(model_path, model, threads, n_ctx, attention_settings)
        mine = _decode_path(model, prompt, B, n_ctx, new_tokens, repeats, threads, seed, chosen.flash_attn,
                            chosen.cache_type, evict=True, fill=fill)
        seed_state = mine.pop("_seed", None)
        # greedy tokens are compared up to the answer's end: past it page-local's runs decode on and stock's
        # server (ignore_eos, so that it decodes new_tokens too) takes the next-best token instead
        mine_tokens = [mine["first"]] + mine.pop("_tokens")[:-1]
        mine_tokens = mine_tokens[:next((i for i, t in enumerate(mine_tokens) if model.is_eog(t)), len(mine_tokens))]
        if fill == "state" and bin_dir is None:
            raise BenchError("--fill state measures stock llama-server from a slot file: build it first "
                             "(`make peer-server`) or give --peer-bin")
        if fill == "state":
            paths = stock.measure_filled(bin_dir, Path(model_path), prompt, len(prompt) - W, seed_state, n_ctx,
                                         new_tokens, repeats, threads)
            source = f"stock llama-server ({bin_dir}), the cache restored from a slot file"
        elif bin_dir is None:  # the same library with llama.cpp's own kernels
            before = os.environ.get("PAGE_LOCAL_FA_KERNEL")
            os.environ["PAGE_LOCAL_FA_KERNEL"] = "llama.cpp"
            try:
                paths = {}
                for setting in stock.SETTINGS:
                    p = _decode_path(model, prompt, B, n_ctx, new_tokens, repeats, threads, seed, setting, "f16",
                                     evict=False)
                    paths[setting] = {"ttft_s": p["prefill_s"], "decode_tok_s": p["full_tok_s"],
                                      "decode_runs": p["full_runs"], "_tokens": [p["first"]] + p["_tokens"][:-1]}
            finally:
                if before is None:
                    os.environ.pop("PAGE_LOCAL_FA_KERNEL", None)
                else:
                    os.environ["PAGE_LOCAL_FA_KERNEL"] = before
            source = "page-local's library with llama.cpp's attention kernels (make peer-server for stock llama.cpp)"
        else:
            paths = stock.measure(bin_dir, Path(model_path), prompt, n_ctx, new_tokens, repeats, threads)
            source = f"stock llama-server ({bin_dir})"
    theirs = {s: paths[s].pop("_tokens")[:len(mine_tokens)] for s in stock.SETTINGS}
    same = {s: theirs[s] == mine_tokens for s in stock.SETTINGS}
    # how many greedy tokens agree before the first difference (paths and kernels round differently: a
    # long answer can part after its first tokens)
    agree = {s: next((i for i, (a, b) in enumerate(zip(theirs[s], mine_tokens)) if a != b),
                     min(len(theirs[s]), len(mine_tokens))) for s in stock.SETTINGS}
    # stock's own two paths round differently too: how far their greedy tokens agree with each other says
    # whether a parting of page-local's is its own or one any change of path makes
    stock_agree = next((i for i, (a, b) in enumerate(zip(theirs["on"], theirs["off"])) if a != b),
                       min(len(theirs["on"]), len(theirs["off"])))
    best_dec = max(stock.SETTINGS, key=lambda s: paths[s]["decode_tok_s"])
    best_ttft = min(stock.SETTINGS, key=lambda s: float("inf") if paths[s]["ttft_s"] is None else paths[s]["ttft_s"])
    dflt = paths["on"]  # llama.cpp's flash_attn "auto" resolves to on for the CPU backend and GPUs
    out = {"bench": "decode", "tokens": T, "budget": budget, "new_tokens": new_tokens, "threads": threads,
           "repeats": repeats, "attention": chosen.to_dict()}
    out.update({k: v for k, v in mine.items() if k not in ("flash_attn", "first")})
    out.update({
        "ttft_s": mine["prefill_s"],
        "stock_source": source,
        "stock_default_tok_s": dflt["decode_tok_s"],
        "stock_best_tok_s": paths[best_dec]["decode_tok_s"],
        "stock_best_flash_attn": best_dec,
        "stock_default_ttft_s": dflt["ttft_s"],
        "stock_best_ttft_s": paths[best_ttft]["ttft_s"],
        "stock_best_ttft_flash_attn": best_ttft,
        "full_vs_stock_default": round(mine["full_tok_s"] / dflt["decode_tok_s"], 4),
        "full_vs_stock_best": round(mine["full_tok_s"] / paths[best_dec]["decode_tok_s"], 4),
        "evicted_vs_stock_default": round(mine["evicted_tok_s"] / dflt["decode_tok_s"], 4),
        "evicted_vs_stock_best": round(mine["evicted_tok_s"] / paths[best_dec]["decode_tok_s"], 4),
        # TTFT as a speed ratio: above 1, page-local answers first (None when the cache was filled from a state)
        "ttft_vs_stock_default": _ratio(dflt["ttft_s"], mine["prefill_s"]),
        "ttft_vs_stock_best": _ratio(paths[best_ttft]["ttft_s"], mine["prefill_s"]),
        "parked_vs_stock_best": round(mine["parked_tok_s"] / paths[best_dec]["decode_tok_s"], 4),
        "parked_vs_full": round(mine["parked_tok_s"] / mine["full_tok_s"], 4),
        "fill": fill,
        "bound": _bound(model_path, T, mine["kept"]),
        "stock_rss_mb": paths[best_dec].get("rss_mb"),
        "same_full_tokens_as_stock": same,
        "tokens_agreeing_with_stock": agree,
        "stock_paths_agreeing_tokens": stock_agree,
        "stock_paths": paths,
    })
    return out


FILLS = ("prefill", "state")
FILL_SEED = 512  # the tokens read for real when the cache is filled from a state (bench/fill.py)


def _ratio(a, b):
    return None if a is None or b is None else round(a / b, 4)


def _bound(model_path, cells: int, kept: int) -> float | None:
    """What memory traffic allows a decode step over `kept` of `cells` cells against all of them: (weights + K/V
    of every cell) ÷ (weights + K/V of the kept ones), the weights as the file's size, K and V f16."""
    from page_local.store.gguf import gguf_shape

    sh = gguf_shape(model_path)
    try:
        per_cell = 2 * 2 * sh["n_layer"] * sh["n_head_kv"] * sh.get("head_dim_k", sh["n_embd"] // sh["n_head"])
    except KeyError:
        return None
    weights = Path(model_path).stat().st_size
    return round((weights + cells * per_cell) / (weights + kept * per_cell), 4)


def _rss_mb() -> float:
    import psutil

    return round(psutil.Process().memory_info().rss / 2**20, 1)


def _decode_path(model, prompt, B, n_ctx, new_tokens, repeats, threads, seed, flash_attn, cache_type,
                 evict: bool, fill: str = "prefill") -> dict:
    """decode_speedup's runs on one attention path (full cache; with evict, also the evicted caches). fill
    "state": the cache of all but the last W tokens made from the first FILL_SEED tokens' cells (bench/fill.py);
    its seed state is returned as "_seed" for stock's slot file."""
    from page_local.engine.turn import Pipeline, drop
    from page_local.evictors import get_evictor
    from page_local.gate import Gate

    tokens = len(prompt)
    snapkv = get_evictor("snapkv")
    gate = Gate("page")
    with Context(model, ContextConfig(n_ctx=n_ctx, threads=threads, allow_long_context=True, flash_attn=flash_attn,
                                      type_kv=cache_type, n_seq_max=2)) as ctx:
        device = ctx.placement()
        pipe = Pipeline(ctx, model)
        ctx.decode(prompt[:1], 0, 0)  # warm-up: the weights' pages are read in before anything is timed
        prefills, seed_state = [], None
        if fill == "state":  # no time to first token: the cells come from a short prefill, repeated
            from page_local.bench import fill as filling

            ctx.clear()
            ctx.decode(prompt[:min(FILL_SEED, tokens - W)], 0, 0, logits="none")
            seed_state = filling.parse(ctx.seq_state(0))
            ctx.clear()
            ctx.set_seq_state(filling.repeat_to(seed_state, tokens - W, v_trans=flash_attn == "off"), 0)
            pre = pipe.prefill(prompt[tokens - W:], tokens - W, 0)
            prefill_s = None
        else:
            for _ in range(repeats):  # the time to first token: median of `repeats` prefills from an empty cache
                ctx.clear()
                t0 = time.perf_counter()
                pre = pipe.prefill(prompt, 0, 0)
                prefills.append(time.perf_counter() - t0)
            prefill_s = statistics.median(prefills)
        first = int(np.argmax(pre.logits))

        gate_ms = []
        for _ in range(max(11, repeats)):
            g0 = time.perf_counter()
            gate.decide(drop(pre.probe)[0])
            gate_ms.append((time.perf_counter() - g0) * 1e3)

        rss_mb = _rss_mb()  # the model, the context and its cells: before the bench keeps a copy of them
        s0 = time.perf_counter()
        state = ctx.seq_state(0)
        save_ms = (time.perf_counter() - s0) * 1e3
        full_tokens: list[int] = []

        def decode_run(record: list[int] | None = None) -> float:
            """tok/s of new_tokens greedy steps from the current cache (first token: the prefill's)."""
            tok, pos = first, tokens
            r0 = time.perf_counter()
            for i in range(new_tokens):
                ctx.decode([tok], pos + i, 0)
                tok = int(np.argmax(ctx.logits()))
                if record is not None:
                    record.append(tok)
            return new_tokens / (time.perf_counter() - r0)

        # four configurations, alternated: full cache; evicted as the engine does it (evict, compact,
        # re-decode the last prompt token); parked (the same cells leave the attention but stay in memory,
        # under sequence 1, past the attended range); evicted without compaction (holes left in place)
        modes = ("full", "evicted", "parked", "evicted_nocompact") if evict else ("full",)
        runs: dict[str, list[float]] = {m: [] for m in modes}
        restore_ms, evict_ms, compact_ms, park_ms, kept = [], [], [], [], tokens
        for i in range(len(modes) * repeats):
            mode = modes[i % len(modes)]
            ctx.clear()
            r0 = time.perf_counter()
            ctx.set_seq_state(state, 0)
            restore_ms.append((time.perf_counter() - r0) * 1e3)
            if mode != "full":
                e0 = time.perf_counter()
                keep = pipe.select(snapkv, pre, B, {}, seed)
                c_ms = pipe.evict_in_place(0, keep, pre.held, tokens - 1, prompt[-1], compact=mode == "evicted",
                                           park=1 if mode == "parked" else None, gap=new_tokens)
                if mode == "evicted":
                    compact_ms.append(c_ms)
                elif mode == "parked":
                    park_ms.append(c_ms)
                evict_ms.append((time.perf_counter() - e0) * 1e3)
                kept = ctx.cells_used(0)
            runs[mode].append(decode_run(full_tokens if mode == "full" and not full_tokens else None))
    full = statistics.median(runs["full"])
    out = {"flash_attn": flash_attn, "cache_type": cache_type, "full_tok_s": round(full, 2),
           "prefill_s": None if prefill_s is None else round(prefill_s, 3),
           "prefill_tok_s": None if prefill_s is None else round(tokens / prefill_s, 1), "rss_mb": rss_mb,
           "prefill_runs_s": [round(t, 3) for t in prefills],
           "full_runs": [round(t, 2) for t in runs["full"]], "device": device, "_tokens": full_tokens,
           "first": first}
    if seed_state is not None:
        out["_seed"] = seed_state
    if evict:
        ev, ev_nc = statistics.median(runs["evicted"]), statistics.median(runs["evicted_nocompact"])
        out.update({
            "kept": kept,
            "evicted_tok_s": round(ev, 2),
            "speedup": round(ev / full, 4),
            "evicted_nocompact_tok_s": round(ev_nc, 2),
            "speedup_nocompact": round(ev_nc / full, 4),
            "compact_ms": round(statistics.median(compact_ms), 2),
            "parked_tok_s": round(statistics.median(runs["parked"]), 2),
            "parked_vs_evicted": round(statistics.median(runs["parked"]) / ev, 4),
            "park_ms": round(statistics.median(park_ms), 2),
            "gate_ms": round(statistics.median(gate_ms), 3),
            "gate_target_ms": 2.0,
            "state_save_ms": round(save_ms, 2),
            "state_restore_ms": round(statistics.median(restore_ms), 2),
            "evict_ms": round(statistics.median(evict_ms), 2),
            "evicted_runs": [round(t, 2) for t in runs["evicted"]],
            "evicted_nocompact_runs": [round(t, 2) for t in runs["evicted_nocompact"]],
            "parked_runs": [round(t, 2) for t in runs["parked"]],
        })
    return out


_HAY = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"


def _needle_prompt(model, tokens: int) -> str:
    """A single-needle prompt of at most `tokens` tokens of `model` (the needle in the middle)."""

    def build(n_lines: int) -> str:
        return ("Some special magic numbers are hidden within the following text.\n" + _HAY * (n_lines // 2)
                + "One of the special magic numbers for cold-ocean is: 4817302.\n" + _HAY * (n_lines // 2)
                + "What is the special magic number for cold-ocean mentioned in the provided text? "
                "The special magic number for cold-ocean mentioned in the provided text is")

    n_lines = max(2, tokens // 24)
    while n_lines > 2 and len(model.tokenize(build(n_lines))) > tokens:
        n_lines -= 4
    return build(n_lines)


SEARCH_TASKS = ("niah_single_2", "niah_multikey_3", "niah_multivalue", "niah_multivalue_essay", "niah_multiquery_essay")


def _task_prompts(model, tokens: int, per_task: int) -> list[list[int]]:
    """per_task generated prompts of each SEARCH_TASKS family at about `tokens` tokens, rendered as the
    evaluation renders them (the model's chat template, or plain text for a base model without one)."""
    from page_local.chat.prompts import ChatPrompter
    from page_local.tasks.synthetic import generate

    try:
        prompter = ChatPrompter(model)
    except ValueError:
        prompter = ChatPrompter(model, plain=True)
    out = []
    for task in SEARCH_TASKS:
        for sample in generate(task, per_task, tokens - prompter.overhead, prompter.count_tokens, seed=7):
            out.append(prompter.prompt(sample).tokens)
    return out


def verify_cost(model_path, tokens: int = 2048, budget=0.5, m: int = VERIFY_CAP, repeats: int = 3,
                threads: int = 2, prompt: str = "needle", n_gpu_layers: int | str | None = None,
                ladder: tuple | None = None, evictor: str = "snapkv", rpc=None,
                attention_settings: AttentionSettings | None = None) -> dict:
    """Cost of self-verified eviction (the engine's check, engine/turn.py check_ladder): the decode of the
    answer (up to its end or m tokens) over the evicted copies, as a fraction of the prefill, on prompts
    of about `tokens` tokens (median over the runs). ladder: gate "search" (the rungs smallest first)
    instead of verify at `budget`. evictor: lorekv-answer adds its scoring of the prompt by the answer
    (one more batch), counted in the check.

    prompt "needle" / "random" (one prompt, `repeats` runs; a short answer, or random token ids whose
    answer runs to m): the threshold is set so that every check passes, so verify checks its whole
    answer and search only its smallest rung (the best case). prompt "tasks": `repeats` generated
    prompts of each of the five budget-search families, decided by the default rule as in use: a
    candidate that fails stops where it fails, and search goes on to the next rung."""
    from page_local.engine.engine import Engine

    if prompt not in ("needle", "random", "tasks"):
        raise ValueError(f"prompt must be 'needle', 'random' or 'tasks', got {prompt!r}")
    ratios, verify_ms, prefill_ms, checked, forced, comp, Ts = [], [], [], [], [], [], []
    rungs = len(ladder) if ladder else 1
    with Engine(model_path, n_ctx=tokens + rungs * (m + 1) + 256, budget=budget,
                gate="search" if ladder else "verify", ladder=ladder or (budget,), threads=threads, evictor=evictor,
                verify_tokens=m, verify_threshold=None if prompt == "tasks" else 1e9, n_gpu_layers=n_gpu_layers,
                rpc=rpc, attention_settings=attention_settings, allow_long_context=True) as eng:
        if prompt == "tasks":
            prompts = _task_prompts(eng.model, tokens, repeats)
        else:
            one = (_needle_prompt(eng.model, tokens) if prompt == "needle" else
                   np.random.default_rng(0).integers(100, 4000, size=tokens).tolist())
            prompts = [one] * repeats
        for p in prompts:
            eng.reset()
            d = eng.generate(p, max_tokens=m + 1).decision
            if d.verify_ms is None:
                if prompt == "tasks":
                    continue  # the model ended its answer at once: nothing to check
                raise BenchError("self-verification did not run: the model ended its answer at once; use --prompt random")
            verify_ms.append(d.verify_ms)
            prefill_ms.append(d.prefill_ms)
            checked.append(d.verify_m)
            forced.append(d.verify_forced)
            comp.append(d.compression)
            Ts.append(d.T)
            ratios.append(d.verify_ms / d.prefill_ms)
        if not ratios:
            raise BenchError("self-verification never ran: every answer ended at once")
        device = eng.placement
    return {"bench": "verify", "prompt": prompt, "tokens": int(statistics.median(Ts)), "m": m, "m_checked": int(statistics.median(checked)),
            "ladder": list(ladder) if ladder else None, "candidates": rungs, "evictor": evictor,
            "rule": d.verify_rule, "budget": budget, "threads": threads, "runs": len(ratios),
            "verify_ms": round(statistics.median(verify_ms), 2), "prefill_ms": round(statistics.median(prefill_ms), 1),
            "forced_mean": round(statistics.fmean(forced), 1), "compression_mean": round(statistics.fmean(comp), 3),
            "ratio": round(statistics.median(ratios), 4), "ratio_mean": round(statistics.fmean(ratios), 4),
            "ratio_max": round(max(ratios), 4), "target_ratio": 0.05, "device": device}


FORCED_SIZES = (1, 4, 8, 16, 32, 64)


def forced_cost(model_path, tokens: int = 2048, sizes=FORCED_SIZES, repeats: int = 3, threads: int = 2,
                seed: int = 0, n_gpu_layers: int | str | None = None, rpc=None,
                attention_settings: AttentionSettings | None = None) -> dict:
    """What the check pays per forced token, beside what the prefill pays per prompt token: decodes of n
    tokens with every token's logits (as check_ladder forces an answer on a candidate: a sequence that
    shares the prompt's cells) after a `tokens`-token prompt, for each chunk size n, against the prompt's
    own prefill (ubatch-sized batches, last logits only); medians. ratio[n] = ms per forced token in
    chunks of n / ms per prefill token."""
    if tokens < 64:
        raise ValueError(f"--tokens must be at least 64, got {tokens}")
    sizes = sorted({int(n) for n in sizes})
    if not sizes or sizes[0] < 1:
        raise ValueError(f"chunk sizes must be positive, got {sizes}")
    prompt = np.random.default_rng(seed).integers(100, 4000, size=tokens + sizes[-1]).tolist()
    with Model(model_path, n_gpu_layers=n_gpu_layers, rpc=rpc) as model, \
            Context(model, ContextConfig(n_ctx=tokens + sizes[-1] + 64, threads=threads, n_seq_max=2,
                                         **_attention(model_path, model, threads, tokens + sizes[-1] + 64,
                                                      attention_settings),
                                         allow_long_context=True)) as ctx:
        if sizes[-1] > ctx.n_batch:
            raise ValueError(f"a chunk of {sizes[-1]} tokens exceeds the batch ({ctx.n_batch})")
        device = ctx.placement()
        ctx.decode(prompt[:64], 0, logits="none")  # warm-up: first graph build and allocation
        prefill = []
        for _ in range(repeats):
            ctx.clear()
            t0 = time.perf_counter()
            ctx.decode(prompt[:tokens], 0)
            prefill.append((time.perf_counter() - t0) * 1e3)
        chunk: dict[int, list[float]] = {n: [] for n in sizes}
        for _ in range(repeats):
            for n in sizes:
                ctx.seq_cp(0, 1)
                t0 = time.perf_counter()
                ctx.decode(prompt[tokens: tokens + n], tokens, 1, logits="all")
                chunk[n].append((time.perf_counter() - t0) * 1e3)
                ctx.seq_rm(1, -1, -1)
    prefill_ms = statistics.median(prefill)
    per_prompt_token = prefill_ms / tokens
    ms = {n: statistics.median(v) for n, v in chunk.items()}
    return {"bench": "forced", "tokens": tokens, "threads": threads, "repeats": repeats,
            "prefill_ms": round(prefill_ms, 1), "prefill_ms_per_token": round(per_prompt_token, 3),
            "chunk_ms": {str(n): round(ms[n], 2) for n in sizes},
            "ms_per_forced_token": {str(n): round(ms[n] / n, 3) for n in sizes},
            "ratio": {str(n): round(ms[n] / n / per_prompt_token, 3) for n in sizes}, "device": device}


def lorekv_overhead(model_path, tokens: int = 2048, budget=0.25, futures: int = 4, lookahead_tokens: int = 32,
                    repeats: int = 3, threads: int = 2, n_gpu_layers: int | str | None = None, rpc=None,
                    attention_settings: AttentionSettings | None = None) -> dict:
    """LORE-KV's one-time cost beside SnapKV's: the time from the prompt to the eviction decision
    (prefill + probe + gate + scoring + eviction + re-decode of the last prompt token), alternated
    SnapKV / LORE-KV runs on the same needle prompt, gate forced open, medians."""
    from page_local.engine.engine import Engine

    runs: dict[str, list[dict]] = {"snapkv": [], "lorekv": []}
    with Engine(model_path, n_ctx=tokens + 64 + futures * lookahead_tokens, budget=budget, gate="always",
                threads=threads, n_gpu_layers=n_gpu_layers, rpc=rpc, attention_settings=attention_settings,
                allow_long_context=True) as eng:
        device = eng.placement
        prompt = _needle_prompt(eng.model, tokens)
        for i in range(2 * repeats):
            name = ("snapkv", "lorekv")[i % 2]
            if name == "lorekv":
                eng.set_evictor("lorekv", futures=futures, tokens=lookahead_tokens)
            else:
                eng.set_evictor("snapkv")
            d = eng.generate(prompt, max_tokens=1).decision
            if not d.evicted:
                raise BenchError(f"nothing was evicted (T = {d.T} <= B = {d.B}); use a smaller budget")
            runs[name].append(dict(total=d.prefill_ms + d.probe_ms + d.gate_ms + d.evict_ms, prefill=d.prefill_ms,
                                   evict=d.evict_ms, lookahead=d.lookahead_ms or 0.0))

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[name])

    snap, lore = med("snapkv", "total"), med("lorekv", "total")
    return {"bench": "lorekv", "tokens": d.T, "budget": budget, "futures": futures,
            "lookahead_tokens": lookahead_tokens, "threads": threads, "repeats": repeats,
            "snapkv_ms": round(snap, 1), "lorekv_ms": round(lore, 1), "ratio": round(lore / snap, 3),
            "prefill_ms": round(med("snapkv", "prefill"), 1), "snapkv_evict_ms": round(med("snapkv", "evict"), 1),
            "lorekv_evict_ms": round(med("lorekv", "evict"), 1), "lookahead_ms": round(med("lorekv", "lookahead"), 1),
            "paper_ratio_range": [1.46, 2.77], "device": device}


_MEMORY_CHILD = r"""
import json, resource, sys
import numpy as np
kind, model_path, tokens, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
compact = sys.argv[5] == "1"
n_gpu = sys.argv[6]  # "" = the default, else a count or "all"
flash_attn, cache_type = sys.argv[7], sys.argv[8]  # resolved by the parent
rpc = tuple(sys.argv[9].split(",")) if sys.argv[9] else ()  # HOST:PORT,... resolved by the parent; "": none
park = dict(park=True, park_from=0) if sys.argv[10] == "1" else {}  # the speed budget parks cells
prompt = np.random.default_rng(0).integers(100, 4000, size=tokens).tolist()
n_ctx = tokens + 64
out = {"kind": kind}
if kind == "page-local":
    from page_local.engine import Engine
    from page_local.engine.attention import AttentionSettings
    with Engine(model_path, n_ctx=n_ctx, budget=0.25, gate="always", threads=threads, compact=compact,
                n_gpu_layers=n_gpu or None, rpc=rpc, attention_settings=AttentionSettings(flash_attn, cache_type),
                allow_long_context=True, **park) as eng:
        r = eng.generate(prompt, max_tokens=8)
        out.update(T=r.decision.T, kept=r.decision.kept, parked=r.decision.parked, n_ctx=eng.n_ctx,
                   device=eng.placement)
else:
    from page_local.native import pageops
    pageops.llama_cpp()  # the same patched library, loaded through page_local
    from llama_cpp import Llama
    from page_local.native.runtime import default_n_gpu_layers, parse_n_gpu_layers
    ngl = parse_n_gpu_layers(n_gpu) if n_gpu else default_n_gpu_layers()
    llm = Llama(model_path=model_path, n_ctx=n_ctx, n_threads=threads, n_batch=512, flash_attn=True, verbose=False,
                n_gpu_layers=ngl)
    llm.create_completion(prompt, max_tokens=8, temperature=0.0)
    out.update(T=tokens, kept=tokens, n_ctx=n_ctx)
out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps(out))
"""


def peak_memory(model_path, tokens: int = 8192, threads: int = 2, compact: bool = True,
                n_gpu_layers: int | str | None = None, rpc=None,
                attention_settings: AttentionSettings | None = None, park: bool = False) -> dict:
    """Peak RSS of page-local (prefill + eviction to 25 % + 8 tokens; park: the other 75 % parked instead) vs
    stock llama-cpp-python (prefill + 8 tokens) on the same random-token prompt, each in a fresh process, which
    gets the settings as arguments (resolved here)."""
    import json
    import subprocess
    import sys

    from page_local.engine.attention import from_environment
    from page_local.native.rpc import default_rpc, parse_rpc

    settings = attention_settings or from_environment()
    servers = default_rpc() if rpc is None else parse_rpc(rpc)
    res = {}
    for kind in ("llama-cpp-python", "page-local"):
        p = subprocess.run([sys.executable, "-c", _MEMORY_CHILD, kind, str(model_path), str(tokens), str(threads),
                            "1" if compact else "0", "" if n_gpu_layers is None else str(n_gpu_layers),
                            settings.flash_attn, settings.cache_type, ",".join(servers), "1" if park else "0"],
                           capture_output=True, text=True)
        if p.returncode != 0:
            raise BenchError(f"{kind} run failed: {p.stderr.strip().splitlines()[-1] if p.stderr.strip() else p.returncode}")
        res[kind] = json.loads(p.stdout.strip().splitlines()[-1])
    pl, st = res["page-local"], res["llama-cpp-python"]
    return {
        "bench": "memory", "tokens": tokens, "threads": threads, "compact": compact, "park": park,
        "parked": pl.get("parked", 0),
        "page_local_peak_rss_mb": round(pl["peak_rss_mb"], 1), "stock_peak_rss_mb": round(st["peak_rss_mb"], 1),
        "ratio": round(pl["peak_rss_mb"] / st["peak_rss_mb"], 4), "target_ratio": 1.05,
        "n_ctx": pl["n_ctx"], "T": pl["T"], "kept_after_eviction": pl["kept"],
        "free_cells_full_cache": pl["n_ctx"] - pl["T"], "free_cells_after_eviction": pl["n_ctx"] - pl["kept"],
        "note": "llama.cpp preallocates the KV cache for n_ctx: eviction frees cells for more tokens, not memory",
        "device": pl["device"],
    }
