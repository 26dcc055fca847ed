"""The model's own chat template: GGUF `tokenizer.chat_template`, rendered by llama-cpp-python's
Jinja2 chat formatter (no hand-written templates).

One place for what `chat`, `calibrate` (chat framing) and `eval run` share: finding the template,
turning a template that is missing, does not parse or fails on a conversation into one clear
ChatTemplateError (a ValueError: the CLI reports it as one line), and dropping the rendered BOS
text when llama.cpp adds BOS itself while tokenizing (SmolLM2's "BOS" is <|im_start|>, which its
vocabulary does not add, so there the text stays as rendered).
"""

from __future__ import annotations

from pathlib import Path
from page_local.errors import ChatTemplateError


class ChatTemplate:
    """render(messages) -> the prompt text, as llama.cpp should tokenize it (add_special=True).

    `fallback` says what the user can do instead (e.g. "use `page-local run`" or "pass --plain");
    it ends every error message.
    """

    def __init__(self, model, fallback: str):
        import jinja2

        from page_local.native.runtime import chat_formatter

        self.name = Path(model.path).name
        self.fallback = fallback
        template = model.metadata().get("tokenizer.chat_template")
        if not template:
            raise ChatTemplateError(f"{self.name} has no chat template in its GGUF metadata (a base model?); "
                                    f"{fallback}")
        lm = model.llama_model
        try:
            self._fmt = chat_formatter(template, eos_token=lm.token_get_text(lm.token_eos()),
                                       bos_token=lm.token_get_text(lm.token_bos()))
        except jinja2.TemplateError as e:  # TemplateSyntaxError and friends, from the GGUF's text
            line = f" (line {e.lineno})" if getattr(e, "lineno", None) else ""
            raise ChatTemplateError(f"the chat template in {self.name} does not parse{line}: {e.message or e}; "
                                    f"{fallback}") from None
        self._adds_bos = bool(lm.add_bos_token())

    def render(self, messages: list[dict], generation_prompt: bool = True) -> str:
        """messages: [{"role": ..., "content": ...}]; generation_prompt opens the assistant's turn."""
        self._fmt.add_generation_prompt = generation_prompt
        try:
            text = self._fmt(messages=messages).prompt
        except Exception as e:  # noqa: BLE001 -- third-party template code: raise_exception (ValueError),
            # undefined variables, type errors in filters. Whatever it is, the user's input is not at fault.
            roles = ", ".join(m["role"] for m in messages)
            raise ChatTemplateError(f"the chat template in {self.name} failed on a conversation of roles "
                                    f"[{roles}]: {type(e).__name__}: {e}; {self.fallback}") from None
        bos = self._fmt.bos_token
        if self._adds_bos and bos and text.startswith(bos):  # llama.cpp adds it when tokenizing
            text = text[len(bos):]
        return text
