"""A reward function of your own, for `trainer.rewards`.

qarl calls a reward with one batch: the completions (the text the policy generated, without the prompt) and the
reference answers (the task's answer column), and wants one float per completion back:

    fn(completions: list[str], answers: list[str]) -> list[float]

Name it in a recipe by its dotted path, `module:function` (or `module.function`); the module must be importable, so
run qarl from the repository root with the root on the path:

    PYTHONPATH=. .venv/bin/qarl train examples/own_model.yaml \
        "trainer.rewards=[{name: examples.custom_reward:final_number, weight: 1.0}, {name: examples.custom_reward:brevity, weight: 0.1}]"

or in the recipe:

    trainer:
      rewards:
        - name: examples.custom_reward:final_number   # the first reward is the verifier eval/accuracy counts
          weight: 1.0
        - name: examples.custom_reward:brevity
          weight: 0.1

The rewards are summed with their weights. A reward that raises stops the run with an error naming it;
`trainer.reward_error=zero` scores the failing sample 0 instead. Registered names (`arithmetic`, `arithmetic_digits`,
`format`, `boxed_math`, `gsm8k`) are in qarl/rewards.py.
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _value(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def final_number(completions: list[str], answers: list[str]) -> list[float]:
    """1.0 if the last number in the completion equals the reference's final number (after '####' if it has one)."""
    out = []
    for completion, answer in zip(completions, answers):
        found = _NUMBER.findall(completion)
        ref = _NUMBER.findall(answer.split("####")[-1])
        got = _value(found[-1]) if found else None
        want = _value(ref[-1]) if ref else None
        out.append(1.0 if got is not None and got == want else 0.0)
    return out


def brevity(completions: list[str], answers: list[str], limit: int = 400) -> list[float]:
    """A small shaping term: 1.0 for a completion of up to `limit` characters, falling linearly to 0 at twice that."""
    return [max(0.0, min(1.0, 2.0 - len(c) / limit)) for c in completions]
