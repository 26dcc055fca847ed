"""The served model's own chat template (GGUF `tokenizer.chat_template`) rendered with Jinja2 for what
the server needs beyond chat/template.py: tools, assistant messages with tool calls, tool results, and
a conversation tokenized so that what a client wrote stays text.

As llama-server's `--jinja`: the template is rendered as Transformers renders it (a sandboxed
environment, trim_blocks and lstrip_blocks, `tojson` without key sorting or HTML escaping,
`raise_exception`, `strftime_now`), with `tools` given as OpenAI's `[{"type": "function", "function":
{...}}]` and a tool call's `arguments` as an object (templates write them with `tojson`).

Whether the template has tool calling is measured, not guessed from its name: a conversation is
rendered with a probe tool, and the tool's name must appear in the text (what llama.cpp's minja checks
too). Which call format the model writes back is read from the template's own instructions: page-local
reads Hermes' `<tool_call>{"name": ..., "arguments": ...}</tool_call>` (Qwen2.5, Hermes, and others).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

PROBE_TOOL = "page_local_probe_tool"
HERMES = ("<tool_call>", "</tool_call>")


def _tojson(x, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str):
    raise ValueError(message)


class ToolTemplate:
    """render(messages, tools) -> the prompt text, as llama.cpp should tokenize it (add_special=True).

    tools: None, or OpenAI's tool list. `tool_format` is "hermes" when the template both renders tools
    and asks for Hermes-style calls, else None; `why_not` says why it is None.
    """

    def __init__(self, model):
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        self.name = Path(model.path).name
        self.source = model.metadata().get("tokenizer.chat_template") or ""
        lm = model.llama_model
        self.bos = lm.token_get_text(lm.token_bos()) if lm.token_bos() >= 0 else ""
        self.eos = lm.token_get_text(lm.token_eos()) if lm.token_eos() >= 0 else ""
        self._adds_bos = bool(lm.add_bos_token())
        self.tool_format: str | None = None
        self.why_not = "it has no chat template in its GGUF metadata"
        self._template = None
        if not self.source:
            return
        env = ImmutableSandboxedEnvironment(loader=jinja2.BaseLoader(), trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        try:
            self._template = env.from_string(self.source)
        except jinja2.TemplateError as e:
            self.why_not = f"its chat template does not parse ({e})"
            return
        self.tool_format, self.why_not = self._probe()

    def _probe(self) -> tuple[str | None, str]:
        tool = {"type": "function", "function": {"name": PROBE_TOOL, "description": "probe",
                                                 "parameters": {"type": "object", "properties": {}}}}
        try:
            text = self.render([{"role": "user", "content": "hi"}], tools=[tool])
        except Exception as e:  # noqa: BLE001 -- the template's own code failing on tools
            return None, f"its chat template fails when given tools ({type(e).__name__}: {e})"
        if PROBE_TOOL not in text:
            return None, "its chat template has no tool calling (it does not show the model any tools)"
        if not all(tag in self.source for tag in HERMES):
            return None, ("its chat template shows tools, but asks for tool calls in a format page-local does not "
                          "read (it reads <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>)")
        return "hermes", ""

    def render(self, messages: list[dict], tools: list[dict] | None = None, generation_prompt: bool = True) -> str:
        """Raises whatever the template raises (ValueError from raise_exception, jinja2 errors)."""
        if self._template is None:
            raise ValueError(f"{self.name}: {self.why_not}")
        kw = {"tools": tools} if tools else {}
        text = self._template.render(messages=messages, add_generation_prompt=generation_prompt,
                                     bos_token=self.bos, eos_token=self.eos, raise_exception=_raise,
                                     strftime_now=lambda f: datetime.now().strftime(f), **kw)
        if self._adds_bos and self.bos and text.startswith(self.bos):  # llama.cpp adds it when tokenizing
            text = text[len(self.bos):]
        return text


def tokenize_texts(model, text: str, contents: list[str], mark: str) -> list[int] | None:
    """`text` (a rendered conversation in which each of `contents` stood as mark + its index + mark) as
    tokens: the template's own text with its control tokens parsed, the contents as plain text, so that a
    client's `<|im_end|>` is the characters, not the end of its turn. None when a marker is missing (the
    template rewrote a content): the caller decides."""
    pieces: list[tuple[str, bool]] = []  # (text, is the client's)
    rest = text
    for i in range(len(contents)):
        tag = f"{mark}{i}{mark}"
        at = rest.find(tag)
        if at < 0:
            return None
        pieces.append((rest[:at], False))
        pieces.append((contents[i], True))
        rest = rest[at + len(tag):]
    pieces.append((rest, False))
    out: list[int] = []
    first = True
    for piece, client in pieces:
        if piece:
            out += model.tokenize(piece, add_special=first, parse_special=not client)
            first = False
    return out
