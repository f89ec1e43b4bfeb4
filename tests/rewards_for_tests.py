"""Reward functions that misbehave on purpose, loaded by dotted path from training subprocesses."""

from __future__ import annotations

import os

_calls = 0


def raises_later(completions: list[str], answers: list[str]) -> list[float]:
    """Scores like the arithmetic verifier, then raises from call number QARL_TEST_RAISE_AFTER_CALLS on."""
    global _calls
    _calls += 1
    if _calls > int(os.environ.get("QARL_TEST_RAISE_AFTER_CALLS", "1000000")):
        raise ValueError("simulated verifier crash")
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answers)]


def always_zero(completions: list[str], answers: list[str]) -> list[float]:
    """A verifier nothing satisfies: every group has one reward for all, a start with no learning signal."""
    return [0.0] * len(completions)
