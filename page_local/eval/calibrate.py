"""Per-model calibration of the PAGE gate from an unlabeled pilot (PAGE's normalized_predictor):
z = (D - mu) / sigma with mu, sigma over the pilot's drops; the gate opens iff z >= -0.6934.

The pilot is either built in (a mix of generated long-context prompts: needles, multi-key, variable
tracking, word frequency and plain prose at several lengths; no labels are used) or the user's own
prompts, one per line of a text file or a JSONL file with a "prompt" / "input" / "text" field.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from page_local import gate as gate_mod
from page_local.store.gguf import describe_model
from page_local.store.profiles import save_profile
from page_local.tasks.synthetic import pilot_prompts

DEFAULT_LENGTHS = (1024, 2048, 3072)  # target tokens of the built-in pilot (`calibrate --lengths`)
MIN_LENGTH = min(DEFAULT_LENGTHS)  # shorter targets leave the pilot's tasks (vt's chains) no room
HEADROOM = 128  # tokens of n_ctx a pilot prompt of a given target length needs beyond it


@dataclass
class Calibration:
    model_id: str
    n: int
    mu: float
    sigma: float
    drops: list[float]
    profile_path: Path
    pilot_tokens: tuple[int, int] | None = None  # shortest and longest measured prompt

    @property
    def raw_threshold(self) -> float:
        """The D at which the calibrated gate flips: mu + z_threshold * sigma."""
        return gate_mod.d_threshold(self.mu, self.sigma)


def read_pilot(path: str | Path) -> list[str]:
    """Prompts from a text file (one per line) or JSONL ("prompt", "input" or "text" field)."""
    p = Path(path).expanduser()
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise ValueError(f"pilot file not found: {p}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read pilot file {p}: {e}") from None
    prompts = []
    jsonl = p.suffix in (".jsonl", ".json")
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if jsonl:
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{p}:{i}: not valid JSON ({e.msg})") from None
            text = next((row[k] for k in ("prompt", "input", "text") if isinstance(row, dict) and isinstance(row.get(k), str)), None)
            if text is None:
                raise ValueError(f"{p}:{i}: a JSONL pilot row needs a string field 'prompt', 'input' or 'text'")
            prompts.append(text)
        else:
            prompts.append(line)
    if len(prompts) < 2:
        raise ValueError(f"{p} holds {len(prompts)} prompt(s); a pilot needs at least 2 (100 recommended)")
    return prompts


def chat_renderer(model) -> Callable[[str, str], str] | None:
    """render(user, answer_prefix) -> the prompt as the model's chat template frames it (as `chat`
    and `eval run` send it), or None when the GGUF has no chat template (a base model)."""
    if not model.metadata().get("tokenizer.chat_template"):
        return None
    from page_local.chat.prompts import ChatPrompter

    return ChatPrompter(model).render


def builtin_pilot(engine, n: int, lengths=DEFAULT_LENGTHS, seed: int = 0,
                  render: Callable[[str, str], str] | None = None) -> list[str]:
    """n generated prompts sized with the model's own tokenizer; render(user, answer_prefix) frames
    each one (chat_renderer), or the plain text (context, question, answer prefix) when None."""
    asked = list(lengths)
    lengths = [L for L in asked if L + HEADROOM <= engine.n_ctx]
    if not lengths:
        raise ValueError(f"n_ctx = {engine.n_ctx} is too small for the built-in pilot (its prompts take "
                         f"{min(asked)} tokens or more): use n_ctx >= {min(asked) + HEADROOM} "
                         "or a pilot file of your own")
    count = lambda text: len(engine.model.tokenize(text, add_special=False))  # noqa: E731
    samples = pilot_prompts(n, lengths, count, seed)
    return [render(*s.messages()) if render else s.text() for s in samples]


def calibrate(engine, prompts: list[str], progress: Callable[[int, int], None] | None = None) -> Calibration:
    """Measure D on every prompt, store the profile for the engine's model, return the numbers."""
    from page_local.engine.engine import ContextFull

    drops, lengths = [], []
    for i, prompt in enumerate(prompts):
        try:
            d = engine.measure(prompt)
        except ContextFull:  # a pilot prompt longer than n_ctx says nothing about the gate: skip it
            d = None
        if d is not None and d.D is not None and math.isfinite(d.D):
            drops.append(float(d.D))
            lengths.append(int(d.T))
        if progress:
            progress(i + 1, len(prompts))
    mu, sigma = gate_mod.calibrate(drops)
    span = (min(lengths), max(lengths)) if lengths else None
    path = save_profile(engine.model_id, mu, sigma, len(drops), describe_model(engine.model.path),
                        pilot_tokens=span)
    return Calibration(engine.model_id, len(drops), mu, sigma, drops, path, span)
