"""Evaluation: RULER-style synthetic tasks (tasks), readers for RULER/kvpress files (readers), RULER
scoring (scoring) — pure Python — and the runner (runner, on the engine's runtime), metrics and
report that show what the gate protects."""
