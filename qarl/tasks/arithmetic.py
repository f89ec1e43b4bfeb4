"""The embedded task: multi-digit addition with a verifiable answer.

Prompt "37+45=", expected completion "82" then end-of-text. Problems are drawn from a seed; the
held-out split is disjoint from the training split (no pair (a, b) appears in both).
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str


class ArithmeticTask:
    """Addition of two `num_digits`-digit numbers; the `arithmetic` reward checks the digits."""

    name = "arithmetic"

    def __init__(self, num_digits: int = 2, num_train: int = 2000, num_eval: int = 100, seed: int = 0):
        if num_digits < 1:
            raise ValueError("task.num_digits must be at least 1")
        low, high = 10 ** (num_digits - 1), 10**num_digits - 1
        total = (high - low + 1) ** 2
        if num_train + num_eval > total:
            raise ValueError(f"only {total} distinct {num_digits}-digit problems; ask for fewer than "
                             f"num_train + num_eval = {num_train + num_eval}")
        rng = random.Random(seed)
        pairs: set[tuple[int, int]] = set()
        while len(pairs) < num_train + num_eval:
            pairs.add((rng.randint(low, high), rng.randint(low, high)))
        ordered = sorted(pairs)
        rng.shuffle(ordered)
        make = lambda a, b: Problem(prompt=f"{a}+{b}=", answer=str(a + b))  # noqa: E731
        self.train = [make(a, b) for a, b in ordered[:num_train]]
        self.eval = [make(a, b) for a, b in ordered[num_train:]]

    def calibration_texts(self, n: int) -> list[str]:
        """Prompts with their answers: the activations the policy sees in training."""
        return [p.prompt + p.answer for p in self.train[:n]]
