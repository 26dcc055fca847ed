"""`Sample`: one evaluation prompt (context, question, answer prefix, references) and the row format it is
written as; made by the generators (tasks/synthetic.py) and the readers (tasks/readers.py), scored by
tasks/scoring.py."""

from __future__ import annotations

from dataclasses import dataclass, field

METRICS = ("all", "part")


@dataclass(frozen=True)
class Sample:
    """One evaluation prompt. `answers` are the references scored by `metric` (scoring.py).

    length: tokens of text() as counted by the generator's count_tokens (None when unknown).
    meta: task details, e.g. {"depths": [...]} (needle line index / (lines - 1)), "size".
    """

    task: str
    index: int
    context: str
    question: str
    answer_prefix: str
    answers: list[str]
    max_new_tokens: int
    metric: str = "all"
    length: int | None = None
    seed: int | None = None
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        for name in ("task", "context", "question", "answer_prefix"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a string, got {getattr(self, name)!r:.80}")
        if not isinstance(self.answers, list) or not all(isinstance(a, str) for a in self.answers):
            raise ValueError(f"answers must be a list of strings, got {self.answers!r:.80}")
        if self.metric not in METRICS:
            raise ValueError(f"metric must be one of {METRICS}, got {self.metric!r}")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) \
                or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {self.max_new_tokens!r}")
        for name in ("index", "length", "seed"):
            v = getattr(self, name)
            if (v is not None or name == "index") and (isinstance(v, bool) or not isinstance(v, int)):
                raise ValueError(f"{name} must be an int{'' if name == 'index' else ' or None'}, "
                                 f"got {v!r}")
        if not isinstance(self.meta, dict):
            raise ValueError(f"meta must be a dict, got {self.meta!r:.80}")

    def user_content(self) -> str:
        """Query-aware user turn: context, a blank line, the question (question at the end)."""
        q = self.question.strip()
        return self.context.rstrip() + "\n\n" + q if q else self.context.rstrip()

    def messages(self) -> tuple[str, str]:
        """(user_content, answer_prefix) for a chat template.

        The prefix opens the assistant turn (otherwise small models restate the question); it is
        stripped of RULER's surrounding spaces there, so the model emits the leading space itself.
        """
        return self.user_content(), self.answer_prefix.strip()

    def text(self) -> str:
        """The base-model prompt: user_content() + answer_prefix. Lengths are counted on this."""
        return self.user_content() + self.answer_prefix

    def query_agnostic(self) -> tuple[str, str]:
        """(context_only, question_and_prefix); they concatenate to text().

        For query-agnostic compression: prefill and compress the context, then append the rest.
        """
        ctx = self.context.rstrip()
        return ctx, self.text()[len(ctx):]

    def to_row(self) -> dict:
        """A kvpress-style row (context, question, answer_prefix, answer, task, max_new_tokens)
        plus this sample's other fields; readers.read_kvpress reads it back."""
        return {"context": self.context, "question": self.question,
                "answer_prefix": self.answer_prefix, "answer": list(self.answers),
                "task": self.task, "max_new_tokens": self.max_new_tokens, "index": self.index,
                "metric": self.metric, "length": self.length, "seed": self.seed,
                "meta": dict(self.meta)}
