"""The engine: one turn of PAGE-gated eviction on llama.cpp, and the API desktop apps embed.

A turn (docs/design.md §5, "One turn through the engine"):
  1. tokenize; decode prompt[:-W] normally;
  2. arm the probe; decode prompt[-W:] as one batch;
  3. D = signal.drop(probe); gate.decide(D) -> open or closed;
  4. open and T > B: keep = evictor.select(...); evict the rest; remove the last prompt token's
     cell and decode it again at its original position, so the first sampled token sees the
     compressed cache;
  5. generate with our own sampler loop (llama-cpp-python's Llama.generate assumes contiguous
     positions, which an evicted sequence does not have).

    with Engine(budget=0.25) as eng:
        out = eng.generate("Summarise: ...", max_tokens=64)
        print(out.text, out.decision.open, out.decision.D)
"""

from __future__ import annotations

import codecs
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from . import gate as gate_mod
from . import models
from .evictors import get_evictor
from .evictors.base import EvictionInput, resolve_budget
from .lookahead import MAX_FUTURES, Lookahead, log_softmax, run_lookahead
from .probe import ProbeResult
from .runtime import Context, ContextConfig, Model
from .verify import VERIFY_CAP, VERIFY_RULE, check_rule, top_token, verify_score

W = 32
TOP_K = 32
N_SINK = 4
# Signals _prefill_and_gate hands to evictors (evictors.base.NEEDS lists every known one). An evictor
# needing anything else is refused when it is chosen, not mid-turn on the turns where the gate opens.
PROVIDED = frozenset({"probe", "last_query", "prefill_attention", "key_norms", "lookahead"})


# Self-verified eviction (verify.py): the answer is generated with the full cache until it ends or
# verify_tokens (default VERIFY_CAP) tokens, then teacher-forced on the evicted candidate in one batch;
# the eviction is committed iff verify.verify_score passes (default rule VERIFY_RULE).
GATE_MODES = ("page", "always", "never", "verify", "page+verify")
_BASE_GATE = {"page": "page", "always": "always", "never": "never", "verify": "always", "page+verify": "page"}


def _check_gate_mode(mode: str) -> str:
    if mode not in GATE_MODES:
        raise ValueError(f"gate mode must be one of {', '.join(GATE_MODES)}; got {mode!r}")
    return mode


class ContextFull(RuntimeError):
    """The turn does not fit in n_ctx and nothing may be dropped (the gate kept the full cache)."""

    def __init__(self, used: int, needed: int, n_ctx: int, gate_open: bool | None = None):
        self.used, self.needed, self.n_ctx, self.gate_open = used, needed, n_ctx, gate_open
        super().__init__(
            f"the context is full: {used} cells are in use and this turn needs {needed} more, "
            f"but n_ctx is {n_ctx}. Nothing was dropped. Start a new conversation or use a larger n_ctx "
            "(n_ctx is rounded up to a multiple of 256)."
        )


class EngineBusy(RuntimeError):
    """An Engine is not thread-safe: one generation at a time."""


