"""Two engines in two threads of one process give the same outputs as each alone (the probe's
per-context state and the thread-local graph-build hook must not leak between them)."""

from __future__ import annotations

import threading

from page_local.engine.engine import Engine

HAY = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
PROMPTS = [
    HAY * 6 + "One of the special magic numbers for red-fox is: 1234567.\nWhat is the special magic number for red-fox?",
    "Write a short poem about the sea and the wind, in four lines.",
]


def test_two_engines_in_two_threads(smollm2_path):
    engines = [Engine(smollm2_path, n_ctx=1024, budget=0.5, gate=g, threads=1) for g in ("always", "page")]
    try:
        alone = [e.generate(p, max_tokens=16) for e, p in zip(engines, PROMPTS)]
        results: dict[int, object] = {}
        errors: list[BaseException] = []

        def work(i):
            try:
                for _ in range(2):
                    results[i] = engines[i].generate(PROMPTS[i], max_tokens=16)
            except BaseException as e:  # surfaced below
                errors.append(e)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
        assert not errors, errors
        for i in range(2):
            assert results[i].tokens == alone[i].tokens
            assert results[i].decision.D == alone[i].decision.D
            assert results[i].decision.kept == alone[i].decision.kept
        assert alone[0].decision.evicted  # the first engine really probed and evicted concurrently
    finally:
        for e in engines:
            e.close()
