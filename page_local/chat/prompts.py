"""Task samples as chat prompts: the framing every evaluation, calibration pilot and peer benchmark
shares (the model's own chat template, the answer prefix opening the assistant turn)."""

from __future__ import annotations

from dataclasses import dataclass

from page_local.chat.template import ChatTemplate
from page_local.tasks.synthetic import Sample


@dataclass
class Prompt:
    sample: Sample
    text: str  # the rendered chat prompt, answer prefix included
    tokens: list[int]
    split: int  # tokens[:split] are probed and compressed (== len(tokens) unless query-agnostic)
    reference: list[int]  # tokens of " " + the first reference answer

    @property
    def n(self) -> int:
        return len(self.tokens)


class ChatPrompter:
    """Renders samples with the model's chat template (chat_template.ChatTemplate, as chat.ChatSession
    does): the user turn, the opened assistant turn, then the answer prefix.
    plain=True (base models without a template): the user text, a blank line, the answer prefix.
    """

    def __init__(self, model, system: str | None = None, plain: bool = False):
        self.model = model
        self.system = system
        self.plain = plain
        self._template = None if plain else ChatTemplate(
            model, fallback="pass --plain (user text + answer prefix, no chat markup)")
        self.overhead = len(self.model.tokenize(self.render("", ""), add_special=True))

    def render(self, user: str, answer_prefix: str) -> str:
        if self.plain:
            head = f"{self.system}\n\n" if self.system else ""
            return f"{head}{user}\n\n{answer_prefix}" if user else f"{head}{answer_prefix}"
        msgs = ([{"role": "system", "content": self.system}] if self.system else []) + [
            {"role": "user", "content": user}]
        return self._template.render(msgs, generation_prompt=True) + answer_prefix

    def count_tokens(self, text: str) -> int:
        """Tokens of a text without chat markup (tasks.generate's length control)."""
        return len(self.model.tokenize(text, add_special=False))

    def prompt(self, sample: Sample, query_agnostic: bool = False) -> Prompt:
        user, prefix = sample.messages()
        text = self.render(user, prefix)
        if not sample.answers:
            raise ValueError(f"{sample.task}[{sample.index}] has no reference answers (unlabeled); "
                             "it cannot be evaluated")
        ref = self.model.tokenize(" " + sample.answers[0].strip(), add_special=False, parse_special=False)
        if not query_agnostic:
            toks = self.model.tokenize(text, add_special=True)
            return Prompt(sample, text, toks, len(toks), ref)
        ctx = sample.context.rstrip()
        at = text.find(ctx) if ctx else -1
        if at < 0:
            raise ValueError(f"{sample.task}[{sample.index}]: the chat template changed the context; "
                             "query-agnostic mode cannot find where it ends")
        head, tail = text[: at + len(ctx)], text[at + len(ctx):]
        toks = self.model.tokenize(head, add_special=True)
        split = len(toks)
        toks = toks + self.model.tokenize(tail, add_special=False)
        return Prompt(sample, text, toks, split, ref)
