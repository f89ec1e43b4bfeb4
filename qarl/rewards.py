"""Reward functions, by registered name or dotted path, combined with weights.

A reward function takes the completions and the reference answers of a batch and returns one float
per completion: `fn(completions: list[str], answers: list[str]) -> list[float]` (TRL's convention of
batch-in, list-out). Each is imported and called once on a sample before any model loads (`check_on_sample`); what
it returns is checked at every call: one finite number per completion (a string is refused, not converted).
"""

from __future__ import annotations

import importlib
import inspect
import math
import numbers
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from qarl.config import ConfigError, RewardSpec

RewardFn = Callable[[list[str], list[str]], list[float]]
REWARDS: dict[str, RewardFn] = {}


def register(name: str) -> Callable[[RewardFn], RewardFn]:
    def add(fn: RewardFn) -> RewardFn:
        REWARDS[name] = fn
        return fn

    return add


def _normalize_number(text: str) -> str:
    text = text.strip().replace(",", "").rstrip(".")
    try:
        value = float(text)
    except ValueError:
        return text
    return str(int(value)) if value.is_integer() else str(value)


@register("arithmetic")
def arithmetic_reward(completions: list[str], answers: list[str]) -> list[float]:
    """The embedded task's verifier: 1 if the completion is exactly the answer."""
    return [1.0 if c.strip() == a.strip() else 0.0 for c, a in zip(completions, answers)]


@register("arithmetic_digits")
def arithmetic_digits_reward(completions: list[str], answers: list[str]) -> list[float]:
    """Partial credit for the embedded task: the fraction of answer digits right, position by position
    (a denser signal than exact match while the policy rarely gets everything right)."""
    out = []
    for c, a in zip(completions, answers):
        c, a = c.strip(), a.strip()
        if not c.isdigit():
            out.append(0.0)
            continue
        out.append(sum(x == y for x, y in zip(c, a)) / max(len(c), len(a)))
    return out


def _is_bare_integer(text: str) -> bool:
    return re.fullmatch(r"\s*-?\d+\s*", text) is not None


@register("format")
def format_reward(completions: list[str], answers: list[str]) -> list[float]:
    """1 if the completion is a bare (signed) integer, whatever its value: the answer format."""
    return [1.0 if _is_bare_integer(c) else 0.0 for c in completions]


def _last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, braces balanced."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None


@register("boxed_math")
def boxed_math_reward(completions: list[str], answers: list[str]) -> list[float]:
    """1 if the last \\boxed{} answer equals the reference's (a MATH solution's last \\boxed{}, or the reference itself;
    numbers compared by value)."""
    out = []
    for c, a in zip(completions, answers):
        boxed, ref = _last_boxed(c), _last_boxed(a)
        ref = a if ref is None else ref
        out.append(1.0 if boxed is not None and _normalize_number(boxed) == _normalize_number(ref) else 0.0)
    return out


@register("gsm8k")
def gsm8k_reward(completions: list[str], answers: list[str]) -> list[float]:
    """GSM8K convention: the final answer follows '####'; references may hold the whole solution."""
    out = []
    for c, a in zip(completions, answers):
        got = re.search(r"####\s*(-?[\d,\.]+)", c)
        ref = a.split("####")[-1]
        out.append(1.0 if got and _normalize_number(got.group(1)) == _normalize_number(ref) else 0.0)
    return out


# Whether a completion holds an answer the verifier could read at all, whatever its value: the "parse
# rate" of evaluation hygiene (an answer lost to formatting is not the same failure as a wrong one).
ANSWER_PARSERS: dict[str, Callable[[str], bool]] = {
    "arithmetic": _is_bare_integer,
    "arithmetic_digits": lambda c: c.strip().isdigit(),
    "format": _is_bare_integer,
    "boxed_math": lambda c: _last_boxed(c) is not None,
    "gsm8k": lambda c: re.search(r"####\s*-?[\d,\.]+", c) is not None,
}


def resolve_reward(name: str) -> RewardFn:
    if name in REWARDS:
        return REWARDS[name]
    module_name, sep, attr = name.replace(":", ".").rpartition(".")
    if not sep or not module_name:
        raise ConfigError(f"unknown reward {name!r}: registered rewards are {sorted(REWARDS)}; "
                          "or give a dotted path such as my_pkg.rewards:my_reward")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"reward {name!r} could not be imported ({e}); registered rewards are {sorted(REWARDS)}") from None
    except SyntaxError as e:
        raise ConfigError(f"reward {name!r}: {e.filename}:{e.lineno}: SyntaxError: {e.msg}; fix the module") from None
    except Exception as e:  # the module's own code failed as it was imported
        raise ConfigError(f"reward {name!r}: importing {module_name} raised {type(e).__name__}: {e}; fix the "
                          "module") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise ConfigError(f"reward {name!r}: module {module_name} has no {attr!r}; registered rewards are "
                          f"{sorted(REWARDS)}")
    if not callable(fn):
        raise ConfigError(f"reward {name!r} is not callable")
    return fn


