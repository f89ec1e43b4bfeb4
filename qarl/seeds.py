"""Seeds derived from a run's seed. Each draw of a run (an epoch's shuffle of the prompts, a step's rollout, LoRA's
noise at a step, the held-out samples) takes its own, a pure function of (run seed, position), so a resumed run
draws exactly what the uninterrupted run drew."""

from __future__ import annotations

SEED_STRIDE = 1_000_003  # a prime larger than any position a run reaches: two run seeds never share a draw


def derived_seed(seed: int, position: int) -> int:
    return seed * SEED_STRIDE + position
