"""A chat whose cache was evicted survives save/load with identical tokens; bad files are refused
and leave the session untouched."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from page_local.chat.session import ChatFileError, ChatSession
from page_local.engine.engine import Engine

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_model as tm  # noqa: E402

THREADS = 1
# ~320 tokens (was ~720): an evicted chat's save and load do not depend on the length
DOC = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n" * 6
       + "The secret code of the blue door is 58213.\n"
       + "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n" * 6)


def evicted_chat(path):
    eng = Engine(path, n_ctx=1024, budget=0.5, gate="always", threads=THREADS)
    chat = ChatSession(eng)
    turn = chat.send(DOC + "\nWhat is the secret code of the blue door?", max_tokens=12)
    "".join(turn)
    assert chat.evicted and turn.decision.evicted
    return eng, chat, turn.decision


def test_evicted_chat_continues_identically_after_load(smollm2_path, tmp_path):
    eng, chat, first = evicted_chat(smollm2_path)
    with eng:
        f = chat.save(tmp_path / "conv.pglc", {"budget": 0.5})
        positions = eng.ctx.page.positions(0)
        assert len(positions) < first.T  # the gaps are what must survive
        turn = chat.send("Repeat the code.", max_tokens=12)
        "".join(turn)
        want = turn.result.tokens
    with Engine(smollm2_path, n_ctx=1024, budget=0.5, gate="always", threads=THREADS) as eng2:
        chat2 = ChatSession(eng2)
        settings = chat2.load(f)
        assert settings == {"budget": 0.5}
        assert chat2.messages == chat.messages[:2]
        assert eng2.ctx.page.positions(0).tolist() == positions.tolist()
        turn = chat2.send("Repeat the code.", max_tokens=12)
        "".join(turn)
        assert turn.result.tokens == want


def test_bad_cache_files_are_refused_and_nothing_changes(smollm2_path, tmp_path):
    eng, chat, _ = evicted_chat(smollm2_path)
    with eng:
        good = chat.save(tmp_path / "conv.pglc").read_bytes()
        before = (list(chat.messages), eng.ctx.page.positions(0).tolist())
        cases = {"truncated": good[: len(good) // 2], "flipped": good[:100] + bytes([good[100] ^ 1]) + good[101:],
                 "empty-ish": good[:10]}
        for name, blob in cases.items():
            p = tmp_path / f"{name}.pglc"
            p.write_bytes(blob)
            with pytest.raises(ChatFileError, match="truncated|corrupt"):
                chat.load(p)
            assert (list(chat.messages), eng.ctx.page.positions(0).tolist()) == before, name
        # a file from another model
        w = tm.write_tiny_llama(tmp_path / "tiny.gguf")
        with Engine(w.path, n_ctx=512, gate="always", budget=0.5, threads=THREADS) as tiny:
            from page_local.store import persist  # tiny has no chat template: save its cache directly

            tiny.generate([5, 6, 7, 8] * 20, max_tokens=2)
            persist.save(tiny.snapshot(), tmp_path / "tiny.pglc")
        with pytest.raises(ChatFileError, match="another model"):
            chat.load(tmp_path / "tiny.pglc")
        assert (list(chat.messages), eng.ctx.page.positions(0).tolist()) == before
