"""The embedded task: operations on digit strings with one verifiable answer.

  op=reverse  "40213>"  -> "31204"   reverse the digits (the default for the embedded tiny model)
  op=add      "37+45="  -> "82"      addition of two num_digits-digit numbers

The answer is written in a fixed format (digits, then end-of-text) and checked exactly. Problems are
drawn from a seed; the held-out split is disjoint from the training split.

Why reversal is the default: the embedded 2-layer model learns the reversal's attention pattern in a
few dozen SFT steps, so a short warm start leaves it partly right and RL has room to finish the job on
2 CPU cores. Two-digit addition needs a larger model or far longer training (measured: 10 % held-out
accuracy after 600 SFT steps); it is here for larger models.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from qarl.tasks.chat import PromptFormat


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str
    where: str = field(default="", compare=False)  # a dataset row's file and line, for messages ("": generated)


def _problem(op: str, num_digits: int, rng: random.Random) -> Problem:
    if op == "reverse":
        digits = "".join(rng.choice("0123456789") for _ in range(num_digits))
        return Problem(prompt=f"{digits}>", answer=digits[::-1])
    low, high = 10 ** (num_digits - 1), 10**num_digits - 1
    a, b = rng.randint(low, high), rng.randint(low, high)
    return Problem(prompt=f"{a}+{b}=", answer=str(a + b))


def _distinct_problems(op: str, num_digits: int) -> int:
    return 10**num_digits if op == "reverse" else (9 * 10 ** (num_digits - 1)) ** 2


class ArithmeticTask:
    """Digit-string problems; the `arithmetic` reward checks the answer exactly."""

    name = "arithmetic"
    OPS = ("reverse", "add")

    def __init__(self, num_digits: int = 5, num_train: int = 2000, num_eval: int = 100, seed: int = 0, op: str = "reverse"):
        if op not in self.OPS:
            raise ValueError(f"task.op={op!r}; choose one of {self.OPS}")
        if num_digits < 1:
            raise ValueError("task.num_digits must be at least 1")
        total = _distinct_problems(op, num_digits)
        if num_train + num_eval > total // 2:
            raise ValueError(f"only {total} distinct problems with task.op={op}, task.num_digits={num_digits}: ask for "
                             f"at most {total // 2} in task.num_train + task.num_eval, or raise task.num_digits")
        rng = random.Random(seed)
        problems: dict[str, Problem] = {}
        while len(problems) < num_train + num_eval:
            p = _problem(op, num_digits, rng)
            problems.setdefault(p.prompt, p)
        ordered = list(problems.values())
        self.train = ordered[:num_train]
        self.eval = ordered[num_train:]
        self.transfer: list[Problem] = []  # the embedded task has no transfer split

    def calibration_texts(self, n: int, prompts: PromptFormat | None = None) -> list[str]:
        """Prompts with their answers, as `prompts` formats them (raw without): what the policy sees in training."""
        if prompts is None:
            return [p.prompt + p.answer for p in self.train[:n]]
        return [prompts.answered_text(p.prompt, p.answer) for p in self.train[:n]]
