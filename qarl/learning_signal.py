"""A run with no learning signal, told from a GRPO run's metrics rows, and the watch that says so.

GRPO learns only from groups whose completions got different rewards: a group that is all wrong (or all right) has
zero advantage everywhere and adds nothing to the gradient. A quantized start that answers almost nothing right
gives almost no such groups, and on SmolLM2-135M (60 steps, 8 completions a prompt) two kinds of run never learned:

- **no signal**: NVFP4 W4A4 (1.7 % held-out at the start), every seed: 92-96 % of groups with one reward for all
  over the first 15 steps, against at most 89 % in any run that learned;
- **sharpening on noise**: NVFP4 W4A16 seed 2 (6.9 % at the start, as its five healthy seeds): 87 % of groups
  without signal, as the others, but its entropy fell 22 % in 15 steps while its reward stayed where it started
  (+0.0 of the start's reward std; every SmolLM2 run that learned: +0.15 or more), and it never recovered.

Slow healthy starts (W4A16 seeds 0 and 3) look like failures until about step 12, so the rule judges once, at the end
of a window of `trainer.no_signal_window` steps (15 of 60 in the evidence); benchmarks/no_signal_watch.py applies it
to every recorded run (benchmarks/results/no_signal_watch.md). Runs with a signal (the 0.5B model's: 21-26 % of groups
without one) may gain slowly against their rewards' spread; the sharpening rule asks for a scarce signal first. The
thresholds come from one model and one task, and the runs that learned sit at most 0.015 below the zero-std one, so
`warn` is the default and `stop` a choice.

With the soft overlong punishment the window cannot tell: every W4A16 start then has a signal (finished answers
against truncated ones) and spends it shortening its answers. Two of the fifteen W4A16 runs on that recipe never got
going (W4A16 seed 2 at 12.6 %, with the FP8 cache seed 0 at 29.2 %, against 48.9-57.0 % for the rest): after the
window their answers shrank on to 7-8 % of the start's length (the window's first third: ~92 tokens; 7 tokens is
`#### N` with next to no working) while about 80 % or more of the groups kept one task reward for all; no recorded
run that learned went below 15.8 %. So after the window a second rule, **collapse**, judges each step's last `RECENT`
rows: answers at `SHRINK` of the start's length or shorter, with at least `SCARCE_SIGNAL_SHARE` of the groups without
a task signal (the task's reward, not the punishment's: `reward/frac_zero_std_task`). It fires at steps 23 and 28 of
those two runs, on no other.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from qarl.config import NoLearningSignal

NO_SIGNAL_SHARE = 0.90  # zero-std groups over the window at or above this: no signal
SCARCE_SIGNAL_SHARE = 0.80  # at or above this, a policy that sharpens without gaining is sharpening on noise
ENTROPY_DROP = 0.15  # a fall of the entropy by this share of its start: the policy is committing
REWARD_GAIN_SD = 0.10  # a reward that rose by less than this many of the start's reward stds did not rise

SHRINK = 0.12  # answers this share of the start's length or shorter, the task's signal scarce: collapsed
RECENT = 5  # the steps the collapse rule reads

ZERO_STD, REWARD, REWARD_STD, ENTROPY = "reward/frac_zero_std", "reward/mean", "reward/std", "entropy"
TASK_ZERO_STD, LENGTH = "reward/frac_zero_std_task", "completion/mean_length"  # the task's own share (a shaped reward)


@dataclass(frozen=True)
class Window:
    """What the rule reads of a window's rows: the mean share of zero-std groups, and the reward and entropy at its
    start and its end (the means of its first and last third)."""

    last_step: int
    zero_std_share: float
    reward_start: float
    reward_end: float
    reward_gain_sd: float  # the reward's rise, in stds of the start's rewards
    entropy_start: float
    entropy_end: float

    @property
    def entropy_drop(self) -> float:
        return 1 - self.entropy_end / self.entropy_start if self.entropy_start > 0 else 0.0

    @property
    def cause(self) -> str | None:
        """"no_signal", "noise" (sharpening on noise), or None: the run has a signal to learn from."""
        if self.zero_std_share >= NO_SIGNAL_SHARE:
            return "no_signal"
        if (self.zero_std_share >= SCARCE_SIGNAL_SHARE and self.entropy_drop >= ENTROPY_DROP
                and self.reward_gain_sd < REWARD_GAIN_SD):
            return "noise"
        return None

    def metrics(self) -> dict[str, float]:
        """The metrics row's record of the judgement."""
        return {"no_signal/fired": float(self.cause is not None), "no_signal/zero_std_share": self.zero_std_share,
                "no_signal/entropy_drop": self.entropy_drop, "no_signal/reward_gain_sd": self.reward_gain_sd}


