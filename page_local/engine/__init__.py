"""The engine: the only code that drives a llama.cpp context through a turn (turn.py's steps, in the order
message.py runs them), and the Engine class desktop apps embed (engine.py: settings and wiring)."""

from page_local.engine.decision import Decision, Result, Sampling
from page_local.engine.engine import Engine, Stream

__all__ = ["Decision", "Engine", "Result", "Sampling", "Stream"]
