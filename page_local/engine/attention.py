"""The attention path and KV cache type a context gets: page-local's own choice, by measurement.

llama.cpp's flash_attn "auto" turns flash attention on for the CPU backend, and stock llama.cpp's CPU kernel
decodes one token slower than the plain path once the cache holds a few thousand cells (Intel Xeon with
AVX-512: 1.8x at 1K cells to 3-6x at 8K; AMD EPYC Zen 1: 1.6x at 2K), while it reads a prompt as fast or
faster. page-local's kernel (csrc/kernels/page-fa-decode.cpp) replaces that decode kernel for an F16 cache with a
vectorised one (docs/design.md section 6.1): on AMD EPYC Zen 1 it decodes 1.04x (2K cells) to 1.19x (4K)
faster than the plain path, and prefill stays 1.3x faster than the plain path. So "auto" here means:

  1. an explicit "on"/"off" (AttentionSettings: --flash-attn, Engine(flash_attn=), else $PAGE_LOCAL_FLASH_ATTN)
     is used;
  2. a quantized V cache (q8_0, q4_0) needs flash attention in llama.cpp: on;
  3. a tuning measured by `page-local tune` for this model, machine, device, thread count and library
     (store/tuning.py) picks the path with the lower cost over the context (see `cost`);
  4. with no tuning stored, one is measured now, once (first use: `first_use`), in a time box of
     AUTOTUNE_S (30 s): both paths at 256, 1024 and 2048 cells, stopping before a length that would pass
     the box; longer contexts are extrapolated (cost_curve). $PAGE_LOCAL_AUTOTUNE=off skips it (then 5.),
     a number of seconds sets the box. A tuning measured while other processes took the cores it needs
     (`HostMeter`, `disturbed`) is not kept: it measures the machine's load, not its paths (then 5., and
     the next start measures again);
  5. else the backend's default: on (with the patched kernel on the CPU, measured above; llama.cpp's choice
     for GPUs).

`cost` weighs decode, as chat and serve are decode-dominated: a conversation that grows from 0 to n_ctx
cells, reading as many tokens as it writes, costs at T cells prefill_ms_per_token(T) + decode_ms(T).
On (page-local's decode kernel) is kept unless off's mean over [0, n_ctx] is lower beyond the timings'
spread (`decide`): the decode steps of the two paths alternate round by round and each point keeps their
median and interquartile range, so one slow step on a 2-core machine does not flip the choice.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from page_local.defaults import AUTOTUNE_ENV, AUTOTUNE_S, CACHE_ENV, CACHE_TYPES, FLASH_ATTN, FLASH_ENV

BUSY_CORES = 0.25  # other processes' average use of the cores a tuning needs beyond which it is not kept
TIE = 0.10  # off must cost 10 % less than on (or more than the timings' spread, if larger); else on is kept.
# Five first-use tunings in a row on a quiet AMD Zen 4 chose off by 3-7 % twice and on three times
# (scripts/five_tunings.py): differences that size are the host, not the paths.
TUNE_LENGTHS = (256, 1024, 2048)  # cells at which `page-local tune` times a decode step
BANDS = (1024, 2048, 4096, 8192, 16384, 32768)


def check_flash_attn(value: str, what: str = "flash_attn") -> str:
    if value not in FLASH_ATTN:
        raise ValueError(f"{what} must be one of {', '.join(FLASH_ATTN)}; got {value!r}")
    return value


def check_cache_type(value: str, what: str = "cache type") -> str:
    if value not in CACHE_TYPES:
        raise ValueError(f"{what} must be one of {', '.join(CACHE_TYPES)}; got {value!r}")
    return value


@dataclass(frozen=True)
class AttentionSettings:
    """What was asked for a context's attention, before page-local's choice (`choose`): flash_attn auto | on |
    off and cache_type f16 | q8_0 | q4_0 (K and V). Resolved once at an edge (the CLI's --flash-attn and
    --cache-type, an Engine's arguments: from_environment) and passed down as this value; each field is
    checked here, the pair by `resolve`."""

    flash_attn: str = "auto"
    cache_type: str = "f16"

    def __post_init__(self):
        check_flash_attn(self.flash_attn)
        check_cache_type(self.cache_type)


@dataclass(frozen=True)
class Attention:
    """What a context was created with, and why."""

    flash_attn: str  # "on" | "off"
    cache_type: str  # "f16" | "q8_0" | "q4_0" (K and V)
    source: str  # "requested" | "cache type" | "tuned" | "default"
    why: str

    def to_dict(self) -> dict:
        return {"flash_attn": self.flash_attn, "cache_type": self.cache_type, "source": self.source,
                "why": self.why}


# --- the decision (pure) ---------------------------------------------------------------------

def cost_curve(points: list[tuple[int, float, float]], t: np.ndarray) -> np.ndarray:
    """f64 (len(t),): prefill ms per token + decode ms at each T of t, from the measured points
    (T ascending), linear between them, constant below the first, and past the last continued with the
    least-squares slope of all the points (never below the last point: decode does not get cheaper as the
    cache grows). The slope of all points, not of the last segment alone: one slow or fast step at the last
    length would otherwise set the whole extrapolation to n_ctx (a last point below the one before made a
    path look flat to 32K cells)."""
    ts = np.array([p[0] for p in points], dtype=np.float64)
    c = np.array([p[1] + p[2] for p in points], dtype=np.float64)
    out = np.interp(t, ts, c)
    if len(ts) >= 2 and ts[-1] > ts[0]:
        slope = max(0.0, float(np.polyfit(ts, c, 1)[0]))
        past = t > ts[-1]
        out[past] = c[-1] + slope * (t[past] - ts[-1])
    return out


def mean_cost(points, lo: int, hi: int) -> float:
    """The mean of cost_curve over T in [lo, hi]."""
    t = np.linspace(max(1, lo), max(lo + 1, hi), 65)
    return float(cost_curve(points, t).mean())


def noise(points) -> float:
    """The relative spread of a setting's decode timings: the median over its lengths of spread / median (the
    fourth field of a point, the interquartile range of its alternated repeats; 0 for a point without one)."""
    rel = [p[3] / p[2] for p in points if len(p) > 3 and p[2] > 0]
    return float(np.median(rel)) if rel else 0.0


def decide(points: dict, n_ctx: int, lo: int = 0) -> tuple[str, str]:
    """("on"|"off", why) for a conversation over [lo, n_ctx] cells, from {"on": points, "off": points}.

    Flash attention on is the default path (page-local's decode kernel runs there): off is chosen only when
    it is faster beyond the measurement's spread — its mean cost below on's by more than TIE and by more than
    both settings' relative spreads, and at the longest length measured its decode and its cost (prefill and
    decode) lower by the same margin (a path without the kernel is never chosen where the kernel decodes, or
    reads, faster where it was measured). Single timings on a 2-core machine flip with the host's noise; this
    rule does not flip with it."""
    on, off = mean_cost(points["on"], lo, n_ctx), mean_cost(points["off"], lo, n_ctx)
    measured = max(points["on"][-1][0], points["off"][-1][0])
    reach = "" if n_ctx <= measured else f", extrapolated past the {measured} cells measured"
    margin = max(TIE, noise(points["on"]) + noise(points["off"]))
    dec_on, dec_off = points["on"][-1][2], points["off"][-1][2]
    last_on, last_off = dec_on + points["on"][-1][1], dec_off + points["off"][-1][1]
    if off < on * (1 - margin) and dec_off < dec_on * (1 - margin) and last_off < last_on * (1 - margin):
        return "off", (f"tuned: flash attention off ({off:.1f} vs {on:.1f} ms per token read and written over "
                       f"0-{n_ctx} cells{reach}, beyond the {margin:.0%} spread)")
    if on <= off * (1 - margin):
        return "on", (f"tuned: flash attention on ({on:.1f} vs {off:.1f} ms per token read and written over "
                      f"0-{n_ctx} cells{reach})")
    return "on", (f"tuned: flash attention on (a tie within the {margin:.0%} spread, {on:.1f} vs {off:.1f} ms per "
                  f"token on/off over 0-{n_ctx} cells{reach}; on is the path with page-local's decode kernel)")


def bands(points: dict, n_ctx_max: int) -> list[dict]:
    """The winner per length band up to n_ctx_max: [{"from", "to", "flash_attn", "on_ms", "off_ms"}]."""
    out, lo = [], 0
    for hi in BANDS:
        hi = min(hi, n_ctx_max)
        if hi <= lo:
            break
        on, off = mean_cost(points["on"], lo, hi), mean_cost(points["off"], lo, hi)
        out.append({"from": lo, "to": hi, "flash_attn": decide(points, hi, lo)[0],
                    "on_ms": round(on, 2), "off_ms": round(off, 2)})
        lo = hi
    return out


def backend_default(device: str) -> tuple[str, str]:
    if device.startswith("CPU") or device == "":
        return "on", ("default for the CPU: flash attention on (page-local's decode kernel; it reads and decodes "
                      "faster than the plain path on the CPUs measured; `page-local tune` measures yours)")
    return "on", f"default for {device}: flash attention on (llama.cpp's choice for GPUs)"


def resolve(flash_attn: str, cache_type: str, device: str, n_ctx: int, tuned: dict | None) -> Attention:
    """The pure rule of the module docstring. flash_attn: auto|on|off (already merged with the environment);
    tuned: the tuning's points or None. ValueError for a combination llama.cpp refuses."""
    check_flash_attn(flash_attn)
    check_cache_type(cache_type)
    quant_v = cache_type != "f16"
    if flash_attn != "auto":
        if quant_v and flash_attn == "off":
            raise ValueError(f"cache type {cache_type} quantizes the V cache, which llama.cpp supports only with "
                             "flash attention: use flash attention on (or auto), or cache type f16")
        return Attention(flash_attn, cache_type, "requested", f"flash attention {flash_attn} as requested")
    if quant_v:
        return Attention("on", cache_type, "cache type",
                         f"flash attention on: the {cache_type} V cache needs it in llama.cpp")
    if tuned is not None:
        pick, why = decide(tuned, n_ctx)
        return Attention(pick, cache_type, "tuned", why)
    pick, why = backend_default(device)
    return Attention(pick, cache_type, "default", why)