@dataclass(frozen=True)
class Shrink:
    """What the collapse rule reads at a step after the window: the answers' mean length at the start (the window's
    first third) and over the last `RECENT` steps, and those steps' share of groups with one task reward for all."""

    step: int
    length_start: float
    length_now: float
    zero_std_share: float

    @property
    def collapsed(self) -> bool:
        return self.length_now <= SHRINK * self.length_start and self.zero_std_share >= SCARCE_SIGNAL_SHARE

    def metrics(self) -> dict[str, float]:
        return {"no_signal/fired": 1.0, "no_signal/length_ratio": self.length_now / self.length_start,
                "no_signal/zero_std_share": self.zero_std_share}


def read_shrink(rows: list[dict[str, Any]], window: int) -> Shrink | None:
    """The collapse rule's reading of `rows` (training rows, in order, the window's and later ones); None: no lengths
    recorded, or not past the window."""
    start_rows, recent = rows[: max(1, window // 3)], rows[-RECENT:]
    if len(rows) <= window or any(r.get(LENGTH) is None for r in start_rows + recent):
        return None
    start = _mean(start_rows, LENGTH)
    share = sum(r.get(TASK_ZERO_STD, r[ZERO_STD]) for r in recent) / len(recent)
    return Shrink(rows[-1]["step"], start, _mean(recent, LENGTH), share) if start > 0 else None


def training_rows(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of training steps (not a final evaluation's), in step order."""
    return sorted((r for r in rows if r.get(ZERO_STD) is not None), key=lambda r: r["step"])


def read_window(rows: list[dict[str, Any]]) -> Window:
    """The window of `rows` (training rows, in order; at least one)."""
    third = max(1, len(rows) // 3)
    start, end = rows[:third], rows[-third:]
    reward_start, reward_end = _mean(start, REWARD), _mean(end, REWARD)
    spread = _mean(start, REWARD_STD)
    rise = reward_end - reward_start
    return Window(last_step=rows[-1]["step"], zero_std_share=_mean(rows, ZERO_STD), reward_start=reward_start,
                  reward_end=reward_end,
                  reward_gain_sd=rise / spread if spread > 0 else (float("inf") if rise > 0 else 0.0),
                  entropy_start=_mean(start, ENTROPY), entropy_end=_mean(end, ENTROPY))


def _mean(rows: list[dict[str, Any]], key: str) -> float:
    """The mean of `key` over the rows that have it (a step that trained no completion has no entropy); 0: none."""
    values = [r[key] for r in rows if r.get(key) is not None]
    return sum(values) / len(values) if values else 0.0


@dataclass(frozen=True)
class Settings:
    """What the advice names of the run's recipe."""

    quantized: bool
    num_generations: int
    temperature: float
    lr: float
    stop: bool  # trainer.no_signal_watch=stop
    overlong_start_step: int | None = None  # trainer.soft_overlong_start_step; None: no overlong punishment


def describe(window: Window, settings: Settings) -> str:
    """One line: what the window showed and what to change."""
    groups = (f"{percent(window.zero_std_share)} of the groups of {settings.num_generations} completions got one "
              "reward for all")
    rewards = f"{window.reward_start:.3g} -> {window.reward_end:.3g}"
    if window.cause == "no_signal":
        what = f"{groups} (mean reward {rewards}), so the update had almost nothing to follow"
    else:
        what = (f"the policy's entropy fell {percent(window.entropy_drop)} ({window.entropy_start:.2f} -> "
                f"{window.entropy_end:.2f}) while the mean reward did not rise ({rewards}; {groups}): it is "
                "sharpening on noise")
    return f"no learning signal in steps 0-{window.last_step}: {what}. What to change: {advice(window.cause, settings)}"


def describe_collapse(shrink: Shrink, settings: Settings) -> str:
    """One line: how the answers shrank and what to change."""
    return (f"no learning signal at step {shrink.step}: the answers shrank to {shrink.length_now:.0f} tokens (from "
            f"{shrink.length_start:.0f} at the start) while {percent(shrink.zero_std_share)} of the groups of "
            f"{settings.num_generations} completions got one task reward for all: the policy answers without working "
            "the problem out and has almost nothing left to learn from. "
            f"What to change: {advice('collapse', settings)}")


def percent(share: float) -> str:
    return f"{share * 100:.0f} %"


def advice(cause: str, settings: Settings) -> str:
    """The changes that give GRPO more groups with a signal: a better start (QAD for a quantized one), more
    completions a prompt, more varied completions; for a policy sharpening on noise, smaller steps; for answers that
    collapsed under the overlong punishment, the punishment later."""
    fixes = [f"raise trainer.num_generations (now {settings.num_generations}) or policy.generation.temperature "
             f"(now {settings.temperature})"]
    if settings.quantized:
        fixes.insert(0, "start from a QAD repair of the quantized model (`qarl distill` from the unquantized model, "
                        "then `qarl train` with policy.model_name=<that run>; on SmolLM2 W4A16 "
                        "recipes/qad_smollm2_w4a16_from_base.yaml, then recipes/qad_then_qa_grpo_smollm2.yaml, "
                        "W4A4 their _w4a4 twins)")
    else:
        fixes.append("add a partial-credit reward beside the verifier")
    if cause == "noise":
        fixes.append(f"lower trainer.lr (now {settings.lr:g})")
    if cause == "collapse" and settings.overlong_start_step is not None:
        fixes.append("start the overlong punishment later (trainer.soft_overlong_start_step, now "
                     f"{settings.overlong_start_step})")
    return "; ".join(fixes)


@dataclass(frozen=True)
class Alarm:
    """A fired watch's line, said once its metrics row is written; `stop` ends the run."""

    line: str
    stop: bool

    def sound(self, write: Callable[[str], Any]) -> None:
        from qarl.distributed import is_main_process

        if self.stop:
            raise NoLearningSignal(f"{self.line}. The run stops here (trainer.no_signal_watch=stop; warn lets it go "
                                   "on)")
        if is_main_process():
            write(f"warning: {self.line}. The run goes on (trainer.no_signal_watch=warn; stop ends such a run here)")


class NoSignalWatch:
    """Judges the first `window` steps' rows once, at the window's last step (the row gets the judgement,
    `no_signal/*`), then each later step by the collapse rule; an `Alarm` comes back, once a run, when either finds no
    learning signal (that row records it). A resumed run brings the rows it wrote before (`earlier`)."""

    def __init__(self, window: int, settings: Settings, earlier: Iterable[dict[str, Any]] = ()):
        self.window, self.settings = window, settings
        self.rows = training_rows(earlier)
        self.told = any(r.get("no_signal/fired") for r in self.rows)

    def __call__(self, step: int, row: dict[str, Any]) -> Alarm | None:
        if self.told:
            return None
        self.rows.append(row)
        rows = training_rows(self.rows)
        del self.rows[self.window: -RECENT]  # the window's rows and the last few: all either rule reads
        if step < self.window - 1:
            return None
        if step == self.window - 1:
            judged = read_window(rows[: self.window])
            row.update(judged.metrics())
            if judged.cause is None:
                return None
            line = describe(judged, self.settings)
        else:
            shrink = read_shrink(rows, self.window)
            if shrink is None or not shrink.collapsed:
                return None
            row.update(shrink.metrics())
            line = describe_collapse(shrink, self.settings)
        self.told = True
        return Alarm(line, self.settings.stop)
