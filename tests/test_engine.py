"""The engine on the real patched library and the embedded SmolLM2: gate closed => the same tokens as
stock llama-cpp-python, the signal is deterministic, eviction holds exactly the budget, every evictor
runs end to end, bad input gives clear exceptions, turns append to the conversation."""

from __future__ import annotations

import math
import re
import threading

import numpy as np
import pytest

from page_local.native import pageops as native
from page_local.engine.engine import ContextFull, Engine, EngineBusy
from page_local.engine.turn import AFTER_ANSWER, W
from page_local.evictors import EVICTORS
from page_local.gate import GATE_MODES
from page_local.store.gguf import model_identity
from page_local.store.profiles import profile_path
from page_local.native.pageops import UnsupportedModel
from page_local.native.runtime import ModelError

# One thread: on this 2-core machine, 2 llama.cpp threads next to any other busy process spin on
# their barrier (docs/design.md §8: tests may use 1 thread); this file took 350 s instead of 74 s.
THREADS = 1
N_SINK = 4

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "

# Real text, 5..~150 tokens: the ones over W = 32 tokens exercise the engine's split
# (prompt[:-32], then prompt[-32:] with the probe armed) against stock's single batch.
PROMPTS = {
    "france": "The capital of France is",
    "story": "Once upon a time, in a small village by the sea,",
    "code": "def fibonacci(n):",
    "qa": "Q: What is the boiling point of water at sea level?\nA:",
    "colors": "List three primary colors:",
    "relativity": "The theory of general relativity, published by Albert Einstein in 1915, describes gravity not "
                  "as a force but as a curvature of spacetime caused by mass and energy. One of its predictions is",
    "photosynthesis": "Photosynthesis is the process by which green plants and some other organisms use sunlight to "
                      "synthesize foods from carbon dioxide and water. The process generally involves the green "
                      "pigment chlorophyll and",
    "chat": "<|im_start|>user\nWrite a haiku about autumn leaves falling in a quiet forest near a river."
            "<|im_end|>\n<|im_start|>assistant\n",
    "primes": "In mathematics, a prime number is a natural number greater than 1 that is not a product of two "
              "smaller natural numbers. For example, the first five primes are",
    "history": "The Industrial Revolution began in Great Britain in the late eighteenth century and spread to "
               "other parts of Europe and North America. Factories replaced workshops, steam engines powered "
               "mills and railways, and millions of people moved from the countryside into fast-growing "
               "cities. Working conditions were often harsh: long hours, child labour and dangerous machines "
               "were common, and reformers campaigned for decades to improve them. Historians still debate "
               "why it started in Britain first; the most common explanations are",
}


def needle_prompt(n_rep: int, key: str = "sapphire", value: str = "7481920", at: float = 0.4) -> str:
    """RULER-style noise haystack with one needle and the question at the end."""
    hay = [NOISE] * n_rep
    hay.insert(int(n_rep * at), f"One of the special magic numbers for {key} is: {value}. ")
    return "".join(hay) + (f"\nWhat is the special magic number for {key} mentioned in the provided text? "
                           f"The special magic number for {key} mentioned in the provided text is")


def stream_capturing_keep(eng: Engine, prompt, max_tokens: int):
    """Run one turn with stream(); return (Result, positions held when the first piece arrived).

    A piece is yielded before its token is decoded (the token goes in the cache when the stream goes on or
    is closed), so at the first piece the cache holds exactly what the turn's eviction kept."""
    keep = None
    stream = eng.stream(prompt, max_tokens=max_tokens)
    for _piece in stream:
        if keep is None:
            held = eng.ctx.page.positions(0)
            keep = held.copy()
    return stream.result, keep


def assert_turn_cache(eng: Engine, res, keep: np.ndarray, T: int) -> None:
    """After generation the cache holds the keep set plus one position per generated token."""
    assert res.finish_reason in ("length", "stop")  # every generated token was decoded
    expected = np.union1d(keep, np.arange(T, T + len(res.tokens)))
    np.testing.assert_array_equal(eng.ctx.page.positions(0), expected)


