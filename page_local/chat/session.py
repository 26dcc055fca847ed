"""Multi-turn chat on an Engine: the model's own chat template (chat.template.ChatTemplate) and
incremental prefill.

Each turn renders the whole conversation, and only the text that is not in the KV cache yet is
tokenized and decoded (Engine.stream); the gate runs after each user turn's prefill, so eviction never
touches the sinks or the current turn's window. Replays (a new system prompt, a loaded JSON save) go
through Engine.prefill: under the verify gates they never evict (there is no answer to check).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from page_local.chat.template import ChatTemplate
from page_local.engine.decision import Decision
from page_local.engine.engine import Engine, Sampling, Stream
from page_local.errors import ChatFileError, ChatTemplateError, ContextFull, StateFileError
from page_local.store import persist
from page_local.store.home import atomic_write

SAVE_FORMAT = "page-local-chat"
# An answer's default length in `chat`. Measured on the embedded SmolLM2 (10 everyday questions, greedy,
# docs/design.md §5.1): the answers that end did so within 14-310 tokens; the other 4 of 10 looped or
# rambled on to any limit (768 tried). 384 keeps every ending seen, with a margin, and stops a loop
# sooner than 512 did.
MAX_TOKENS = 384


@dataclass
class Message:
    role: str
    content: str


class ChatSession:
    def __init__(self, engine: Engine, system: str | None = None):
        self.engine = engine
        self._template = ChatTemplate(engine.model, fallback="use `page-local run` for plain text")
        self.system = system
        self.messages: list[Message] = []
        self._text = ""  # the exact text that is in the KV cache, in order
        self.evicted = False  # some turn evicted: the cache no longer matches a re-prefill of the text
        self.engine.reset()
        self._protect_system()

    def _protect_system(self) -> None:
        """Tell the engine how many leading tokens are the system prompt (and the first turn's header),
        which making room never evicts."""
        mark = "\u2063page-local\u2063"
        try:
            rendered = self._render([Message("user", mark)], generation_prompt=False)
        except ChatTemplateError:  # the conversation's own render says what is wrong, with its roles
            self.engine.n_keep = 0
            return
        head = rendered[: rendered.find(mark)] if mark in rendered else ""
        self.engine.n_keep = len(self.engine.model.tokenize(head, add_special=True)) if head else 0

    def _render(self, messages: list[Message], generation_prompt: bool) -> str:
        msgs = ([{"role": "system", "content": self.system}] if self.system else []) + [
            {"role": m.role, "content": m.content} for m in messages]
        return self._template.render(msgs, generation_prompt)

    def _delta(self, rendered: str) -> str:
        if rendered.startswith(self._text):
            return rendered[len(self._text):]
        # The template re-rendered an earlier turn differently (e.g. it strips whitespace from the
        # assistant's answer). The cache keeps what it has; only the differing tail is appended.
        common = os.path.commonprefix([rendered, self._text])
        return rendered[len(common):]

    def send(self, text: str, max_tokens: int = MAX_TOKENS, sampling: Sampling | None = None) -> Stream:
        """Stream the assistant's answer to `text` (a Stream: iterate it; .decision and .result as
        Engine.stream's).

        If the turn does not fit (ContextFull) nothing is changed: the conversation stays as it was.
        If the generation is interrupted (KeyboardInterrupt, or the stream closed early), the partial
        answer is kept as the assistant's message, so the cache and the conversation agree.
        """
        if not text.strip():
            raise ValueError("the message is empty")
        rendered = self._render(self.messages + [Message("user", text)], generation_prompt=True)
        delta = self._delta(rendered)

        def run(out: Stream) -> Iterator[str]:
            pieces: list[str] = []
            decoded_before = len(self.engine.history)
            inner = self.engine.stream(delta, max_tokens=max_tokens, sampling=sampling)
            try:
                for piece in inner:
                    out.decision = inner.decision
                    pieces.append(piece)
                    yield piece
            finally:
                inner.close()
                out.decision, out.result = inner.decision, inner.result
                if len(self.engine.history) > decoded_before:  # the prompt reached the cache: record the turn
                    answer = "".join(pieces)
                    self.messages += [Message("user", text), Message("assistant", answer)]
                    self._text = rendered + answer
                    d = inner.decision
                    self.evicted = self.evicted or bool(d is not None and (d.evicted or d.room_evicted))

        return Stream(run)

    def clear(self) -> None:
        self.messages = []
        self._text = ""
        self.evicted = False
        self.engine.reset()

    def set_system(self, system: str | None) -> Decision | None:
        """Change the system prompt; the conversation is re-prefilled with it (its Decision returned)."""
        self.system = system or None
        self._protect_system()
        return self.replay(self.messages)

    def replay(self, messages: list[Message]) -> Decision | None:
        """Reset and prefill `messages` (Engine.prefill: the gate runs, but the verify gates never evict
        for speed; a conversation larger than the context makes room as a live turn would). Returns the
        prefill's Decision (None for an empty conversation)."""
        text = self._render(messages, generation_prompt=False) if messages else ""
        toks = self.engine.model.tokenize(text, add_special=True) if messages else []
        if self.engine.on_full == "refuse" and len(toks) + 1 > self.engine.n_ctx:  # before anything is dropped
            raise ContextFull(0, len(toks) + 1, self.engine.n_ctx)
        self.engine.reset()
        self.messages, self._text, self.evicted = [], "", False
        if not messages:
            return None
        decision = self.engine.prefill(toks)
        self.messages, self._text = list(messages), text
        self.evicted = decision.evicted or decision.room_evicted > 0
        return decision

    # --- persistence -------------------------------------------------------------------------
    def save(self, path: str | os.PathLike, settings: dict | None = None) -> Path:
        """Write the conversation and settings, atomically (temp file + rename).

        A conversation whose cache was evicted is saved with its KV cache (page_local.persist), so
        that it continues with identical tokens after load; otherwise as readable JSON that load
        re-prefills."""
        if self.evicted:
            extra = {"format": SAVE_FORMAT, "system": self.system, "messages": [m.__dict__ for m in self.messages],
                     "settings": settings or {}, "text": self._text}
            return persist.save(self.engine.snapshot(), path, extra)
        path = Path(path).expanduser()
        data = {"format": SAVE_FORMAT, "version": 1, "system": self.system,
                "messages": [m.__dict__ for m in self.messages], "settings": settings or {}}
        if self.engine.payback.after:  # with parking: how far past the check this chat's answers went
            data["answers_after"] = list(self.engine.payback.after)
        with atomic_write(path) as f:
            json.dump(data, f, ensure_ascii=False, indent=1)
        return path

    @staticmethod
    def read(path: str | os.PathLike) -> dict:
        """Parse and validate a saved conversation, JSON or a cache file (ChatFileError says what is
        wrong). A cache file's dict has "cache": True; its messages are those saved with the cache."""
        path = Path(path).expanduser()
        if persist.is_state_file(path):
            try:
                _, extra = persist.read(path)
            except StateFileError as e:
                raise ChatFileError(str(e)) from None
            data = {"format": extra.get("format"), "system": extra.get("system"),
                    "messages": extra.get("messages"), "settings": extra.get("settings") or {}, "cache": True}
            return ChatSession._check(path, data)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError as e:
            raise ChatFileError(f"no such conversation file: {path}") from e
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ChatFileError(f"{path} is not a page-local conversation file ({e})") from e
        return ChatSession._check(path, data)

    @staticmethod
    def _check(path: Path, data: object) -> dict:
        if not isinstance(data, dict) or data.get("format") != SAVE_FORMAT:
            raise ChatFileError(f"{path} is not a page-local conversation file (format field missing)")
        msgs = data.get("messages")
        if not isinstance(msgs, list) or not all(
                isinstance(m, dict) and m.get("role") in ("user", "assistant", "system")
                and isinstance(m.get("content"), str) for m in msgs):
            raise ChatFileError(f"{path}: 'messages' must be a list of {{role, content}} objects")
        if data.get("system") is not None and not isinstance(data["system"], str):
            raise ChatFileError(f"{path}: 'system' must be a string")
        return data

    def load(self, path: str | os.PathLike) -> dict:
        """Load a saved conversation (restoring its cache, or re-prefilling JSON). Returns its settings.
        A file that cannot be loaded raises ChatFileError, a replay that fails or is interrupted its own
        error; either leaves the session as it was, cache included."""
        if persist.is_state_file(path):
            try:
                snap, extra = persist.read(path)
                if snap.model_id != self.engine.model_id:
                    raise StateFileError(f"{path} was saved with another model ({snap.model_id})")
                msgs = [Message(m["role"], m["content"]) for m in extra.get("messages", [])]
                text, system = str(extra.get("text", "")), extra.get("system")
                self.engine.restore(snap)
            except (StateFileError, KeyError, TypeError) as e:
                raise ChatFileError(f"{path}: {e}" if str(path) not in str(e) else str(e)) from None
            self.system, self.messages, self._text, self.evicted = system, msgs, text, True
            self._protect_system()
            return extra.get("settings") or {}
        data = self.read(path)
        before = (self.system, self.messages, self._text, self.evicted, self.engine.snapshot())
        try:
            self.system = data.get("system")
            self._protect_system()
            self.replay([Message(m["role"], m["content"]) for m in data["messages"]])
            after = data.get("answers_after")
            if isinstance(after, list) and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                               for n in after):
                self.engine.payback.after = after[-self.engine.payback.RECENT:]
        except BaseException:  # refused, failed or interrupted: the conversation as it was, cache included
            self.system, self.messages, self._text, self.evicted, snap = before
            self._protect_system()
            if tuple(self.engine.history) != snap.history or self.engine.cells_used() != len(snap.positions):
                try:
                    self.engine.restore(snap)
                except StateFileError as e:  # e.g. a cache filled to the last cell: keep nothing half put back
                    self.clear()
                    raise ChatFileError(f"the conversation before the load could not be put back ({e})") from None
            raise
        return data.get("settings") or {}
