"""page-local vs NVIDIA kvpress: the same SnapKV budget on the same model and the same needle prompts.

kvpress (github.com/NVIDIA/kvpress, `pip install kvpress`) compresses a Hugging Face transformers
KV cache in PyTorch; here it runs on the very GGUF page-local uses, loaded with `gguf_file=`
(transformers dequantizes it to float32), on the CPU. Per prompt, side by side and alternating
which system goes first:

* page-local: `Engine(gate="always", evictor="snapkv")` (prefill, probe of the last 32 positions,
  one keep set shared by every layer and head, eviction, compaction, generation);
* kvpress: `SnapKVPress(compression_ratio=1 - budget)` (kvpress's defaults: window 64, kernel 5;
  --kvpress-window / --kvpress-kernel change them) applied as kvpress's pipeline applies it
  (`KVPressTextGenerationPipeline._forward`): the press is a context manager around the prefill
  forward of `model.model`; tokens after it are decoded without the press. Keep sets are per KV
  head (docs/algorithms.md §1.2).

Both compress the same tokens (the model's chat template with the answer prefix, as
eval.runner.ChatPrompter renders it; the ids come from llama.cpp's tokenizer) in the same mode:
query-aware, everything but the last prompt token is prefilled and compressed, then the last token
is decoded on the compressed cache, then `gen` greedy tokens are generated and decoded (the answer
is cut at the first end-of-generation token, the timing always covers `gen` tokens).
kvpress's own default, query-agnostic use (its pipeline compresses the context before it sees the
question) is run as well, for accuracy only.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
from page_local.errors import PeerMissing

PEER_MODULES = ("torch", "transformers", "kvpress")
INSTALL_HINT = "pip install 'page-local[peer]' (in a page-local checkout: make bench-peer)"
TASK = "niah_single_1"
TARGET_SPEEDUP = 5.0

Progress = Callable[[str], None]


def require_peer() -> None:
    """Import the peer stack or raise PeerMissing with the install command (one line)."""
    missing, broken = [], []
    for name in PEER_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
        except Exception as e:  # an installed but unusable package (version clash, missing library)
            broken.append(f"{name} ({type(e).__name__}: {e})")
    if missing:
        raise PeerMissing(f"page-local bench peer needs the optional [peer] extra, missing: "
                          f"{', '.join(missing)}; install it with {INSTALL_HINT}")
    if broken:
        raise PeerMissing(f"the [peer] extra does not import: {'; '.join(broken)}; reinstall it with {INSTALL_HINT}")


@dataclass
class Run:
    """One system on one prompt in one mode."""

    tokens: list[int]  # the gen generated tokens
    answer: str  # decoded tokens up to the first end-of-generation token
    total_s: float  # prefill + compression + gen tokens, wall clock
    cpu_s: float  # the same span in CPU seconds of this process (every thread; the other system is idle)
    prefill_s: float  # prefill + compression (+ the re-decoded last prompt token for page-local)
    kept: int  # prompt positions held after compression (per KV head for kvpress)


class _PageLocal:
    """page-local's Engine; gen tokens are always generated (greedy decoding continues past the end
    of the answer, as the kvpress side does), so that both time the same number of decode steps."""

    def __init__(self, model_path, budget, n_ctx: int, threads: int, n_gpu_layers: int | str | None = None,
                 rpc=None, attention_settings=None):
        from page_local.engine.engine import Engine

        self.eng = Engine(model_path, n_ctx=n_ctx, budget=budget, evictor="snapkv", gate="always",
                          threads=threads, n_gpu_layers=n_gpu_layers, rpc=rpc, attention_settings=attention_settings)

    def run(self, tokens: list[int], gen: int, evict: bool) -> Run:
        eng = self.eng
        eng.set_gate("always" if evict else "never")
        t0, c0 = time.perf_counter(), time.process_time()
        res = eng.generate(tokens, max_tokens=gen)
        out = list(res.tokens)
        if len(out) < gen:  # the answer ended: keep decoding greedily, as the engine would
            ctx = eng.ctx
            tok = int(np.argmax(ctx.logits()))
            while len(out) < gen:
                out.append(tok)
                ctx.decode([tok], ctx.seq_pos_max(0) + 1, 0)
                tok = int(np.argmax(ctx.logits()))
        total, cpu = time.perf_counter() - t0, time.process_time() - c0
        d = res.decision
        return Run(out, res.text, total, cpu, (d.prefill_ms + d.probe_ms + d.gate_ms + d.evict_ms) / 1e3, d.kept)

    def close(self) -> None:
        self.eng.close()


class _KVPress:
    """The same GGUF in transformers (float32, CPU) with kvpress's SnapKVPress."""

    def __init__(self, model_path: Path, threads: int, is_eog: Callable[[int], bool]):
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

        import kvpress  # noqa: F401  (registers the "kv-press-text-generation" pipeline)

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        torch.set_num_threads(threads)
        self.torch = torch
        path = Path(model_path)
        # transformers' GGUF loader draws a progress bar per tensor on stderr; errors still raise
        with contextlib.redirect_stderr(io.StringIO()):
            self.tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
            self.model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                              dtype=torch.float32).eval()
        self.pipe = pipeline("kv-press-text-generation", model=self.model, tokenizer=self.tok, device="cpu")
        self.is_eog = is_eog

    def press(self, budget: float, window: int | None, kernel: int | None):
        """SnapKVPress at kvpress's defaults (window 64, kernel 5) unless window / kernel are given."""
        from kvpress import SnapKVPress

        opts = {k: v for k, v in (("window_size", window), ("kernel_size", kernel)) if v is not None}
        return SnapKVPress(compression_ratio=1.0 - budget, **opts)

    def run(self, tokens: list[int], gen: int, press) -> Run:
        """Query-aware: prefill tokens[:-1] under the press (kvpress's pipeline: model.model, no LM
        head), then the last prompt token and gen greedy tokens at their original positions."""
        from transformers import DynamicCache

        torch = self.torch
        T = len(tokens)
        ids = torch.tensor([tokens], dtype=torch.long)
        with torch.inference_mode():
            t0, c0 = time.perf_counter(), time.process_time()
            cache = DynamicCache()
            with press(self.model) if press is not None else contextlib.nullcontext():
                self.model.model(input_ids=ids[:, :-1], past_key_values=cache)
            t1 = time.perf_counter()
            kept = int(cache.get_seq_length(0)) + 1  # + the last prompt token, as page-local counts it
            out: list[int] = []
            nxt, pos = ids[:, -1:], T - 1
            for _ in range(gen + 1):  # the last prompt token, then every generated token, decoded
                logits = self.model(input_ids=nxt, past_key_values=cache,
                                    position_ids=torch.tensor([[pos]]), logits_to_keep=1).logits
                if len(out) == gen:
                    break
                tok = int(logits[0, -1].argmax())
                out.append(tok)
                nxt, pos = torch.tensor([[tok]]), pos + 1
            total, cpu = time.perf_counter() - t0, time.process_time() - c0
        return Run(out, self.decode(out), total, cpu, t1 - t0, kept)

    def decode(self, out: list[int]) -> str:
        end = next((i for i, t in enumerate(out) if self.is_eog(t)), len(out))
        return self.tok.decode(out[:end], skip_special_tokens=True)

    def pipeline_agnostic(self, sample, gen: int, press) -> tuple[str, float, list[int]]:
        """kvpress's default use: its pipeline compresses the context alone, then reads the question.
        Returns the answer, the seconds and the pipeline's tokens (context + question + prefix)."""
        torch = self.torch
        context, question, prefix = sample.context.rstrip(), "\n\n" + sample.question.strip(), \
            sample.answer_prefix.strip()
        pre = self.pipe.preprocess(context, questions=[question], answer_prefix=prefix,
                                   max_context_length=1 << 30)
        ids = pre["context_ids"][0].tolist() + pre["questions_ids"][0][0].tolist()
        with torch.inference_mode():
            t0 = time.perf_counter()
            answer = self.pipe(context, question=question, answer_prefix=prefix, press=press,
                               max_new_tokens=gen)["answer"]
        return answer, time.perf_counter() - t0, ids