# --- gate closed => identical to stock llama-cpp-python ------------------------------------------

@pytest.fixture(scope="module")
def stock(smollm2_path, closed_engine):
    native.llama_cpp()  # llama_cpp must bind page-local's patched library, never another one
    import llama_cpp

    # The engine runs flash_attn "auto", page-local's choice (engine/attention.py: on unless tuned otherwise);
    # stock runs the path it chose (flash attention on and off round differently, so greedy tokens can differ
    # between the paths). Both use an f16 KV cache and n_batch = n_ubatch = 512.
    assert closed_engine.attention.cache_type == "f16"
    # on the same device as the engine (a GPU build offloads every layer: scripts/check-gpu.sh)
    llm = llama_cpp.Llama(model_path=str(smollm2_path), n_gpu_layers=closed_engine.placement["gpu_layers"],
                          n_ctx=256, n_batch=512, n_ubatch=512, n_threads=THREADS,
                          n_threads_batch=THREADS, flash_attn=closed_engine.attention.flash_attn == "on", type_k=1,
                          type_v=1, seed=0, verbose=False)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def closed_engine(smollm2_path):
    with Engine(smollm2_path, n_ctx=256, gate="never", threads=THREADS) as eng:
        yield eng


def stock_greedy(llm, tokens: list[int], max_tokens: int) -> list[int]:
    import llama_cpp

    llm.reset()  # n_tokens = 0: no prefix reuse from the previous prompt
    out = []
    for tok in llm.generate(tokens, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
        if llama_cpp.llama_vocab_is_eog(llm._model.vocab, tok) or len(out) == max_tokens:
            break
        out.append(tok)
    return out


@pytest.mark.parametrize("name", list(PROMPTS), ids=list(PROMPTS))
def test_gate_closed_matches_stock_llama_cpp(closed_engine, stock, name):
    prompt = PROMPTS[name]
    toks = closed_engine.model.tokenize(prompt, add_special=True, parse_special=True)
    assert toks == stock.tokenize(prompt.encode(), add_bos=True, special=True)
    res = closed_engine.generate(prompt, max_tokens=16)
    assert not res.decision.open and not res.decision.evicted
    assert res.decision.kept == len(toks)
    assert res.tokens == stock_greedy(stock, toks, 16), f"{len(toks)}-token prompt"


def test_prompts_cover_both_sides_of_the_window(closed_engine):
    lengths = [len(closed_engine.model.tokenize(p)) for p in PROMPTS.values()]
    assert min(lengths) < W and sum(n > W for n in lengths) >= 4 and max(lengths) > 2 * W


# --- the signal ----------------------------------------------------------------------------------

def test_signal_is_finite_and_deterministic(smollm2_path):
    prompt = NOISE * 6 + PROMPTS["relativity"]
    with Engine(smollm2_path, n_ctx=256, gate="page", threads=THREADS) as eng:
        a = eng.generate(prompt, max_tokens=1).decision
        b = eng.generate(prompt, max_tokens=1).decision
    assert a.T > 3 * W  # the top-k sets (k = 32) are real choices, not the whole sequence
    assert a.D is not None and math.isfinite(a.D)
    assert a.D == b.D and a.agreement == b.agreement and len(a.agreement) == 30
    assert all(0.0 <= x <= 1.0 for x in a.agreement)
    assert a.rule in ("raw", "calibrated") and a.open == b.open


# --- eviction end to end ---------------------------------------------------------------------------

def test_needle_turn_keeps_exactly_the_budget(smollm2_path):
    # ~310 tokens: what is tested is the budget's arithmetic, not a length (a quarter of it is well above
    # the floor of sinks + window + 4, so B is the ratio's)
    prompt = needle_prompt(11)
    with Engine(smollm2_path, n_ctx=512, budget=0.25, gate="always", threads=THREADS) as eng:
        T = len(eng.model.tokenize(prompt))
        assert 260 <= T <= 400 and int(T * 0.25) > W + N_SINK + 4
        res, keep = stream_capturing_keep(eng, prompt, max_tokens=12)
        d = res.decision
        assert (d.T, d.B) == (T, max(W + N_SINK + 4, int(T * 0.25)))
        assert d.open and d.evicted and d.rule == "forced"
        assert d.kept == d.B == keep.size
        assert d.compression == pytest.approx(T / d.B)
        assert d.D is not None and math.isfinite(d.D)
        assert np.all(keep < T)
        # sinks and the window (the re-decoded last prompt position included) are always kept
        assert np.isin(np.r_[0:N_SINK, T - W:T], keep).all()
        assert_turn_cache(eng, res, keep, T)
        assert res.text.strip() and res.tokens

        eng.set_gate("never")
        eng.reset()
        full, keep_full = stream_capturing_keep(eng, prompt, max_tokens=12)
        assert not full.decision.open and not full.decision.evicted
        assert full.decision.kept == T
        np.testing.assert_array_equal(keep_full, np.arange(T))
        assert_turn_cache(eng, full, keep_full, T)


@pytest.fixture(scope="module")
def evicting_engine(smollm2_path):
    with Engine(smollm2_path, n_ctx=448, budget=0.25, gate="always", threads=THREADS) as eng:
        yield eng


# lorekv-answer evicts only under a verify gate, at the check (tests/test_lorekv.py)
EVICT_NOW = [n for n in sorted(EVICTORS) if not EVICTORS[n].needs & AFTER_ANSWER]


@pytest.mark.parametrize("name", EVICT_NOW, ids=EVICT_NOW)
def test_every_evictor_runs_through_the_engine(evicting_engine, name):
    eng = evicting_engine
    prompt = needle_prompt(8, key="amber", value="3321907")  # ~240 tokens: a quarter is above the floor
    T = len(eng.model.tokenize(prompt))
    assert 200 <= T <= 280 and int(T * 0.25) > W + N_SINK + 4
    eng.set_evictor(name)  # every registered evictor's needs are provided (turn.PROVIDED)
    eng.reset()
    res, keep = stream_capturing_keep(eng, prompt, max_tokens=4)
    d = res.decision
    assert d.evictor == name and d.evicted and d.kept == d.B == keep.size == int(T * 0.25)
    assert np.isin(np.r_[0:N_SINK, T - W:T], keep).all() and np.all(keep < T)
    assert_turn_cache(eng, res, keep, T)
    assert res.tokens


# --- bad input: clear exceptions, no crash -----------------------------------------------------------

def test_missing_model_file(tmp_path):
    with pytest.raises(ModelError, match="not found"):
        Engine(tmp_path / "nope.gguf")


def test_a_registered_model_name_loads_that_model(smollm2_path):
    """Engine("smollm2") resolves the name as the CLI does (store.models.resolve), not as a file named smollm2."""
    with Engine("smollm2", n_ctx=256, threads=1, autotune=False) as eng:
        assert eng.model_id == model_identity(smollm2_path)
        assert eng.generate("Hello", max_tokens=2).tokens


def test_non_gguf_file(tmp_path):
    p = tmp_path / "model.gguf"
    p.write_bytes(b"PK\x03\x04 this is a zip file, not a model" * 100)
    with pytest.raises(ModelError, match="not a GGUF"):
        Engine(p)


def test_truncated_gguf(tmp_path, smollm2_path):
    p = tmp_path / "truncated.gguf"
    with open(smollm2_path, "rb") as src, open(p, "wb") as dst:
        dst.write(src.read(1 << 20))
    with pytest.raises(ModelError, match="truncated, corrupt"):
        Engine(p)


@pytest.mark.parametrize("budget, message", [
    (0, "count must be >= 1"), (0.0, "ratio must be in"), (-0.5, "ratio must be in"), (1.5, "ratio must be in"),
    (float("nan"), "ratio must be in"), (35, "smaller than the 36 protected"), (10, "smaller than the 36"),
    (-3, "count must be >= 1"), ("0.25", "ratio in \\(0, 1\\] or a count"), (True, "ratio in"),
], ids=["zero", "zero-ratio", "negative-ratio", "ratio-above-1", "nan", "35", "10", "negative-count", "str", "bool"])
def test_bad_budget(smollm2_path, budget, message):
    with pytest.raises(ValueError, match=message):
        Engine(smollm2_path, budget=budget)


def test_bad_budget_on_a_live_engine(closed_engine):
    with pytest.raises(ValueError, match="ratio must be in"):
        closed_engine.set_budget(1.5)
    assert closed_engine.budget == 0.25


def test_unknown_evictor_and_gate(smollm2_path, closed_engine):
    with pytest.raises(ValueError, match="unknown evictor 'snapky'; valid names: .*snapkv"):
        Engine(smollm2_path, evictor="snapky")
    modes = re.escape(", ".join(GATE_MODES))  # every mode is named, search and page+search included
    with pytest.raises(ValueError, match=rf"gate mode must be one of {modes}; got 'sometimes'"):
        Engine(smollm2_path, gate="sometimes")
    with pytest.raises(ValueError, match="unknown evictor"):
        closed_engine.set_evictor("nope")
    with pytest.raises(ValueError, match="gate mode"):
        closed_engine.set_gate("nope")
    assert (closed_engine.evictor, closed_engine.gate.mode) == ("snapkv", "never")


@pytest.mark.parametrize("prompt", ["", "   \n ", []], ids=["empty", "blank", "no-tokens"])
def test_empty_prompt(closed_engine, prompt):
    with pytest.raises(ValueError, match="the prompt is empty"):
        closed_engine.generate(prompt, max_tokens=2)
    assert closed_engine.cells_used() == 0


def test_prompt_longer_than_n_ctx(closed_engine):
    toks = closed_engine.model.tokenize(NOISE * 20)
    assert len(toks) > closed_engine.n_ctx
    closed_engine.on_full = "refuse"  # the default, "evict", reads it in parts (tests/test_conversation.py)
    try:
        with pytest.raises(ContextFull, match="the context is full") as e:
            closed_engine.generate(toks, max_tokens=2)
    finally:
        closed_engine.on_full = "evict"
    assert (e.value.used, e.value.needed, e.value.n_ctx) == (0, len(toks) + 1, closed_engine.n_ctx)
    assert closed_engine.cells_used() == 0 and closed_engine.history == []
    assert closed_engine.generate("The capital of France is", max_tokens=2).tokens  # still usable


def test_corrupt_calibration_profile_falls_back_to_raw_rule(smollm2_path, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGE_LOCAL_HOME", str(tmp_path / "home"))
    path = profile_path(model_identity(smollm2_path))
    path.parent.mkdir(parents=True)
    path.write_text("{ this is not json", encoding="utf-8")
    with Engine(smollm2_path, n_ctx=256, gate="page", threads=THREADS) as eng:
        assert eng.profile_warning and str(path) in eng.profile_warning
        assert "raw threshold" in eng.profile_warning
        res = eng.generate(PROMPTS["primes"], max_tokens=2)
    assert res.decision.rule == "raw" and res.decision.z is None and res.tokens


def write_tiny_bert(path, n_embd: int = 16, n_head: int = 2, n_ff: int = 32, n_vocab: int = 300,
                    n_ctx_train: int = 128) -> None:
    """A one-layer random BERT GGUF: an encoder-only model, for which llama.cpp creates no KV cache."""
    import gguf

    from tiny_model import BOS_ID, EOS_ID, UNK_ID, _tokenizer  # tests/ is on sys.path (rootdir conftest)

    rng = np.random.default_rng(0)

    def rand(*shape):
        return np.ascontiguousarray(rng.standard_normal(shape).astype(np.float32) * 0.1)

    ones, zeros = np.ones(n_embd, np.float32), np.zeros(n_embd, np.float32)
    w = gguf.GGUFWriter(str(path), "bert")
    w.add_name("tiny-bert")
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_vocab_size(n_vocab)
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_block_count(1)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_layer_norm_eps(1e-12)
    w.add_causal_attention(False)
    w.add_pooling_type(gguf.PoolingType.MEAN)
    w.add_token_type_count(2)
    tokens, scores, types = _tokenizer(n_vocab)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_unk_token_id(UNK_ID)
    w.add_tensor("token_embd.weight", rand(n_vocab, n_embd))
    w.add_tensor("token_types.weight", rand(2, n_embd))
    w.add_tensor("position_embd.weight", rand(n_ctx_train, n_embd))
    w.add_tensor("token_embd_norm.weight", ones)
    w.add_tensor("token_embd_norm.bias", zeros)
    for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
        w.add_tensor(f"blk.0.{name}.weight", rand(n_embd, n_embd))
    w.add_tensor("blk.0.attn_output_norm.weight", ones)
    w.add_tensor("blk.0.attn_output_norm.bias", zeros)
    w.add_tensor("blk.0.ffn_up.weight", rand(n_ff, n_embd))
    w.add_tensor("blk.0.ffn_down.weight", rand(n_embd, n_ff))
    w.add_tensor("blk.0.layer_output_norm.weight", ones)
    w.add_tensor("blk.0.layer_output_norm.bias", zeros)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_model_without_kv_cache(tmp_path):
    p = tmp_path / "tiny-bert.gguf"
    write_tiny_bert(p)
    with pytest.raises(UnsupportedModel, match="no KV cache"):
        Engine(p, n_ctx=128, threads=THREADS)


def test_two_threads_on_one_engine(closed_engine):
    eng = closed_engine
    prompt = PROMPTS["story"]
    reference = eng.generate(prompt, max_tokens=8).tokens
    eng.reset()
    started, release = threading.Event(), threading.Event()
    failures: list[BaseException] = []
    running = eng.stream(prompt, max_tokens=8)

    def worker():
        try:
            for i, _ in enumerate(running):
                if i == 0:
                    started.set()
                    release.wait(60)
        except BaseException as e:  # reported by the main thread
            failures.append(e)
            started.set()

    t = threading.Thread(target=worker)
    t.start()
    try:
        assert started.wait(60)
        with pytest.raises(EngineBusy, match="one Engine per thread"):
            eng.generate("Another question:", max_tokens=2)
        with pytest.raises(EngineBusy):
            list(eng.stream("Another question:", max_tokens=2))
    finally:
        release.set()
        t.join(60)
    assert not failures
    # the refused calls changed nothing: the running turn finished as if it had been alone
    assert running.result.tokens == reference
    assert eng.cells_used() == len(eng.model.tokenize(prompt)) + len(reference)


# --- several turns ---------------------------------------------------------------------------------

def test_turns_append_and_overflow_leaves_the_cache_unchanged(smollm2_path):
    with Engine(smollm2_path, n_ctx=256, gate="never", threads=THREADS, on_full="refuse") as eng:
        s1 = eng.stream("The capital of France is", max_tokens=4)
        list(s1)
        r1 = s1.result
        n1 = r1.prompt_tokens + len(r1.tokens)
        np.testing.assert_array_equal(eng.ctx.page.positions(0), np.arange(n1))

        second = " What is the capital of Italy?"
        s2 = eng.stream(second, max_tokens=4)
        list(s2)
        r2 = s2.result
        assert r2.prompt_tokens == len(eng.model.tokenize(second, add_special=False))  # no second BOS
        n2 = n1 + r2.prompt_tokens + len(r2.tokens)
        np.testing.assert_array_equal(eng.ctx.page.positions(0), np.arange(n2))
        assert len(eng.history) == n2
        assert eng.history[n1:n1 + r2.prompt_tokens] == eng.model.tokenize(second, add_special=False)

        before, history = eng.ctx.page.positions(0).copy(), list(eng.history)
        fits_alone = eng.model.tokenize(NOISE * 20, add_special=False)[: eng.n_ctx - n2]
        assert len(fits_alone) + 1 < eng.n_ctx
        with pytest.raises(ContextFull) as e:
            list(eng.stream(fits_alone, max_tokens=4))
        assert (e.value.used, e.value.n_ctx) == (n2, eng.n_ctx)
        np.testing.assert_array_equal(eng.ctx.page.positions(0), before)
        assert eng.history == history

        list(eng.stream(" And Spain?", max_tokens=2))  # the conversation goes on
        assert eng.ctx.page.positions(0)[: n2].tolist() == list(range(n2))
        assert eng.cells_used() > n2


def test_second_turn_evicts_over_the_whole_conversation(smollm2_path):
    with Engine(smollm2_path, n_ctx=512, budget=0.5, gate="always", threads=THREADS) as eng:
        res1, keep1 = stream_capturing_keep(eng, NOISE * 8, max_tokens=2)
        end1 = eng.ctx.seq_pos_max(0) + 1
        res2, keep2 = stream_capturing_keep(eng, " " + NOISE * 6, max_tokens=2)
        d = res2.decision
        # T is the whole conversation, so the budget is half of it: turn 2 evicts only what brings the
        # cells back to that share (before, it halved what turn 1 had kept)
        assert d.T == res1.prompt_tokens + len(res1.tokens) + res2.prompt_tokens
        assert keep1.size + len(res1.tokens) + res2.prompt_tokens > d.B  # there was something to evict
        assert d.evicted and d.kept == d.B == keep2.size == max(W + N_SINK + 4, int(d.T * 0.5))
        last = end1 + res2.prompt_tokens
        assert np.isin(np.r_[0:N_SINK, last - W:last], keep2).all() and keep2.max() == last - 1
        assert_turn_cache(eng, res2, keep2, last)


def test_a_turn_runs_with_its_own_settings_and_the_engines_stay(evicting_engine):
    """turn_settings(...) with overrides is a value the turn runs with: the engine's own settings are never
    changed (nothing saved and put back), a refused override names its field, and the turn decides as an
    engine with those settings would."""
    eng = evicting_engine
    eng.set_evictor("snapkv")
    before = (eng.gate_mode, eng.budget, eng.evictor, eng.verify_tokens, eng.on_full)
    prompt = needle_prompt(8, key="amber", value="3321907")
    t = eng.turn_settings(gate="never", budget=0.5, evictor="tova", verify_tokens=8, on_full="refuse")
    assert (t.gate_mode, t.budget, t.evictor.name, t.verify_tokens, t.on_full) == ("never", 0.5, "tova", 8, "refuse")
    assert (eng.gate_mode, eng.budget, eng.evictor, eng.verify_tokens, eng.on_full) == before
    seen = []
    eng.reset()  # a fresh conversation: T is this prompt alone
    stream = eng.stream(prompt, max_tokens=2, settings=t)
    for _ in stream:
        seen.append((eng.gate_mode, eng.budget, eng.evictor))  # during the turn, too
    d = stream.result.decision
    assert d.gate_mode == "never" and not d.evicted and d.kept == d.T
    assert set(seen) <= {before[:3]}
    eng.reset()
    assert eng.generate(prompt, max_tokens=2).decision.evicted  # the engine's own: always, a quarter
    for kw, field in ((dict(gate="sometimes"), "gate"), (dict(evictor="nope"), "evictor"), (dict(budget=0.0), "budget"),
                      (dict(verify_tokens=0), "verify_tokens"), (dict(on_full="drop"), "on_full"),
                      (dict(evictor="lorekv-answer"), "evictor")):
        with pytest.raises(ValueError) as e:
            eng.turn_settings(**kw)
        assert e.value.field == field, kw
    assert (eng.gate_mode, eng.budget, eng.evictor, eng.verify_tokens, eng.on_full) == before