@dataclass
class Decision:
    """What the gate and the evictor did on one turn."""

    T: int  # positions in the sequence after this turn's prompt
    B: int  # budget (kept positions if the gate opens and T > B)
    D: float | None  # PAGE's drop (None when the probe did not run)
    z: float | None  # calibrated score, when the model has a profile
    open: bool  # the gate's decision
    evicted: bool  # eviction actually ran (open and T > B)
    kept: int  # positions held after the decision
    compression: float  # T / kept
    gate_mode: str
    rule: str  # raw | calibrated | forced
    reason: str  # plain words
    evictor: str
    prefill_ms: float = 0.0
    probe_ms: float = 0.0  # reading the probe result
    gate_ms: float = 0.0  # signal + gate
    evict_ms: float = 0.0  # selection + eviction + re-decode of the last prompt token
    agreement: list[float] = field(default_factory=list)  # per-layer head agreement
    # self-verified eviction (gate modes "verify" and "page+verify"); None when it did not run
    verify_m: int | None = None  # answer tokens checked (the span; its end-of-generation not counted)
    verify_until: str | None = None  # end (the answer ended in the span: its end was checked too) | cap | length
    verify_rule: str | None = None  # verify.RULES: how the span was scored
    verify_score: float | None = None  # the rule's score over the span
    verify_threshold: float | None = None  # score <= threshold commits the eviction
    verify_delta: float | None = None  # mean over the span of log p_full - log p_evicted (nats/token)
    verify_max: float | None = None  # the largest per-token loss (nats)
    verify_changed: int | None = None  # positions where the evicted cache's top token differs
    verify_top1: float | None = None  # fraction of positions the evicted cache ranks the same token first
    verify_kl_first: float | None = None  # KL(p_full || p_evicted) of the first generated token
    verify_ms: float | None = None  # the extra batch decode and the comparison
    lookahead_ms: float | None = None  # LORE-KV: sampling the futures and scoring the prompt (in evict_ms)
    gate_note: str | None = None  # a calibrated gate used far outside its pilot's prompt lengths

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Result:
    text: str
    tokens: list[int]
    decision: Decision
    finish_reason: str  # stop | length | context | interrupted
    prompt_tokens: int
    gen_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.gen_s if self.gen_s > 0 else 0.0


@dataclass
class Sampling:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 40
    top_p: float = 0.95
    seed: int = 0

    def validate(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and 0 <= self.temperature <= 5):
            raise ValueError(f"temperature must be in [0, 5], got {self.temperature!r}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0, got {self.top_k!r}")