def from_environment(flash_attn: str | None = None, cache_type: str | None = None) -> AttentionSettings:
    """The one read of $PAGE_LOCAL_FLASH_ATTN and $PAGE_LOCAL_CACHE_TYPE: each value not given (None) is its
    variable when set, else auto / f16; given values win. ValueError names the variable of a bad value."""
    if flash_attn is None:
        flash_attn = check_flash_attn(os.environ.get(FLASH_ENV, "").strip().lower() or "auto", f"${FLASH_ENV}")
    if cache_type is None:
        cache_type = check_cache_type(os.environ.get(CACHE_ENV, "").strip().lower() or "f16", f"${CACHE_ENV}")
    return AttentionSettings(flash_attn, cache_type)


def engine_settings(settings: AttentionSettings | None, flash_attn: str | None, cache_type: str | None,
                    type_kv: str | None = None) -> AttentionSettings:
    """An Engine's attention arguments as one AttentionSettings: `settings` as given (a caller that resolved
    it at its own edge, as the CLI does), else flash_attn and cache_type (type_kv: cache_type's older name)
    with the environment for what is None. ValueError when both forms, or both names, are given."""
    if type_kv is not None:
        if cache_type is not None and cache_type != type_kv:
            raise ValueError(f"type_kv is the older name of cache_type: give one, not both (got cache_type="
                             f"{cache_type!r}, type_kv={type_kv!r})")
        cache_type = type_kv
    if settings is None:
        return from_environment(flash_attn, cache_type)
    if flash_attn is not None or cache_type is not None:
        raise ValueError("give attention_settings, or flash_attn / cache_type, not both")
    if not isinstance(settings, AttentionSettings):
        raise ValueError(f"attention_settings must be an AttentionSettings, got {settings!r}")
    return settings


