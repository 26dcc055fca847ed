"""A fake engine for the shells: the REPL and `run` tested without a model (as simonw/llm's MockModel).

    eng = FakeEngine()
    eng.enqueue([" Paris", "."], decision(T=40, gate_mode="page"))   # the next turn's answer and Decision
    eng.enqueue(ContextFull(1900, 300, 2048))                         # the turn after: refused at once
    repl = Repl(eng, console, session=FakeChat(eng))

FakeEngine has the surface the shells use (settings, stream/generate/measure, cells_used, n_ctx,
placement, profile_warning, model.path); settings are validated by the same functions the Engine
uses. Streams behave as engine.Stream: .decision is set before the first piece, .result when the
iteration ends, also when it is interrupted or closed (finish_reason "interrupted"). One piece is
one token. FakeChat is ChatSession's surface over a FakeEngine (the real one needs a model's chat
template); files are read and validated by the real ChatSession.read, and an evicted conversation
is saved as a cache file (page_local.store.persist, with an empty llama.cpp state) as ChatSession saves it.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Iterator

from page_local import defaults
from page_local.chat.session import SAVE_FORMAT, ChatSession, Message
from page_local.engine import Decision, Result, Sampling
from page_local.engine.attention import Attention
from page_local.engine.room import check_on_full
from page_local.engine.selfcheck import Payback
from page_local.errors import ChatFileError
from page_local.evictors import get_evictor
from page_local.evictors.base import resolve_budget
from page_local.gate import check_gate_mode
from page_local.store import persist
from page_local.store.home import atomic_write
from page_local.verify import VERIFY_CAP, VERIFY_RULE, check_rule

TOK_S = 50.0  # every fake answer streams at this speed, so status lines are predictable


def decision(**fields) -> Decision:
    """A Decision with every required field filled: by default a closed raw gate on 100 positions."""
    T = fields.pop("T", 100)
    base = dict(T=T, B=T // 4, D=0.05, z=None, open=False, evicted=False, kept=T, compression=1.0,
                gate_mode="page", rule="raw", reason="(fake)", evictor="snapkv")
    base.update(fields)
    if "compression" not in fields:
        base["compression"] = base["T"] / base["kept"] if base["kept"] else 1.0
    return Decision(**base)


@dataclass
class _Turn:
    pieces: list[str] | None  # None: `error` is raised when the stream is first iterated
    decision: Decision | None
    finish: str | None
    error: BaseException | None = None


class FakeStream:
    """engine.Stream's surface over a queued turn."""

    def __init__(self, engine: FakeEngine, turn: _Turn, max_tokens: int):
        self.decision: Decision | None = None
        self.result: Result | None = None
        self.on_end: Callable[[FakeStream, str], None] | None = None  # FakeChat records the turn here
        self._gen = self._run(engine, turn, max_tokens)

    def __iter__(self) -> FakeStream:
        return self

    def __next__(self) -> str:
        return next(self._gen)

    def close(self) -> None:
        self._gen.close()

    def _run(self, engine: FakeEngine, turn: _Turn, max_tokens: int) -> Iterator[str]:
        if turn.error is not None:  # the engine refuses before anything reaches the cache
            raise turn.error
        d = turn.decision
        self.decision = d
        engine.cells = d.kept  # the whole conversation, as the decision left it (T before eviction)
        out: list[str] = []
        finish = turn.finish or ("stop" if len(turn.pieces) <= max_tokens else "length")
        try:
            for piece in turn.pieces[:max_tokens]:
                engine.cells += 1
                out.append(piece)
                yield piece
        except (GeneratorExit, KeyboardInterrupt):
            finish = "interrupted"
            raise
        finally:
            self.result = Result("".join(out), list(range(len(out))), d, finish, d.T, gen_s=len(out) / TOK_S)
            if self.on_end is not None:
                self.on_end(self, "".join(out))


