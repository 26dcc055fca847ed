"""A turn's settings as one value: what the gate, the evictor, the budget, the check and room-making run with.

The Engine resolves them once before a turn (Engine.turn_settings(), with a request's overrides) and passes the
value down: nothing of the engine is changed and put back to run one turn with other settings.
"""

from __future__ import annotations

from dataclasses import dataclass

from page_local.engine.room import RoomRules
from page_local.gate import VERIFY_MODES, Gate


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
    reread: bool = False  # after a message room-making cut, read the conversation again (room.reread_from)

    @property
    def verifies(self) -> bool:
        return self.gate_mode in VERIFY_MODES

    @property
    def room_rules(self) -> RoomRules:
        return RoomRules(on_full=self.on_full, n_keep=self.n_keep, compact=self.compact, seed=self.seed,
                         evictor=self.evictor)