class Engine:
    """A model, a context and the PAGE pipeline. Not thread-safe: use one engine per thread."""

    def __init__(self, model: str | os.PathLike | None = None, n_ctx: int = 4096, budget: float | int = 0.25,
                 evictor: str = "snapkv", gate: str = "verify", threads: int = 2, flash_attn: str = "auto",
                 type_kv: str = "f16", seed: int = 0, evictor_options: dict | None = None,
                 verify_tokens: int = VERIFY_CAP, verify_threshold: float | None = None,
                 verify_rule: str = VERIFY_RULE, compact: bool = True,
                 n_gpu_layers: int | str | None = None, allow_long_context: bool = False):
        path = Path(model) if model is not None else models.default_model_path()
        self.set_verify(verify_tokens, verify_threshold, verify_rule)
        self.compact = bool(compact)
        self.set_budget(budget)
        self._evictor = _supported(get_evictor(evictor, **(evictor_options or {})))
        self.gate_mode = _check_gate_mode(gate)  # validates the mode before loading anything
        # n_gpu_layers: a count, 'all', or None = $PAGE_LOCAL_N_GPU_LAYERS, else all on a GPU build, else 0
        # (Model validates it before loading anything)
        self.seed = seed
        self._lock = threading.Lock()
        self.model = Model(path, n_gpu_layers=n_gpu_layers)
        try:
            self.ctx = Context(self.model, ContextConfig(n_ctx=n_ctx, threads=threads, flash_attn=flash_attn,
                                                         type_kv=type_kv, n_seq_max=1 + MAX_FUTURES,
                                                         allow_long_context=allow_long_context))
        except Exception:
            self.model.close()
            raise
        try:
            self.ctx.cells_used(0)  # UnsupportedModel now (no KV cache: encoder-only...), not on the first turn
        except Exception:
            self.close()
            raise
        self.model_id = gate_mod.model_identity(path)
        self.gate = gate_mod.Gate.for_model(self.model_id, _BASE_GATE[gate])
        self.profile_warning = self.gate.warning
        self.history: list[int] = []  # tokens in seq 0, in order (evicted ones included)
        self.last_decision: Decision | None = None
        self.last_lookahead: Lookahead | None = None
        self._out_proj: dict[str, np.ndarray] = {}

    # --- settings ----------------------------------------------------------------------------
    def set_budget(self, budget: float | int) -> None:
        resolve_budget(budget, 10_000, W, N_SINK)  # validates (ratio or absolute) before use
        self.budget = budget

    def set_evictor(self, name: str, **options) -> None:
        self._evictor = _supported(get_evictor(name, **options))

    def set_gate(self, mode: str) -> None:
        """page | always | never | verify | page+verify (see GATE_MODES)."""
        self.gate_mode = _check_gate_mode(mode)
        self.gate = gate_mod.Gate(_BASE_GATE[mode], self.gate.profile)

    def set_verify(self, tokens: int = VERIFY_CAP, threshold: float | None = None, rule: str = VERIFY_RULE) -> None:
        """tokens: the most answer tokens checked (the check ends earlier with the answer); rule and
        threshold: verify.RULES (threshold None = the rule's default)."""
        if isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= 256:
            raise ValueError(f"verify_tokens must be an int in [1, 256], got {tokens!r}")
        rule, threshold = check_rule(rule, threshold)
        self.verify_tokens, self.verify_threshold, self.verify_rule = tokens, threshold, rule

    @property
    def evictor(self) -> str:
        return self._evictor.name

    @property
    def n_ctx(self) -> int:
        return self.ctx.n_ctx

    @property
    def placement(self) -> dict:
        """Which device holds the layers and the KV cache: {"layers", "kv_cache", "n_gpu_layers", ...}."""
        return self.ctx.placement()

    def cells_used(self) -> int:
        return self.ctx.cells_used(0)

    def reset(self) -> None:
        """Forget the conversation: the KV cache is cleared."""
        self.ctx.clear()
        self.history = []

    # --- one turn ----------------------------------------------------------------------------
    def stream(self, prompt: str | list[int], max_tokens: int = 256, sampling: Sampling | None = None,
               add_special: bool = True) -> Iterator[str]:
        """Yield text pieces; the Result is in self.last_result afterwards."""
        if not self._lock.acquire(blocking=False):
            raise EngineBusy("this Engine is already generating in another thread; use one Engine per thread")
        try:
            yield from self._turn(prompt, max_tokens, sampling or Sampling(), add_special)
        finally:
            self._lock.release()

    def generate(self, prompt: str | list[int], max_tokens: int = 256, sampling: Sampling | None = None,
                 on_text: Callable[[str], None] | None = None, add_special: bool = True) -> Result:
        """Run one turn on a fresh cache (the conversation is reset first) and return the Result."""
        # Take the lock before reset(): a second thread must get EngineBusy, not clear the cache under
        # the turn that is running.
        if not self._lock.acquire(blocking=False):
            raise EngineBusy("this Engine is already generating in another thread; use one Engine per thread")
        try:
            self.reset()
            for piece in self._turn(prompt, max_tokens, sampling or Sampling(), add_special):
                if on_text:
                    on_text(piece)
        finally:
            self._lock.release()
        return self.last_result

    def _tokens(self, prompt: str | list[int], add_special: bool) -> list[int]:
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ValueError("the prompt is empty")
            toks = self.model.tokenize(prompt, add_special=add_special and not self.history)
        else:
            toks = [int(t) for t in prompt]
            if not toks:
                raise ValueError("the prompt is empty")
            bad = [t for t in toks if not 0 <= t < self.model.n_vocab]
            if bad:
                raise ValueError(f"token ids {bad[:5]} are outside the vocabulary (0..{self.model.n_vocab - 1})")
        return toks

    def _turn(self, prompt, max_tokens: int, sampling: Sampling, add_special: bool) -> Iterator[str]:
        sampling.validate()
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
        toks = self._tokens(prompt, add_special)
        ctx = self.ctx
        used = self.cells_used()
        if used + len(toks) + 1 > ctx.n_ctx:
            raise ContextFull(used, len(toks) + 1, ctx.n_ctx)

        verify = self.gate_mode in ("verify", "page+verify")
        dec, plan = self._prefill_and_gate(toks, apply=not verify)
        self.last_decision = dec

        # generation: sample, decode, then yield, so that what the caller has seen is in the cache
        sampler = _make_sampler(sampling, self.model)
        out: list[int] = []
        lp_full: list[np.ndarray] = []  # f32 (n_vocab,) log-probs of the full cache, while verifying
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        finish = "length"
        t0 = time.perf_counter()
        used = self.cells_used()  # kept up to date below: no native scan of the cells per token
        try:
            for _ in range(max_tokens):
                if plan is not None:
                    lp_full.append(_log_softmax(ctx.logits()))
                tok = int(native_sample(sampler, ctx))
                if self.model.is_eog(tok):
                    finish = "stop"
                    if plan is not None and out:  # the answer ended inside the span: check it, end included
                        self._verify(dec, plan, out, lp_full, end=tok)
                        plan = None
                    break
                if used + 1 > ctx.n_ctx:
                    finish = "context"
                    break
                ctx.decode([tok], ctx.seq_pos_max(0) + 1, 0)
                used += 1
                self.history.append(tok)
                out.append(tok)
                if plan is not None and len(out) == self.verify_tokens:  # the cap: decide on what there is
                    self._verify(dec, plan, out, lp_full, until="cap")
                    plan = None
                    used = self.cells_used()
                piece = decoder.decode(self.model.token_to_piece(tok))
                if piece:
                    yield piece
            if plan is not None and out:  # max_tokens or a full context before the cap: check what there is
                self._verify(dec, plan, out, lp_full[: len(out)], until="length")
                plan = None
            tail = decoder.decode(b"", final=True)
            if tail:
                yield tail
        except (GeneratorExit, KeyboardInterrupt):
            finish = "interrupted"
            raise
        finally:
            ctx.seq_rm(1, -1, -1)  # an unfinished verification leaves nothing behind
            sampler.close()
            gen_s = time.perf_counter() - t0
            self.last_result = Result(self.model.detokenize(out), out, dec, finish, len(toks), gen_s)

    def _verify(self, dec: Decision, plan: tuple, out: list[int], lp_full: list[np.ndarray],
                end: int | None = None, until: str = "end") -> None:
        """Self-verified eviction: teacher-force the generated tokens on an evicted copy of the sequence
        (seq 1, sharing the prompt's cells) in one batch and score them with verify.verify_score; commit
        the copy iff it passes. end: the end-of-generation token the full cache chose after out (then
        lp_full has one more entry, and the candidate must end the answer there too). Updates dec."""
        ctx, page = self.ctx, self.ctx.page
        keep, held, last_pos, last_tok = plan
        m = len(out)
        t0 = time.perf_counter()
        dec.verify_threshold, dec.verify_rule = self.verify_threshold, self.verify_rule
        if self.cells_used() + m + 1 > ctx.n_ctx:
            dec.reason += "; self-verification skipped: no room in the cache for the evicted candidate"
            return
        ctx.seq_cp(0, 1, -1, last_pos)  # the prompt minus its last token, cells shared
        prefix = held[held < last_pos]
        page.evict(1, np.setdiff1d(prefix, keep, assume_unique=True))
        ctx.decode([last_tok] + out, last_pos, 1, logits="all")
        y = list(out) + ([end] if end is not None else [])
        k = len(y)  # positions: m answer tokens (+ the answer's end)
        lp_ev = [_log_softmax(ctx.logits(i)) for i in range(k)]
        lp_full = lp_full[:k]
        full = np.array([lp[t] for lp, t in zip(lp_full, y)], dtype=np.float64)
        ev = np.array([lp[t] for lp, t in zip(lp_ev, y)], dtype=np.float64)
        top_f = [top_token(lp, self.model.is_eog) for lp in lp_full]
        top_e = [top_token(lp, self.model.is_eog) for lp in lp_ev]
        changed = np.array([a != b for a, b in zip(top_f, top_e)], dtype=bool)
        v = verify_score(full, ev, changed, rule=self.verify_rule, threshold=self.verify_threshold)
        p0 = np.exp(lp_full[0].astype(np.float64))
        kl = float(np.sum(p0 * (lp_full[0].astype(np.float64) - lp_ev[0].astype(np.float64))))
        commit = v.passed
        if commit:  # the candidate already holds the m tokens: it becomes the sequence
            ctx.seq_rm(0, -1, -1)
            ctx.seq_cp(1, 0)
            ctx.seq_rm(1, -1, -1)
            # the last output of the batch above is the evicted cache's next-token distribution;
            # compaction would rewrite the cells and lose it, so re-decode the newest token after it
            if self.compact:
                p = ctx.seq_pos_max(0)
                ctx.seq_rm(0, p, p + 1)
                self._compact()
                ctx.decode([out[-1]], p, 0)
        else:
            ctx.seq_rm(1, -1, -1)
            p = ctx.seq_pos_max(0)  # restore seq 0's next-token logits
            ctx.seq_rm(0, p, p + 1)
            ctx.decode([out[-1]], p, 0)
        dec.verify_m, dec.verify_until = m, until
        dec.verify_score, dec.verify_delta, dec.verify_max, dec.verify_changed = v.score, v.mean, v.max, v.changed
        dec.verify_top1, dec.verify_kl_first = float(1.0 - changed.mean()), kl
        dec.verify_ms = (time.perf_counter() - t0) * 1e3
        dec.evicted = commit
        dec.kept = self.cells_used() - m  # prompt positions held after the decision
        dec.compression = dec.T / dec.kept if dec.kept else 1.0
        span = {"end": f"the whole answer ({m} tokens and its end)", "cap": f"the first {m} tokens (the cap)",
                "length": f"all {m} tokens generated"}[until]
        dec.reason += (f"; self-verification over {span}: {v.describe()}, "
                       + ("eviction committed" if commit else "kept the full cache"))

    def _compact(self) -> None:
        """Move the sequence's cells down after eviction: llama.cpp attends over every cell up to the
        highest used one, so holes left by eviction would keep decoding as slow as the full cache."""
        if self.compact:
            self.ctx.page.compact(0)

    def measure(self, prompt: str | list[int], add_special: bool = True) -> Decision:
        """Prefill `prompt` on a fresh cache, probe and gate it, without evicting or generating
        (for calibration and inspection). The probe result is in self.last_probe."""
        if not self._lock.acquire(blocking=False):
            raise EngineBusy("this Engine is already generating in another thread; use one Engine per thread")
        try:
            self.reset()
            toks = self._tokens(prompt, add_special)
            if len(toks) + 1 > self.ctx.n_ctx:
                raise ContextFull(0, len(toks) + 1, self.ctx.n_ctx)
            dec, _ = self._prefill_and_gate(toks, apply=False, select=False)
            self.last_decision = dec
            return dec
        finally:
            self._lock.release()

    def _prefill_and_gate(self, toks: list[int], apply: bool = True, select: bool = True) -> tuple[Decision, tuple | None]:
        """Prefill, probe, gate and (apply=True) evict. Returns the Decision and, when the gate
        opened and T > B but apply=False, the eviction plan (keep, held, last_pos, last_tok)."""
        ctx, page = self.ctx, self.ctx.page
        pos0 = ctx.seq_pos_max(0) + 1
        n_hist = len(self.history)
        try:
            return self._prefill_and_gate_impl(toks, pos0, apply, select)
        except BaseException:
            # an interrupted or failed prefill must not leave part of the turn in the cache
            ctx.seq_rm(0, pos0, -1)
            page.disarm_probe()
            del self.history[n_hist:]
            raise

    def _prefill_and_gate_impl(self, toks, pos0, apply, select):
        ctx, page = self.ctx, self.ctx.page
        n = len(toks)
        w = min(W, n)
        needs = self._evictor.needs
        t0 = time.perf_counter()
        prefill_attn = self._prefill(toks[: n - w], pos0, track=select and "prefill_attention" in needs)
        page.arm_probe(0, TOP_K)
        ctx.decode(toks[n - w :], pos0 + n - w, 0)
        t1 = time.perf_counter()
        probe = page.read_probe()
        self.last_probe = probe
        self.history.extend(toks)
        t2 = time.perf_counter()
        held = page.positions(0)
        T = int(held.size)
        B = resolve_budget(self.budget, T, W, N_SINK)
        D, agreement = None, []
        if probe.n_head >= 2:
            from .signal import compute_signal

            sig = compute_signal(probe)
            D, agreement = float(sig.D), [float(a) for a in sig.agreement]
        g = self.gate.decide(D, n_tokens=T) if (D is not None or self.gate.mode != "page") else None
        t3 = time.perf_counter()
        is_open = bool(g.open) if g else False
        evicted = False
        plan = None
        lookahead_ms = None
        if is_open and T > B and select:
            last_pos, last_tok = pos0 + n - 1, toks[-1]
            last_query = None
            if "last_query" in needs:
                ctx.seq_rm(0, last_pos, last_pos + 1)
                page.arm_probe(0, TOP_K)
                ctx.decode([last_tok], last_pos, 0)
                last_query = page.read_probe()
            key_norms = None
            if "key_norms" in needs:  # f32 (n_layer, n_head_kv, T), columns aligned with held
                key_norms = page.key_norms(0, self.model.n_layer, self.model.n_head_kv)
            lookahead = None
            if "lookahead" in needs:  # LORE-KV: sampled futures score the prompt, then are removed
                lookahead = self.lookahead(ctx.logits())
                lookahead_ms = lookahead.ms
                if not apply:  # the logits buffer now holds the futures': restore the prompt's
                    ctx.seq_rm(0, last_pos, last_pos + 1)
                    ctx.decode([last_tok], last_pos, 0)
            inp = EvictionInput(held=held, budget=B, window=probe.queries, n_sink=N_SINK, probe=probe,
                                last_query=last_query, key_norms=key_norms, lookahead=lookahead,
                                prefill_attention=_align(prefill_attn, probe, held) if prefill_attn is not None else None,
                                seed=self.seed)
            keep = self._evictor.select(inp)
            if apply:
                page.evict(0, np.setdiff1d(held, keep, assume_unique=True))
                # the first sampled token must already see the compressed cache
                ctx.seq_rm(0, last_pos, last_pos + 1)
                self._compact()
                ctx.decode([last_tok], last_pos, 0)
                evicted = True
            else:
                plan = (keep, held, last_pos, last_tok)
        t4 = time.perf_counter()
        reason = g.reason if g else "the probe saw fewer than 2 heads; keeping the full cache"
        verify = {}
        if self.gate_mode in ("verify", "page+verify"):
            if self.gate_mode == "verify":
                reason = "gate mode 'verify': the evicted cache is checked on the answer (up to its end or the cap)"
            if is_open and T <= B:  # nothing to evict: the candidate is the full cache itself
                verify = dict(verify_m=0, verify_delta=0.0, verify_score=0.0, verify_rule=self.verify_rule,
                              verify_threshold=self.verify_threshold)
                reason += f"; T = {T} <= B = {B}: nothing to evict"
        kept = self.cells_used()
        return Decision(
            T=T, B=B, D=D, z=g.z if g else None, open=is_open, evicted=evicted, kept=kept,
            compression=T / kept if kept else 1.0, gate_mode=self.gate_mode,
            rule=g.rule if g else "none", reason=reason,
            evictor=self._evictor.name, prefill_ms=(t1 - t0) * 1e3, probe_ms=(t2 - t1) * 1e3,
            gate_ms=(t3 - t2) * 1e3, evict_ms=(t4 - t3) * 1e3, agreement=agreement, lookahead_ms=lookahead_ms,
            gate_note=g.note if g else None, **verify), plan

    def lookahead(self, last_logits: np.ndarray, spec=None, seq: int = 0) -> Lookahead:
        """Run a LORE-KV lookahead (spec: a LookaheadSpec; default the current evictor's) on seq, whose
        newest token produced last_logits; the futures are gone afterwards. Also in self.last_lookahead."""
        spec = spec or self._evictor.spec
        if spec.projection not in self._out_proj:
            from .outproj import context_out_proj_factors

            m = self.model
            self._out_proj[spec.projection] = context_out_proj_factors(
                self.ctx, m.n_layer, m.n_head, m.n_embd, spec.projection, path=m.path)
        self.last_lookahead = run_lookahead(self.ctx, seq, last_logits, spec, self._out_proj[spec.projection],
                                            self.model.is_eog)
        return self.last_lookahead

    def _prefill(self, toks: list[int], pos0: int, track: bool) -> tuple[np.ndarray, np.ndarray] | None:
        """Decode toks; with track, arm the probe on every ubatch-sized chunk and sum its column mass
        (H2O's accumulated attention). Returns (positions, f32 (n_layer, n_pos) sums) or None."""
        if not toks:
            return None
        if not track:
            self.ctx.decode(toks, pos0, 0, logits="none")
            return None
        acc: dict[int, np.ndarray] = {}
        step = self.ctx.n_ubatch
        for s in range(0, len(toks), step):
            chunk = toks[s : s + step]
            self.ctx.page.arm_probe(0, 1)
            self.ctx.decode(chunk, pos0 + s, 0, logits="none")
            r = self.ctx.page.read_probe()
            mass = r.mean * r.n_query  # f32 (n_layer, n_pos): summed over this chunk's queries
            for i, p in enumerate(r.positions.tolist()):
                acc[p] = acc.get(p, 0) + mass[:, i]
        pos = np.array(sorted(acc), dtype=np.int32)
        return pos, np.stack([acc[p] for p in pos.tolist()], axis=1).astype(np.float32)

    # --- lifetime ----------------------------------------------------------------------------
    def close(self) -> None:
        if getattr(self, "ctx", None) is not None:
            self.ctx.close()
            self.ctx = None
        if getattr(self, "model", None) is not None:
            self.model.close()
            self.model = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _supported(evictor):
    """The evictor, if the engine can provide every signal it needs; else ValueError saying which."""
    missing = sorted(evictor.needs - PROVIDED)
    if missing:
        what = ", ".join("key norms (key_norms)" if m == "key_norms" else m for m in missing)
        raise ValueError(f"evictor {evictor.name!r} needs {what}, which the engine does not provide; "
                         "choose another evictor")
    return evictor


