"""How a request becomes what the model reads: the chat templates (chat/template.py's, and the Jinja
one with tools, chat_template.py), rendered and tokenized, and n_keep. What a client wrote stays text.
No HTTP, no slots: Backend.tokens calls it before a request waits for a slot.
"""

from __future__ import annotations

import itertools
import threading
from pathlib import Path

from page_local.serve.chat_template import ToolTemplate, tokenize_texts
from page_local.serve.errors import ApiError, bad

MARK = "\u2063page-local\u2063"  # stands for a message's content while a template is rendered


class Prompt:
    """The served model's templates and control-token texts, loaded once; thread-safe."""

    def __init__(self, model, served_name: str):
        from page_local.chat.template import ChatTemplate

        self.model, self.served_name, self.file = model, served_name, Path(model.path).name
        self.template = None
        self.template_error: str | None = None
        try:
            self.template = ChatTemplate(model, fallback="send plain text to /v1/completions instead")
        except ValueError as e:  # ChatTemplateError
            self.template_error = str(e)
        self.tool_template = ToolTemplate(model)  # tools, tool calls and results
        self.specials = control_texts(model)  # the text of the model's control tokens (<|im_end|>, ...)
        self._render_lock = threading.Lock()  # ChatTemplate.render sets a flag on its formatter

    def tokens(self, job) -> tuple[list[int], int]:
        """The request as the model reads it: the chat template rendered (with the assistant's turn
        opened) or the text, tokenized as a fresh conversation (BOS and all); and n_keep, how many
        leading tokens are the system prompt and the first turn's header, which making room never
        evicts (as ChatSession tells the engine). Thread-safe. A grammar or a logit bias the model
        cannot take, or tools it cannot call, are refused by the Backend before this.

        What a client wrote is text: a message holding the text of a control token (`<|im_end|>`) is
        tokenized apart from the template's own text, without parsing special tokens, so it cannot close
        its turn or open another."""
        model = self.model
        if job.kind != "chat":
            return model.tokenize(job.prompt, add_special=True), 0
        if self.template is None:
            raise bad(f"chat completions need the model's chat template: {self.template_error}", "messages",
                      "no_chat_template")
        mark = MARK
        system = list(itertools.takewhile(lambda m: m["role"] == "system", job.messages))
        contents = [m["content"] for m in job.messages]
        if any(sp in c for c in contents for sp in self.specials):
            marked = [{**m, "content": f"{mark}{i}{mark}"} for i, m in enumerate(job.messages)]
            toks = tokenize_texts(model, self._render(job, marked), contents, mark)
            if toks is None:
                i = next(i for i, c in enumerate(contents) if any(sp in c for sp in self.specials))
                raise bad(f"messages[{i}].content holds the text of one of the model's control tokens, and this "
                          "model's chat template rewrites messages, so page-local cannot keep it apart as text: "
                          "leave it out", f"messages[{i}].content")
        else:
            toks = model.tokenize(self._render(job, job.messages), add_special=True)
        head = self._render(job, system + [{"role": "user", "content": mark}], generation_prompt=False)
        head = head[: head.find(mark)] if mark in head else ""
        keep = model.tokenize(head, add_special=True) if head else []
        return toks, (len(keep) if toks[: len(keep)] == keep else 0)

    def check_tools(self, job) -> None:
        """400 naming the model when its chat template cannot show it tools or page-local cannot read its calls."""
        t = self.tool_template
        if t is not None and t.tool_format is not None:
            return
        why = t.why_not if t is not None else "its chat template could not be read"
        param = "tools" if job.offers_tools else "messages"
        raise ApiError(400, f"{param}: the served model {self.served_name} ({self.file}) cannot call tools: "
                            f"{why}. Serve a model whose chat template has tool calling (for example `page-local "
                            "models install qwen2.5-coder`, then `page-local serve --model qwen2.5-coder`), or "
                            "leave tools out (for an answer in JSON, response_format json_schema works on any "
                            "model)", "tools_not_supported", param)

    def render(self, job) -> str:
        """The chat request's conversation as the model reads it (the template, the assistant's turn opened),
        or a text request's prompt. Thread-safe."""
        if job.kind != "chat":
            return job.prompt
        return self._render(job, job.messages)

    def _render(self, job, messages: list[dict], generation_prompt: bool = True) -> str:
        t = self.tool_template
        shown = job.tools and t is not None and t.tool_format is not None
        if job.uses_tools or shown:  # Jinja with tools (chat_template.py); check_tools said the template has them
            try:
                return t.render(messages, job.tools if shown else None, generation_prompt)
            except Exception as e:  # noqa: BLE001 -- the template's own code refusing this conversation
                roles = ", ".join(m["role"] for m in messages)
                raise bad(f"the chat template in {self.file} failed on a conversation of roles "
                          f"[{roles}]: {type(e).__name__}: {e}", "messages") from None
        with self._render_lock:
            try:
                return self.template.render(messages, generation_prompt=generation_prompt)
            except ValueError as e:  # ChatTemplateError: the template refused this conversation
                raise bad(str(e), "messages") from None


def control_texts(model) -> list[str]:
    """The text of every control token of the model's vocabulary (<|im_start|>, <|im_end|>, ...): what a
    client's message must not turn into."""
    out = []
    for t in range(model.n_vocab):
        if model.is_control(t):
            text = model.token_to_piece(t, special=True).decode("utf-8", "replace")
            if text.strip():
                out.append(text)
    return out
