"""Multi-turn chat on an Engine: the model's own chat template (chat_template.ChatTemplate) and
incremental prefill.

Each turn renders the whole conversation, and only the text that is not in the KV cache yet is
tokenized and decoded; the PAGE gate runs after each user turn's prefill (Engine._prefill_and_gate),
so eviction never touches the sinks or the current turn's window.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from . import persist
from .chat_template import ChatTemplate
from .engine import ContextFull, Engine, Result, Sampling

SAVE_FORMAT = "page-local-chat"


class ChatFileError(ValueError):
    """A conversation file that cannot be loaded (missing, corrupt, wrong format)."""


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
        self.last_result: Result | None = None
        self.engine.reset()

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

    def send(self, text: str, max_tokens: int = 512, sampling: Sampling | None = None) -> Iterator[str]:
        """Stream the assistant's answer to `text`; the Result is in .last_result afterwards.

        If the turn does not fit (ContextFull) nothing is changed: the conversation stays as it was.
        If the generation is interrupted (KeyboardInterrupt), the partial answer is kept as the
        assistant's message, so the cache and the conversation agree.
        """
        if not text.strip():
            raise ValueError("the message is empty")
        rendered = self._render(self.messages + [Message("user", text)], generation_prompt=True)
        delta = self._delta(rendered)
        pieces: list[str] = []
        decoded_before = len(self.engine.history)
        try:
            for piece in self.engine.stream(delta, max_tokens=max_tokens, sampling=sampling):
                pieces.append(piece)
                yield piece
        finally:
            if len(self.engine.history) > decoded_before:  # the prompt reached the cache: record the turn
                answer = "".join(pieces)
                self.messages += [Message("user", text), Message("assistant", answer)]
                self._text = rendered + answer
                self.last_result = getattr(self.engine, "last_result", None)
                d = self.engine.last_decision
                self.evicted = self.evicted or bool(d is not None and d.evicted)

    def clear(self) -> None:
        self.messages = []
        self._text = ""
        self.evicted = False
        self.engine.reset()

    def set_system(self, system: str | None) -> None:
        """Change the system prompt; the conversation is re-prefilled with it."""
        self.system = system or None
        self.replay(self.messages)

    def replay(self, messages: list[Message]) -> None:
        """Reset and prefill `messages` (gate and eviction run as for a live turn)."""
        text = self._render(messages, generation_prompt=False) if messages else ""
        toks = self.engine.model.tokenize(text, add_special=True) if messages else []
        if len(toks) + 1 > self.engine.n_ctx:  # checked before anything is dropped
            raise ContextFull(0, len(toks) + 1, self.engine.n_ctx)
        self.engine.reset()
        self.messages, self._text, self.evicted = [], "", False
        if not messages:
            return
        self.engine.last_decision, _ = self.engine._prefill_and_gate(toks)
        self.messages, self._text = list(messages), text
        self.evicted = self.engine.last_decision.evicted

    # --- persistence -------------------------------------------------------------------------
    def save(self, path: str | os.PathLike, settings: dict | None = None) -> Path:
        """Write the conversation and settings, atomically (temp file + rename).

        A conversation whose cache was evicted is saved with its KV cache (page_local.persist), so
        that it continues with identical tokens after load; otherwise as readable JSON that load
        re-prefills."""
        if self.evicted:
            extra = {"format": SAVE_FORMAT, "system": self.system, "messages": [m.__dict__ for m in self.messages],
                     "settings": settings or {}, "text": self._text}
            return persist.save(self.engine, path, extra)
        path = Path(path).expanduser()
        data = {"format": SAVE_FORMAT, "version": 1, "system": self.system,
                "messages": [m.__dict__ for m in self.messages], "settings": settings or {}}
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(data, f, ensure_ascii=False, indent=1)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path

    @staticmethod
    def read(path: str | os.PathLike) -> dict:
        """Parse and validate a saved conversation (ChatFileError says what is wrong)."""
        path = Path(path).expanduser()
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError as e:
            raise ChatFileError(f"no such conversation file: {path}") from e
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ChatFileError(f"{path} is not a page-local conversation file ({e})") from e
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
        A file that cannot be loaded raises ChatFileError and leaves the session as it was."""
        if persist.is_state_file(path):
            try:
                header, _ = persist.read(path)
                if header.get("model_id") != self.engine.model_id:
                    raise persist.StateFileError(f"{path} was saved with another model ({header.get('model_id')})")
                extra = header.get("extra") or {}
                msgs = [Message(m["role"], m["content"]) for m in extra.get("messages", [])]
                text, system = str(extra.get("text", "")), extra.get("system")
                persist.load(self.engine, path)
            except (persist.StateFileError, KeyError, TypeError) as e:
                raise ChatFileError(str(e)) from None
            self.system, self.messages, self._text, self.evicted = system, msgs, text, True
            return extra.get("settings") or {}
        data = self.read(path)
        self.system = data.get("system")
        self.replay([Message(m["role"], m["content"]) for m in data["messages"]])
        return data.get("settings") or {}