def _align(prefill: tuple[np.ndarray, np.ndarray], probe: ProbeResult, held: np.ndarray) -> np.ndarray:
    """H2O scores aligned with `held`: prefill column sums plus the window's own (probe) mass."""
    pos, sums = prefill
    out = np.zeros((sums.shape[0], held.size), dtype=np.float32)
    idx = np.searchsorted(held, pos)
    ok = (idx < held.size) & (held[np.minimum(idx, held.size - 1)] == pos)
    out[:, idx[ok]] += sums[:, ok]
    j = np.searchsorted(held, probe.positions)
    okp = (j < held.size) & (held[np.minimum(j, held.size - 1)] == probe.positions)
    out[:, j[okp]] += probe.mean[:, okp] * probe.n_query
    return out


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    return log_softmax(logits).astype(np.float32)


def _make_sampler(s: Sampling, model: Model):
    from llama_cpp import _internals

    smp = _internals.LlamaSampler()
    if s.temperature <= 0:
        smp.add_greedy()
    else:
        if s.top_k > 0:
            smp.add_top_k(s.top_k)
        smp.add_top_p(s.top_p, 1)
        smp.add_temp(s.temperature)
        smp.add_dist(s.seed)
    return smp


def native_sample(sampler, ctx: Context) -> int:
    """Sample from the logits of the last decoded token."""
    from llama_cpp import llama_cpp as lc

    return lc.llama_sampler_sample(sampler.sampler, ctx.ptr, -1)
