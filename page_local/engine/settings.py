"""A turn's settings as one value, and the rules every setting is checked by.

The Engine keeps its settings as attributes (set_budget, set_gate, ...: each checked here before it is stored),
and resolves them once before a turn (Engine.turn_settings() -> overrides(), with a request's overrides) into a
TurnSettings that is passed down: nothing of the engine is changed and put back to run one turn with other settings.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from page_local.engine.room import RoomRules, check_on_full
from page_local.engine.turn import AFTER_ANSWER, N_SINK, W, supported
from page_local.evictors import get_evictor
from page_local.evictors.base import resolve_budget
from page_local.gate import BASE_MODE, VERIFY_MODES, Gate, check_gate_mode

MAX_RUNGS = 4  # the ladder's most budgets: each is one candidate sequence (sequences 1..MAX_FUTURES)
MAX_VERIFY_TOKENS = 256


class SettingError(ValueError):
    """A turn setting refused by the engine's own rule; .field names it (gate, evictor, budget, ...)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class TurnSettings:
    """What one turn runs with, resolved once before it starts and passed down as a value: the engine's own
    settings (Engine.turn_settings()), or those with a request's overrides. Nothing of the engine is changed
    to run a turn with other settings."""
    gate_mode: str
    gate: Gate
    evictor: object  # an evictor instance (evictors/)
    budget: float | int
    ladder: tuple
    verify_tokens: int
    verify_rule: str
    verify_threshold: float
    on_full: str
    n_keep: int
    compact: bool
    seed: int
    park: bool = False  # evict for speed by parking (engine/parking.py)
    park_from: int = 0  # with park: below this many cells the full cache is kept
    reread: str = "never"  # after a message room-making cut, read the conversation again (defaults.REREADS)

    @property
    def verifies(self) -> bool:
        return self.gate_mode in VERIFY_MODES

    @property
    def room_rules(self) -> RoomRules:
        return RoomRules(on_full=self.on_full, n_keep=self.n_keep, compact=self.compact, seed=self.seed,
                         evictor=self.evictor)


# --- the rules each setting is checked by (Engine.set_*, and a request's overrides) --------------------------

def check_budget(budget: float | int) -> float | int:
    """A speed budget: a ratio of the conversation or a cell count (evictors.base.resolve_budget's rule)."""
    resolve_budget(budget, 10_000, W, N_SINK)  # validates (ratio or absolute) before use
    return budget


def check_ladder(ladder) -> tuple:
    """The budgets gate mode 'search' tries, as a tuple: 1 to MAX_RUNGS of them, each a valid budget."""
    rungs = tuple(ladder)
    if not 1 <= len(rungs) <= MAX_RUNGS:
        raise ValueError(f"the ladder must have 1 to {MAX_RUNGS} budgets, got {len(rungs)}")
    for r in rungs:
        check_budget(r)
    return rungs


def check_verify_tokens(tokens: int) -> int:
    if isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= MAX_VERIFY_TOKENS:
        raise ValueError(f"verify_tokens must be an int in [1, {MAX_VERIFY_TOKENS}], got {tokens!r}")
    return tokens


def check_max_tokens(max_tokens: int) -> int:
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
    return max_tokens


def check_park_from(park_from: int | None) -> int | None:
    """None (the model's own default, parking.Parking.default_from) or a cell count >= 0."""
    if park_from is not None and (isinstance(park_from, bool) or not isinstance(park_from, int) or park_from < 0):
        raise ValueError(f"park_from must be an int >= 0, got {park_from!r}")
    return park_from


def check_pair(evictor, gate_mode: str) -> None:
    """Refuse an evictor that reads the answer under a gate that evicts before there is one."""
    if evictor.needs & AFTER_ANSWER and gate_mode not in VERIFY_MODES:
        raise ValueError(f"evictor {evictor.name!r} scores the prompt by the full cache's answer, which only the "
                         f"verify and search gates decode before evicting (gate is {gate_mode!r}); use gate "
                         "verify, search, page+verify or page+search, or evictor lorekv")


def overrides(base: TurnSettings, gate: str | None = None, evictor: str | None = None,
              budget: float | int | None = None, verify_tokens: int | None = None,
              on_full: str | None = None) -> TurnSettings:
    """base (the engine's own settings) with a request's overrides (None: base's), each checked by the engine's
    own rule; SettingError (a ValueError) names the one refused."""
    mode, ev = base.gate_mode, base.evictor
    try:
        if gate is not None:
            mode = check_gate_mode(gate)
    except ValueError as e:
        raise SettingError("gate", str(e)) from None
    try:
        if evictor is not None and evictor != ev.name:
            ev = supported(get_evictor(evictor))
    except ValueError as e:
        raise SettingError("evictor", str(e)) from None
    try:
        check_pair(ev, mode)
    except ValueError as e:
        raise SettingError("evictor" if evictor is not None else "gate", str(e)) from None
    try:
        if budget is not None:
            check_budget(budget)
    except ValueError as e:
        raise SettingError("budget", str(e)) from None
    try:
        if verify_tokens is not None:
            check_verify_tokens(verify_tokens)
    except ValueError as e:
        raise SettingError("verify_tokens", str(e)) from None
    try:
        full = check_on_full(on_full) if on_full is not None else base.on_full
    except ValueError as e:
        raise SettingError("on_full", str(e)) from None
    # the engine's Gate (its calibration, a threshold set on it) unless the mode changes
    g = base.gate if mode == base.gate_mode else Gate(BASE_MODE[mode], base.gate.profile)
    return dataclasses.replace(base, gate_mode=mode, gate=g, evictor=ev,
                               budget=base.budget if budget is None else budget,
                               verify_tokens=verify_tokens or base.verify_tokens, on_full=full)