# --- measuring (drives a context: the engine layer) -------------------------------------------

class HostMeter:
    """`with HostMeter() as m:` ... then m.others_cores: the CPU time other processes (and a hypervisor's
    steal) took while the block ran, in cores on average: the host's busy time less this process's (psutil).
    A 2-core machine running a test suite beside a tuning measures ~1; an idle desktop ~0.05."""

    others_cores: float = 0.0

    @staticmethod
    def _host() -> float:
        import psutil

        t = psutil.cpu_times()
        return sum(getattr(t, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq", "steal"))

    @staticmethod
    def _own() -> float:
        import psutil

        t = psutil.Process().cpu_times()
        return t.user + t.system

    def __enter__(self) -> "HostMeter":
        self._wall, self._host0, self._own0 = time.perf_counter(), self._host(), self._own()
        return self

    def __exit__(self, *exc) -> None:
        wall = max(1e-6, time.perf_counter() - self._wall)
        self.others_cores = max(0.0, (self._host() - self._host0) - (self._own() - self._own0)) / wall


def disturbed(others_cores: float, threads: int, cores: int | None = None) -> bool:
    """Whether other processes took the cores a tuning with `threads` threads needs: their average use beyond
    the machine's spare cores (cores - threads) by more than BUSY_CORES. On 2 cores with 2 threads a quarter
    of a core; on 16 cores with 4 threads, 12.25."""
    cores = cores or os.cpu_count() or 1
    return others_cores > BUSY_CORES + max(0, cores - threads)


def busy_note(others_cores: float, threads: int, when: str = "while it measured") -> str:
    cores = os.cpu_count() or 1
    return (f"other processes used {others_cores:.2f} of this machine's {cores} cores {when} "
            f"({threads} threads), so its timings would describe the load, not the paths")


def measure(model, threads: int, lengths=TUNE_LENGTHS, repeats: int = 5,
            progress: Callable[[str, float], None] | None = None, budget_s: float | None = None) -> dict:
    """Time both paths on `model`: one growing sequence of random tokens per path, and at each length of
    `lengths` (both paths in turn, so that a drifting machine affects both alike) the prefill of the chunk
    that reached it (ms per token) and then `repeats` one-token decodes at that length (each removed again;
    the first is a warm-up and dropped). budget_s: stop before a length whose predicted time (the last
    length's, scaled by the tokens it adds) would pass it; the lengths reached are returned (at least the
    first). Returns {"on": [(T, prefill_ms_per_token, decode_ms, decode_spread_ms), ...], "off": [...]}: the
    decode steps of both settings alternate round by round, decode_ms is their median and decode_spread_ms
    their interquartile range. progress(text, fraction)."""
    from contextlib import ExitStack

    from page_local.native.runtime import Context, ContextConfig

    lengths = sorted({int(n) for n in lengths})
    if not lengths or lengths[0] < 16:
        raise ValueError(f"tuning lengths must be at least 16 tokens, got {lengths}")
    limit = model.n_ctx_train if model.n_ctx_train > 0 else lengths[-1] + 64
    lengths = [n for n in lengths if n + repeats + 1 <= limit] or [min(lengths[0], limit - repeats - 1)]
    rng = np.random.default_rng(0)
    tokens = rng.integers(100, min(4000, max(200, model.n_vocab - 1)), size=lengths[-1] + repeats + 1).tolist()
    total = 2 * (lengths[-1] + len(lengths) * repeats * 8)  # rough work units for the progress fraction
    done, out = 0, {"on": [], "off": []}
    t_start, prev, pos = time.perf_counter(), 0, 0
    with ExitStack() as stack:
        ctxs = {s: stack.enter_context(Context(model, ContextConfig(n_ctx=lengths[-1] + repeats + 16, threads=threads,
                                                                     flash_attn=s, n_ubatch=512, n_batch=512)))
                for s in ("on", "off")}
        for n in lengths:
            if budget_s is not None and out["on"]:
                spent = time.perf_counter() - t_start
                if spent + last * (n - pos) / max(1, pos - prev) * 1.2 > budget_s:
                    break  # the next length would pass the time box: extrapolate from those measured
            t_len = time.perf_counter()
            pre = {}
            for setting, ctx in ctxs.items():
                t0 = time.perf_counter()
                ctx.decode(tokens[pos:n], pos, 0, logits="last")
                pre[setting] = (time.perf_counter() - t0) * 1000 / (n - pos)
                done += n - pos
            # decode steps in alternated rounds (on, off, off, on, ...): a slow phase of the host lands on
            # both settings alike; the first round is a warm-up and dropped
            steps = {s: [] for s in ctxs}
            for i in range(repeats + 1):
                for setting in (("on", "off") if i % 2 == 0 else ("off", "on")):
                    ctx = ctxs[setting]
                    t0 = time.perf_counter()
                    ctx.decode([tokens[n + i]], n, 0, logits="last")
                    steps[setting].append((time.perf_counter() - t0) * 1000)
                    ctx.seq_rm(0, n, -1)
                    done += 8
            for setting in ctxs:
                got = np.asarray(steps[setting][1:])
                q1, q2, q3 = np.percentile(got, [25, 50, 75])
                out[setting].append((n, pre[setting], float(q2), float(q3 - q1)))
                if progress is not None:
                    progress(f"flash attention {setting}: {n} cells, decode {q2:.1f} ms", min(1.0, done / total))
            last, prev, pos = time.perf_counter() - t_len, pos, n
    return out


def autotune_budget() -> float | None:
    """The first-use tuning's time box in seconds from $PAGE_LOCAL_AUTOTUNE (on: AUTOTUNE_S; off: None),
    ValueError for anything else."""
    raw = os.environ.get(AUTOTUNE_ENV, "on").strip().lower()
    if raw in ("on", "1", "true", "yes", ""):
        return AUTOTUNE_S
    if raw in ("off", "0", "false", "no"):
        return None
    try:
        box = float(raw)
    except ValueError:
        box = -1.0
    if not box > 0 or box == float("inf"):
        raise ValueError(f"${AUTOTUNE_ENV} must be on, off or a number of seconds above 0; got {raw!r}")
    return box


QUIET_CHECK_S = 0.3  # how long the first-use tuning watches the machine before it starts


def first_use(model, key, threads: int, budget_s: float,
              progress: Callable[[str, float], None] | None = None):
    """Measure and store the tuning of `key` now (the first use of this model, machine, device, thread count
    and library), within budget_s seconds. Returns (Tuning, None), or (None, why) when other processes took
    the cores it needs (`disturbed`): watched for QUIET_CHECK_S before it starts (then nothing is measured)
    and during the measurement (then nothing is stored); the next first use tries again."""
    from page_local.store.tuning import Tuning, now, save_tuning

    with HostMeter() as before:
        time.sleep(QUIET_CHECK_S)
    if disturbed(before.others_cores, threads):
        return None, busy_note(before.others_cores, threads, "before it began")
    t0 = time.perf_counter()
    with HostMeter() as during:
        points = measure(model, threads, TUNE_LENGTHS, repeats=5, progress=progress, budget_s=budget_s)
    if disturbed(during.others_cores, threads):
        return None, busy_note(during.others_cores, threads)
    tuning = Tuning(key, points, now(), time.perf_counter() - t0, round(during.others_cores, 3))
    save_tuning(tuning)
    return tuning, None


# --- the engine's entry point ----------------------------------------------------------------

def tuning_key(model_path, model, threads: int):
    """The store key of a tuning for this model file, machine, device, thread count and library."""
    from page_local.native.pageops import library_dir
    from page_local.store.gguf import model_identity
    from page_local.store.tuning import TuningKey, library_signature, machine_signature

    return TuningKey(model_identity(model_path), machine_signature(), str(model.layers_device), int(threads),
                     library_signature(library_dir()))


def choose(model_path, model, threads: int, n_ctx: int, settings: AttentionSettings, autotune: bool = True,
           progress: Callable[[str, float], None] | None = None) -> tuple[Attention, str | None]:
    """(Attention, warning or None) for a context on `model` asked for with `settings` (resolved by the
    caller: the environment is not read here): the rule of `resolve` with the stored tuning (an unusable
    tuning file is ignored, and the warning says so); with none stored and autotune (and $PAGE_LOCAL_AUTOTUNE
    not off), the first-use tuning is measured now (progress(text, fraction) while it runs). A first-use
    tuning that fails leaves the backend's default, with a warning."""
    from page_local.store.tuning import read_tuning

    fa, ct = settings.flash_attn, settings.cache_type
    box = autotune_budget() if autotune else None
    tuned, warning, first = None, None, False
    if fa == "auto" and ct == "f16":
        key = tuning_key(model_path, model, threads)
        status = read_tuning(key)
        tuned, warning = (status.tuning.points if status.tuning else None), status.warning
        if tuned is None and box is not None:
            try:
                tuning, busy = first_use(model, key, threads, box, progress)
                if tuning is not None:
                    tuned, first = tuning.points, True
                else:
                    warning = (f"the first-use attention tuning was not kept: {busy}; the default path is used and "
                               "the next start measures again (or run `page-local tune` when the machine is quiet)")
            except (OSError, RuntimeError, ValueError) as e:  # a context that cannot be made, an unwritable home
                warning = f"the first-use attention tuning failed ({' '.join(str(e).split())}); `page-local tune` retries"
    choice = resolve(fa, ct, str(model.layers_device), n_ctx, tuned)
    if first:
        choice = Attention(choice.flash_attn, choice.cache_type, choice.source,
                           choice.why.replace("tuned:", "tuned now (first use on this machine):", 1))
    return choice, warning
