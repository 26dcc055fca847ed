"""Self-verified eviction's decision: one pure function of per-token log-probs.

The answer is decoded with the FULL cache until it ends (end-of-generation) or VERIFY_CAP tokens,
then teacher-forced on the evicted candidate in one batch. For each checked position i:

    loss_i    = log p_full(y_i) - log p_evicted(y_i)     (nats; y_i = the full cache's token)
    changed_i = argmax p_full != argmax p_evicted        (the candidate would have said something else)

When the answer ended inside the span, its end is one more position (y = the end-of-generation
token): the candidate must also end the answer there.

`verify_score` turns these into a pass/fail under one rule. Every rule except the legacy "mean" is
monotone in the span: appending positions never lowers the score, so a longer check can only refuse
more (a mean per token dilutes: a hard digit among many easy tokens passes). The engine, the
evaluation runner and `bench verify` all decide through this function (engine/turn.py
Pipeline.verify_span).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# The most answer tokens checked before the decision (the engine's and eval's default; --verify-tokens
# / --verify-m override it). Chosen by measurement (docs/results.md, "A check that covers the answer"):
# it covers every answer of the RULER-style tasks that ends (SmolLM2 and Qwen: at most 50 tokens; UUIDs
# 29-38), and 128 decided the same on those runs while its check costs twice as much (~11 % of a 2K
# prefill on SmolLM2 against ~6 %) and decodes 64 more tokens at full-cache speed before the decision.
VERIFY_CAP = 64

# rule -> (what the score is, default threshold). Pass iff score <= threshold.
RULES = {
    "max": ("the largest per-token log-prob loss (nats)", 0.5),
    "argmax": ("positions where the candidate's top token differs from the full cache's", 0),
    "sum": ("the summed positive per-token log-prob loss (nats)", 1.0),
    "mean": ("the mean per-token log-prob loss (nats/token; legacy, not monotone in the span)", 0.05),
}
MONOTONE_RULES = ("max", "argmax", "sum")
# The default, by measurement (docs/results.md, "A check that covers the answer"): no checked position may
# change the top token, i.e. the candidate would have written the same answer. On SmolLM2 (80 inputs x 4
# budgets) it changed 6 candidate answers in 320 pairs against 21 for "max" <= 0.5 nats and 43 for the old
# mean over 16 tokens, at about the same realized compression, and it has no threshold to tune.
VERIFY_RULE = "argmax"


@dataclass(frozen=True)
class VerifyScore:
    rule: str
    score: float  # the rule's score over the span
    threshold: float
    passed: bool  # score <= threshold: the eviction may be committed
    n: int  # positions checked
    mean: float  # mean per-token loss (the old delta_self), for comparison
    max: float  # largest per-token loss
    changed: int | None  # positions whose argmax differs (None when not given)

    def describe(self) -> str:
        return describe(self.rule, self.score, self.threshold)


def describe(rule: str, score: float, threshold: float) -> str:
    """'largest per-token loss 0.0123 <= 0.5 nats' (plain words for status lines and reasons)."""
    cmp = "<=" if score <= threshold else ">"
    if rule == "max":
        return f"largest per-token loss {score:.4f} {cmp} {threshold:g} nats"
    if rule == "argmax":
        n = int(score) if math.isfinite(score) else score
        return f"{n} changed top token{'' if n == 1 else 's'} {cmp} {threshold:g}"
    if rule == "sum":
        return f"summed loss {score:.4f} {cmp} {threshold:g} nats"
    return f"mean loss {score:.4f} {cmp} {threshold:g} nats/token"


def check_rule(rule: str, threshold: float | None = None) -> tuple[str, float]:
    """(rule, threshold) validated; threshold None = the rule's default."""
    if rule not in RULES:
        raise ValueError(f"verify rule must be one of {', '.join(RULES)}; got {rule!r}")
    if threshold is None:
        threshold = RULES[rule][1]
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not threshold >= 0:
        raise ValueError(f"verify threshold must be a number >= 0, got {threshold!r}")
    return rule, float(threshold)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """f64 log-probabilities of a logits vector (every log-prob page-local compares is computed here)."""
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


def logp(logits: np.ndarray, tok: int) -> float:
    """log p(tok) under a logits vector, in f64 (the same value as log_softmax(logits)[tok])."""
    x = np.asarray(logits, dtype=np.float64)
    m = x.max()
    return float(x[tok] - m - math.log(np.exp(x - m).sum()))


def kl(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    """KL(p || q) in nats between the distributions of two logits vectors."""
    lp, lq = log_softmax(p_logits), log_softmax(q_logits)
    return float(np.sum(np.exp(lp) * (lp - lq)))


def top_token(scores, is_eog) -> int:
    """The top token of logits or log-probs; every end-of-generation token counts as one (-1), so two
    caches that both end the answer agree even when they pick different end tokens."""
    t = int(np.argmax(scores))
    return -1 if is_eog(t) else t


def verify_score(lp_full, lp_evicted, changed=None, rule: str = VERIFY_RULE,
                 threshold: float | None = None) -> VerifyScore:
    """Decide self-verification from per-position arrays of equal length k:

    lp_full[i], lp_evicted[i]: log p of the full cache's token at position i under each cache;
    changed[i] (bool, optional; required by rule "argmax"): the two caches' top tokens differ.
    A non-finite loss fails every rule. An empty span passes (nothing to check)."""
    rule, threshold = check_rule(rule, threshold)
    a = np.asarray(lp_full, dtype=np.float64).reshape(-1)
    b = np.asarray(lp_evicted, dtype=np.float64).reshape(-1)
    if a.shape != b.shape:
        raise ValueError(f"lp_full and lp_evicted differ in length ({a.size} vs {b.size})")
    n = int(a.size)
    ch = None
    if changed is not None:
        ch = np.asarray(changed, dtype=bool).reshape(-1)
        if ch.size != n:
            raise ValueError(f"changed has {ch.size} entries for {n} positions")
    elif rule == "argmax":
        raise ValueError("rule 'argmax' needs `changed` (where the top tokens differ)")
    loss = a - b
    bad = n > 0 and not bool(np.all(np.isfinite(loss)))
    mean = float(loss.mean()) if n else 0.0
    mx = float(loss.max()) if n else 0.0
    n_changed = None if ch is None else int(ch.sum())
    if bad:
        score = math.inf
    elif rule == "max":
        score = max(mx, 0.0) if n else 0.0  # a gain (negative loss) never needs a threshold below 0
    elif rule == "argmax":
        score = float(n_changed)
    elif rule == "sum":
        score = float(np.clip(loss, 0.0, None).sum())
    else:
        score = mean
    return VerifyScore(rule=rule, score=score, threshold=threshold, passed=bool(score <= threshold), n=n,
                       mean=mean if not bad else math.inf, max=mx if not bad else math.inf, changed=n_changed)