class FakeEngine:
    """The Engine's surface for shells; answers come from the queue (enqueue), in order."""

    def __init__(self, model=None, n_ctx: int = 2048, budget=0.25, evictor: str = "snapkv", gate: str = "verify",
                 verify_tokens: int = VERIFY_CAP, on_full: str = defaults.ON_FULL, profile_warning: str | None = None,
                 **_ignored):
        self.model = SimpleNamespace(path=Path(model or "fake-model.gguf"))
        self.n_ctx = n_ctx
        self.placement = {"layers": "CPU", "kv_cache": "CPU", "n_gpu_layers": 0, "gpu_layers": 0}
        self.profile_warning = profile_warning
        self.attention = Attention("on", "f16", "default", "default for the CPU: flash attention on")
        self.attention_warning = None
        self.set_budget(budget)
        self.set_evictor(evictor)
        self.set_gate(gate)
        self.set_verify(verify_tokens)
        self.on_full = check_on_full(on_full)
        self.model_id = "fake-model"
        self.cells = 0  # cells in use: each turn's prompt (as its decision kept it) and answer pieces
        self.queue: deque[_Turn] = deque()
        self.prompts: list[str] = []  # every prompt a stream was given, in order
        self.closed = False
        self.payback = Payback()  # with parking: how far past the check answers went (none here)

    # --- what a test scripts ---------------------------------------------------------------
    def enqueue(self, pieces: list[str] | BaseException, decision: Decision | None = None,
                finish: str | None = None) -> None:
        """The next turn: its answer pieces and Decision (default: a closed gate over the prompt), or an
        exception the turn raises at once (ContextFull, DecodeError, ...). finish: default "stop", or
        "length" when max_tokens cuts the pieces."""
        if isinstance(pieces, BaseException):
            self.queue.append(_Turn(None, None, None, error=pieces))
        else:
            self.queue.append(_Turn(list(pieces), decision, finish))

    # --- the Engine's surface ----------------------------------------------------------------
    def set_budget(self, budget) -> None:
        resolve_budget(budget, 10_000)
        self.budget = budget

    def set_evictor(self, name: str, **options) -> None:
        self.evictor = get_evictor(name, **options).name

    def set_gate(self, mode: str) -> None:
        self.gate_mode = check_gate_mode(mode)

    def set_verify(self, tokens: int = VERIFY_CAP, threshold: float | None = None, rule: str = VERIFY_RULE) -> None:
        if isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= 256:
            raise ValueError(f"verify_tokens must be an int in [1, 256], got {tokens!r}")
        rule, threshold = check_rule(rule, threshold)
        self.verify_tokens, self.verify_threshold, self.verify_rule = tokens, threshold, rule

    def cells_used(self) -> int:
        return self.cells

    def reset(self) -> None:
        self.cells = 0

    def _take(self, prompt: str) -> _Turn:
        if not self.queue:
            raise AssertionError(f"FakeEngine: no answer queued for {prompt!r}")
        turn = self.queue.popleft()
        self.prompts.append(prompt)
        if turn.decision is None and turn.error is None:
            T = self.cells + max(1, len(prompt.split()))
            turn.decision = decision(T=T, kept=T, gate_mode=self.gate_mode)
        return turn

    def stream(self, prompt: str, max_tokens: int = 256, sampling: Sampling | None = None) -> FakeStream:
        (sampling or Sampling()).validate()
        return FakeStream(self, self._take(prompt), max_tokens)

    def generate(self, prompt: str, max_tokens: int = 256, sampling: Sampling | None = None) -> Result:
        self.reset()
        s = self.stream(prompt, max_tokens, sampling)
        for _ in s:
            pass
        return s.result

    def measure(self, prompt: str) -> Decision:
        self.reset()
        return self._take(prompt).decision

    def close(self) -> None:
        self.closed = True

    def __enter__(self) -> FakeEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class FakeChat:
    """ChatSession's surface over a FakeEngine: a turn is recorded once its prompt reached the cache
    (the fake's stream started), with the answer it had when it ended, as ChatSession.send does."""

    read = staticmethod(ChatSession.read)

    def __init__(self, engine: FakeEngine, system: str | None = None):
        self.engine, self.system = engine, system
        self.messages: list[Message] = []
        self.evicted = False
        self.replays: list[list[Message]] = []  # every re-prefill, in order

    def send(self, text: str, max_tokens: int = 512, sampling: Sampling | None = None) -> FakeStream:
        if not text.strip():
            raise ValueError("the message is empty")
        stream = self.engine.stream(text, max_tokens=max_tokens, sampling=sampling)

        def record(s: FakeStream, answer: str) -> None:
            self.messages += [Message("user", text), Message("assistant", answer)]
            self.evicted = self.evicted or s.decision.evicted

        stream.on_end = record
        return stream

    def clear(self) -> None:
        self.messages, self.evicted = [], False
        self.engine.reset()

    def set_system(self, system: str | None) -> None:
        self.system = system or None
        self.replay(self.messages)

    def replay(self, messages: list[Message]) -> None:
        self.engine.reset()
        self.messages, self.evicted = list(messages), False
        self.engine.cells = sum(len(m.content.split()) for m in messages)
        self.replays.append(list(messages))

    def save(self, path, settings: dict | None = None) -> Path:
        data = {"format": SAVE_FORMAT, "system": self.system, "messages": [m.__dict__ for m in self.messages],
                "settings": settings or {}}
        if self.evicted:  # the cells the fake holds stand for the cache
            snap = persist.Snapshot(self.engine.model_id, self.engine.n_ctx, (), tuple(range(self.engine.cells)), b"")
            return persist.save(snap, path, data)
        path = Path(path).expanduser()
        with atomic_write(path) as f:  # as ChatSession writes it, so the REPL meets the same OS errors
            json.dump({**data, "version": 1}, f)
        return path

    def load(self, path) -> dict:
        data = self.read(path)
        messages = [Message(m["role"], m["content"]) for m in data["messages"]]
        if data.get("cache"):  # restored as saved: no re-prefill
            snap, _ = persist.read(path)
            if snap.model_id != self.engine.model_id:  # as ChatSession.load: nothing changed yet
                raise ChatFileError(f"{path} was saved with another model ({snap.model_id})")
            self.system, self.messages, self.evicted = data.get("system"), messages, True
            self.engine.cells = len(snap.positions)
        else:
            self.system = data.get("system")
            self.replay(messages)
        return data.get("settings") or {}
