"""Evaluation: RULER-style synthetic tasks (tasks), readers for RULER/kvpress files (readers),
RULER scoring (scoring). Pure Python; nothing here calls llama.cpp."""