class RewardError(RuntimeError):
    """A reward function failed; the message names it."""


@dataclass
class WeightedRewards:
    """Several reward functions, summed with weights. `on_error`: "raise" or "zero" (that sample gets 0)."""

    fns: list[tuple[str, RewardFn, float]]
    on_error: str = "raise"

    @classmethod
    def from_specs(cls, specs: Sequence[RewardSpec], on_error: str = "raise") -> WeightedRewards:
        if not specs:
            raise ConfigError("trainer.rewards is empty: name at least one reward")
        if on_error not in ("raise", "zero"):
            raise ConfigError(f"trainer.reward_error must be 'raise' or 'zero', not {on_error!r}")
        return cls([(s.name, resolve_reward(s.name), s.weight) for s in specs], on_error)

    def _call(self, name: str, fn: RewardFn, completions: list[str], answers: list[str]) -> list[float]:
        try:
            values = fn(completions, answers)
        except Exception as e:
            if self.on_error == "raise":
                raise RewardError(f"reward {name!r} raised {type(e).__name__}: {e} (set trainer.reward_error=zero "
                                  "to score such samples 0 instead)") from e
            return [self._one(name, fn, c, a) for c, a in zip(completions, answers)]
        return self._checked(name, values, completions)

    def _checked(self, name: str, values: object, completions: list[str]) -> list[float]:
        """What a reward returned, as one float per completion: anything else is the reward's fault, named. A value
        that is not finite scores 0 with trainer.reward_error=zero, else it stops the run."""
        try:
            values = list(values)  # type: ignore[call-overload]
        except TypeError:
            raise RewardError(f"reward {name!r} returned {type(values).__name__}, not a list of one float per "
                              "completion") from None
        if len(values) != len(completions):
            raise RewardError(f"reward {name!r} returned {len(values)} values for {len(completions)} completions")
        out = []
        for i, value in enumerate(values):
            if not isinstance(value, numbers.Real):
                raise RewardError(f"reward {name!r} returned {type(value).__name__} values ({value!r} for completion "
                                  f"{i}); a reward returns one float per completion (qarl converts no strings)")
            if not math.isfinite(value) and self.on_error == "raise":
                raise RewardError(f"reward {name!r} returned {value} for completion {i} ({completions[i][:40]!r}); a "
                                  "reward returns finite numbers: fix it (trainer.reward_error=zero scores such "
                                  "samples 0)")
            out.append(float(value) if math.isfinite(value) else 0.0)
        return out

    def _one(self, name: str, fn: RewardFn, completion: str, answer: str) -> float:
        """Score one sample alone, so that only the sample that breaks the function gets 0."""
        try:
            return self._checked(name, fn([completion], [answer]), [completion])[0]
        except Exception:
            return 0.0

    def check_on_sample(self, answer: str) -> None:
        """Call each reward once, before any model loads, on a sample: `answer` (the first training answer) as a
        right completion and an empty one as a wrong completion. A reward that cannot take (completions, answers),
        raises (unless trainer.reward_error=zero) or returns anything but one finite number per completion is a
        ConfigError naming it now, not a failure steps into the run."""
        completions, answers = [answer, ""], [answer, answer]
        sample = f"completions [{answer[:40]!r}, ''], answers [{answer[:40]!r}] * 2"
        for name, fn, _ in self.fns:
            try:
                signature = inspect.signature(fn)
            except (TypeError, ValueError):  # no signature to read (a builtin): the call below tells
                signature = None
            try:
                if signature is not None:
                    signature.bind(completions, answers)
            except TypeError:
                raise ConfigError(f"reward {name!r} takes {signature}; a reward takes (completions, answers) and "
                                  "returns one float per completion") from None
            try:
                values = fn(completions, answers)
            except Exception as e:
                if self.on_error == "zero":  # asked for: a sample it fails on scores 0
                    continue
                raise ConfigError(f"reward {name!r} raised {type(e).__name__}: {e} on a sample before the run "
                                  f"({sample}); fix it, or set trainer.reward_error=zero if it may fail on some "
                                  "completions") from None
            try:
                self._checked(name, values, completions)
            except RewardError as e:
                raise ConfigError(f"{e} (called on a sample before the run: {sample})") from None

    @property
    def verifier_name(self) -> str:
        return self.fns[0][0]

    def verify(self, completions: list[str], answers: list[str]) -> list[float]:
        """The first reward alone: by convention the verifier that held-out accuracy counts."""
        name, fn, _ = self.fns[0]
        return self._call(name, fn, completions, answers)

    def __call__(self, completions: list[str], answers: list[str]) -> tuple[list[float], dict[str, float]]:
        """Total reward per completion, and the mean of each named reward (for metrics)."""
        total = [0.0] * len(completions)
        means = {}
        for name, fn, weight in self.fns:
            values = self._call(name, fn, completions, answers)
            total = [t + weight * v for t, v in zip(total, values)]
            means[f"reward/{name}"] = sum(values) / max(len(values), 1)
        return total, means