def _prompts(model, tokens: int, n: int, seed: int):
    """n niah_single_1 prompts of at most `tokens` tokens (chat template included), exactly as
    `page-local eval run --tasks niah_single_1 --length TOKENS --seed SEED` builds them."""
    from page_local.chat.prompts import ChatPrompter
    from page_local.tasks.synthetic import generate

    prompter = ChatPrompter(model)
    samples = generate(TASK, n, tokens - prompter.overhead, prompter.count_tokens, seed)
    return [prompter.prompt(s) for s in samples]


def _check(tokens, budget, n, gen, threads, seed, window, kernel) -> None:
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"--kvpress-window must be an int >= 1, got {window!r}")
    if kernel is not None and (isinstance(kernel, bool) or not isinstance(kernel, int) or kernel < 1
                               or kernel % 2 == 0):
        raise ValueError(f"--kvpress-kernel must be an odd int >= 1, got {kernel!r}")
    for name, v, low in (("tokens", tokens, 256), ("n", n, 1), ("gen", gen, 1), ("threads", threads, 1),
                         ("seed", seed, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"--{name} must be an int >= {low}, got {v!r}")
    if isinstance(budget, bool) or not isinstance(budget, float) or not 0 < budget < 1:
        raise ValueError(f"--budget must be a ratio in (0, 1) (kvpress takes compression_ratio = 1 - budget), "
                         f"got {budget!r}")


def _median(xs) -> float:
    return float(statistics.median(xs))


def peer_benchmark(model_path, tokens: int = 2048, budget: float = 0.25, n: int = 20, gen: int = 32,
                   threads: int = 2, seed: int = 42, kvpress_window: int | None = None,
                   kvpress_kernel: int | None = None, progress: Progress | None = None,
                   n_gpu_layers: int | str | None = None, rpc=None, attention_settings=None) -> dict:
    """Time (prefill + compression + gen greedy tokens) and needle accuracy of page-local and kvpress,
    SnapKV at the same budget, on n niah_single_1 prompts of about `tokens` tokens. n_gpu_layers, rpc,
    attention_settings: page-local's, as Engine's."""
    from page_local.tasks import scoring
    from page_local.tasks.scoring import normalize_prediction
    from page_local.native.runtime import Model

    _check(tokens, budget, n, gen, threads, seed, kvpress_window, kvpress_kernel)
    require_peer()
    import kvpress
    import torch
    import transformers

    say = progress or (lambda _m: None)
    model_path = Path(model_path)
    load_start = _loadavg()
    with Model(model_path, n_gpu_layers=0) as model:  # the tokenizer only
        prompts = _prompts(model, tokens, n, seed)
    pl = _PageLocal(model_path, budget, n_ctx=max(p.n for p in prompts) + gen + 64, threads=threads,
                    n_gpu_layers=n_gpu_layers, rpc=rpc, attention_settings=attention_settings)
    device = pl.eng.placement
    try:
        say(f"{len(prompts)} {TASK} prompts of {min(p.n for p in prompts)}-{max(p.n for p in prompts)} tokens; "
            f"loading {model_path.name} into transformers (float32)")
        peer = _KVPress(model_path, threads, pl.eng.model.is_eog)
        press = peer.press(budget, kvpress_window, kvpress_kernel)
        # warm-up (first graph build, allocator, oneDNN kernels): a short prompt through each system
        warm = prompts[0].tokens[:256]
        pl.run(warm, 2, True)
        peer.run(warm, 2, press)

        rows = []
        for i, p in enumerate(prompts):
            s = p.sample
            order = ("page-local", "kvpress") if i % 2 == 0 else ("kvpress", "page-local")
            row: dict = {"index": s.index, "T": p.n, "answers": s.answers}
            for mode in ("evicted", "full"):
                for system in order:
                    if system == "page-local":
                        r = pl.run(p.tokens, gen, evict=mode == "evicted")
                    else:
                        r = peer.run(p.tokens, gen, press if mode == "evicted" else None)
                    row[f"{system}_{mode}"] = {"total_s": round(r.total_s, 4), "cpu_s": round(r.cpu_s, 4),
                                               "prefill_s": round(r.prefill_s, 4),
                                               "kept": r.kept, "answer": r.answer,
                                               "score": scoring.score(s, r.answer)}
            answer, secs, ids = peer.pipeline_agnostic(s, gen, press)
            row["kvpress_pipeline_query_agnostic"] = {"total_s": round(secs, 4), "answer": answer,
                                                      "score": scoring.score(s, answer),
                                                      "same_tokens": ids == p.tokens}
            rows.append(row)
            pe, ke = row["page-local_evicted"], row["kvpress_evicted"]
            say(f"[{i + 1}/{len(prompts)}] T={p.n}: page-local {pe['total_s']:.2f} s ({pe['cpu_s']:.2f} s CPU), "
                f"kvpress {ke['total_s']:.2f} s ({ke['cpu_s']:.2f} s CPU); answers: page-local "
                f"{row['page-local_evicted']['answer'].strip()!r}, kvpress {row['kvpress_evicted']['answer'].strip()!r}")
    finally:
        pl.close()

    def med(key: str, field: str) -> float:
        return _median([r[key][field] for r in rows])

    def acc(key: str) -> float:
        return sum(r[key]["score"] for r in rows) / len(rows)

    t_pl, t_kv = med("page-local_evicted", "total_s"), med("kvpress_evicted", "total_s")
    paired = [r["kvpress_evicted"]["total_s"] / r["page-local_evicted"]["total_s"] for r in rows]
    agree = sum(normalize_prediction(r["page-local_full"]["answer"]) == normalize_prediction(r["kvpress_full"]["answer"])
                for r in rows)
    return {
        "bench": "peer",
        "model": model_path.name,
        "task": TASK,
        "n": len(rows),
        "tokens": tokens,
        "T_min": min(r["T"] for r in rows),
        "T_max": max(r["T"] for r in rows),
        "budget": budget,
        "kvpress_compression_ratio": round(1.0 - budget, 6),
        "kvpress_press": repr(press),
        "gen": gen,
        "threads": threads,
        "page_local_device": device,
        "seed": seed,
        "mode": "query-aware (question and answer prefix compressed with the context), as page-local's Engine",
        "versions": {"kvpress": _version("kvpress", kvpress), "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "page_local_s": round(t_pl, 4),
        "kvpress_s": round(t_kv, 4),
        "speedup": round(t_kv / t_pl, 3),  # time_kvpress / time_page_local: > 1 means page-local is faster
        "speedup_paired_median": round(_median(paired), 3),
        # CPU seconds of the same spans: less sensitive to other processes on a shared machine
        "page_local_cpu_s": round(med("page-local_evicted", "cpu_s"), 4),
        "kvpress_cpu_s": round(med("kvpress_evicted", "cpu_s"), 4),
        "speedup_cpu": round(med("kvpress_evicted", "cpu_s") / med("page-local_evicted", "cpu_s"), 3),
        "target_speedup": TARGET_SPEEDUP,
        "page_local_prefill_s": round(med("page-local_evicted", "prefill_s"), 4),
        "kvpress_prefill_s": round(med("kvpress_evicted", "prefill_s"), 4),
        "page_local_full_s": round(med("page-local_full", "total_s"), 4),
        "kvpress_full_s": round(med("kvpress_full", "total_s"), 4),
        "page_local_kept": int(_median([r["page-local_evicted"]["kept"] for r in rows])),
        "kvpress_kept_per_kv_head": int(_median([r["kvpress_evicted"]["kept"] for r in rows])),
        "accuracy": {
            "page_local_full": acc("page-local_full"),
            "kvpress_full": acc("kvpress_full"),
            "page_local_snapkv": acc("page-local_evicted"),
            "kvpress_snapkv": acc("kvpress_evicted"),
            "kvpress_snapkv_query_agnostic": acc("kvpress_pipeline_query_agnostic"),
        },
        "full_cache_same_answer": agree,
        "kvpress_pipeline_same_tokens": sum(r["kvpress_pipeline_query_agnostic"]["same_tokens"] for r in rows),
        "keep_sets": "kvpress: one per KV head and layer; page-local: one per position, shared by every layer and head",
        # 1-minute load average at the start and the end; the benchmark's own threads count in it, so
        # clearly above the thread count means that other processes shared the cores
        "loadavg_start": load_start,
        "loadavg_end": _loadavg(),
        "rows": rows,
    }


def _loadavg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):  # not on every platform
        return None


def _version(dist: str, module) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return getattr(module, "__version__", "unknown")


def describe(r: dict) -> str:
    """The human-readable summary of peer_benchmark's result."""
    a = r["accuracy"]
    faster = (f"page-local is {r['speedup']:.1f}x faster than kvpress" if r["speedup"] >= 1
              else f"page-local is {1 / r['speedup']:.1f}x slower than kvpress")

    def pct(x: float) -> str:
        return f"{100 * x:.0f}%"

    return "\n".join([
        f"{r['n']} {r['task']} prompts of {r['T_min']}-{r['T_max']} tokens ({r['model']}), SnapKV to "
        f"{r['budget']:g} (page-local keeps {r['page_local_kept']} positions shared by all heads, kvpress "
        f"{r['kvpress_kept_per_kv_head']} per KV head), {r['gen']} greedy tokens, {r['threads']} threads; "
        f"kvpress {r['versions']['kvpress']} {r['kvpress_press']}, torch {r['versions']['torch']} (float32)",
        f"time for prefill + compression + {r['gen']} tokens, median per prompt (alternated): page-local "
        f"{r['page_local_s']:.2f} s, kvpress {r['kvpress_s']:.2f} s",
        f"{faster} (time_kvpress / time_page_local = {r['speedup']:.2f}, paired median "
        f"{r['speedup_paired_median']:.2f}; target >= {r['target_speedup']:g}); in CPU seconds: page-local "
        f"{r['page_local_cpu_s']:.2f}, kvpress {r['kvpress_cpu_s']:.2f}, ratio {r['speedup_cpu']:.2f}",
        f"accuracy (string_match_all): full cache page-local {pct(a['page_local_full'])}, kvpress "
        f"{pct(a['kvpress_full'])} (same answer on {r['full_cache_same_answer']}/{r['n']}); SnapKV {r['budget']:g}: "
        f"page-local {pct(a['page_local_snapkv'])} (one shared keep set), kvpress {pct(a['kvpress_snapkv'])} "
        f"(per-KV-head keep sets); kvpress pipeline query-agnostic (its default): "
        f"{pct(a['kvpress_snapkv_query_agnostic'])}",
    ] + ([f"1-minute load average {r['loadavg_start']} at the start, {r['loadavg_end']} at the end "
          f"({r['threads']} threads): the machine was shared, quote ratios, not absolute times"]
         if max(r["loadavg_start"] or 0, r["loadavg_end"] or 0) > r["threads"] + 1 else []))
