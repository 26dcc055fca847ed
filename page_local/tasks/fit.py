"""Length control as RULER does it: the largest haystack whose prompt fits a token budget, with the caller's
tokenizer (tests pass a whitespace counter; the runner passes the model's tokenizer)."""

from __future__ import annotations

from typing import Callable

CountTokens = Callable[[str], int]
MAX_SIZE = 1 << 20  # no haystack grows past this many units (lines, words, or the Zipf total)


def fit(make, text_of, min_size: int, budget: int, count_tokens: CountTokens, what: str):
    """(make(size), tokens) for the largest size whose count_tokens(text_of(.)) <= budget: bracket
    a linear estimate from two small sizes, then bisect. Every instance is rebuilt from scratch,
    so the result depends only on the arguments. ValueError when even min_size does not fit."""
    seen: dict[int, tuple[int, object]] = {}

    def fits(size: int) -> bool:
        if size not in seen:
            obj = make(size)
            t = count_tokens(text_of(obj))
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"count_tokens must return a non-negative int, got {t!r}")
            seen[size] = (t, obj)
        return seen[size][0] <= budget

    lo, probe = min_size, 2 * min_size + 16
    if not fits(lo):
        raise ValueError(f"{what}: the smallest instance takes {seen[lo][0]} tokens, more than "
                         f"the {budget} available; raise target_tokens")
    if not fits(probe):
        hi = probe
    else:
        per_unit = (seen[probe][0] - seen[lo][0]) / (probe - lo)
        if per_unit <= 0:
            raise ValueError(f"{what}: count_tokens does not grow with the haystack")
        guess = min(probe + max(1, int((budget - seen[probe][0]) / per_unit)), MAX_SIZE)
        step = max(1, guess // 64)
        if fits(guess):  # gallop up
            lo, hi = guess, min(guess + step, MAX_SIZE)
            while fits(hi):
                if hi >= MAX_SIZE:
                    raise ValueError(f"{what}: no haystack up to {MAX_SIZE} reaches the target")
                lo, step = hi, step * 2
                hi = min(lo + step, MAX_SIZE)
        else:  # gallop down; probe fits
            lo, hi = probe, guess
            while hi - step > lo:
                if fits(hi - step):
                    lo = hi - step
                    break
                hi, step = hi - step, step * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    t, obj = seen[lo]
    return obj, t
