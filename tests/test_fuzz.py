"""Fuzzing the native layer through the runtime with hypothesis: random sequences of prefill, probe,
evict, decode, sequence copies and state save/restore on a tiny f32 model (fast), checked against a
simple model of which positions each sequence should hold.

`make test` runs a fast subset; `make fuzz` runs >= 1000 examples (PAGE_LOCAL_FUZZ_EXAMPLES).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_model as tm  # noqa: E402

from page_local.native.pageops import InvalidPositions, ProbeError  # noqa: E402
from page_local.native.runtime import Context, ContextConfig, Model  # noqa: E402

EXAMPLES = int(os.environ.get("PAGE_LOCAL_FUZZ_EXAMPLES", "8"))
N_CTX = 512
SEQS = (0, 1)  # fuzzed sequences; seq 2 is the untouched witness


@pytest.fixture(scope="module")
def tiny_ctx(tmp_path_factory):
    w = tm.write_tiny_llama(tmp_path_factory.mktemp("fuzz") / "tiny.gguf", n_layer=2)
    with Model(w.path) as model, Context(model, ContextConfig(
            n_ctx=N_CTX, n_batch=128, n_ubatch=64, n_seq_max=3, threads=1, flash_attn="off")) as ctx:
        yield ctx, w.n_vocab


def _tok(n, seed, vocab):
    return np.random.default_rng(seed).integers(tm.N_SPECIAL, vocab, size=n).tolist()


def make_machine(ctx, vocab):
    class Cache(RuleBasedStateMachine):
        @initialize()
        def setup(self):
            ctx.clear()
            self.model = {s: [] for s in SEQS}  # positions each sequence should hold, ascending
            ctx.decode(_tok(40, 99, vocab), 0, 2)  # the witness
            self.witness = self._next_logits(2)
            self.saved = None

        def _next_logits(self, s):
            p = ctx.seq_pos_max(s) + 1
            ctx.decode([7], p, s)
            out = ctx.logits()
            ctx.seq_rm(s, p, -1)
            return out

        def _room(self, n):
            return len(ctx.page.positions(0)) + len(ctx.page.positions(1)) + 40 + n + 8 <= N_CTX

        @rule(s=st.sampled_from(SEQS), n=st.integers(1, 80), seed=st.integers(0, 10**6), probe=st.booleans())
        def decode(self, s, n, seed, probe):
            if not self._room(n):
                return
            pos0 = (self.model[s][-1] + 1) if self.model[s] else 0
            if probe:
                ctx.page.arm_probe(s, 8)
            ctx.decode(_tok(n, seed, vocab), pos0, s)
            self.model[s] += list(range(pos0, pos0 + n))
            if probe and n <= 64:  # one ubatch
                r = ctx.page.read_probe()
                assert r.queries.tolist() == list(range(pos0, pos0 + n))
                assert set(r.positions.tolist()) == set(self.model[s])
                assert np.all(np.isfinite(r.mean)) and np.all(r.topk_pos < pos0 + n)
            elif probe:  # split into several ubatches: no result, the context stays usable
                with pytest.raises(ProbeError, match="several ubatches"):
                    ctx.page.read_probe()

        @precondition(lambda self: any(self.model[s] for s in SEQS))
        @rule(s=st.sampled_from(SEQS), data=st.data())
        def evict(self, s, data):
            held = self.model[s]
            if not held:
                return
            drop = data.draw(st.lists(st.sampled_from(held), unique=True, max_size=len(held)))
            ctx.page.evict(s, drop)
            self.model[s] = sorted(set(held) - set(drop))

        @rule(s=st.sampled_from(SEQS), p=st.integers(0, 600))
        def evict_bad(self, s, p):
            if p in self.model[s]:
                return
            with pytest.raises(InvalidPositions):
                ctx.page.evict(s, [p])

        @rule(src=st.sampled_from(SEQS))
        def copy(self, src):
            dst = 1 - src
            ctx.seq_rm(dst, -1, -1)
            ctx.seq_cp(src, dst)
            self.model[dst] = list(self.model[src])

        @rule(s=st.sampled_from(SEQS))
        def remove_all(self, s):
            ctx.seq_rm(s, -1, -1)
            self.model[s] = []

        @precondition(lambda self: bool(self.model[0]))
        @rule()
        def save_state(self):
            self.saved = (ctx.seq_state(0), list(self.model[0]))

        @precondition(lambda self: self.saved is not None)
        @rule()
        def restore_state(self):
            state, pos = self.saved
            ctx.seq_rm(0, -1, -1)
            if not self._room(len(pos)):
                self.model[0] = []
                return
            ctx.set_seq_state(state, 0)
            self.model[0] = list(pos)

        @precondition(lambda self: bool(self.model[0]))
        @rule()
        def compact(self):
            ctx.page.compact(0)

        @invariant()
        def positions_match(self):
            if not hasattr(self, "model"):
                return
            for s in SEQS:
                assert ctx.page.positions(s).tolist() == self.model[s]

        def teardown(self):
            if hasattr(self, "witness"):
                # untouched: the same logits (not bit for bit: the witness's new token may land in
                # another cell, which changes the summation order over the cache)
                after = self._next_logits(2)
                assert np.max(np.abs(after - self.witness)) <= 1e-4
                assert np.argmax(after) == np.argmax(self.witness)

    return Cache


def test_fuzz_cache_operations(tiny_ctx):
    ctx, vocab = tiny_ctx
    Cache = make_machine(ctx, vocab)
    Cache.TestCase.settings = settings(max_examples=EXAMPLES, stateful_step_count=12, deadline=None,
                                       suppress_health_check=list(HealthCheck))
    Cache.TestCase("runTest").runTest()
