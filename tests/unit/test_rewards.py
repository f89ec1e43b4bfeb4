"""Reward functions, their registry, and what happens when one misbehaves."""

from __future__ import annotations

import pytest

from qarl.config import ConfigError, RewardSpec
from qarl.rewards import RewardError, WeightedRewards, resolve_reward


def test_builtin_verifiers():
    assert resolve_reward("arithmetic")(["82", " 82 ", "8", "82x"], ["82"] * 4) == [1.0, 1.0, 0.0, 0.0]
    assert resolve_reward("format")(["82", "-3", "8 2", ""], [""] * 4) == [1.0, 1.0, 0.0, 0.0]
    boxed = resolve_reward("boxed_math")
    assert boxed(["so \\boxed{1,000}.", "\\boxed{\\frac{1}{2}}", "\\boxed{3} then \\boxed{4}", "4"], ["1000", "\\frac{1}{2}", "4", "4"]) == [1.0, 1.0, 1.0, 0.0]
    # a MATH-style reference is the whole solution: its last \boxed{} is the answer
    assert boxed(["\\boxed{68}", "\\boxed{67}"], ["$23 + 45 = \\boxed{68}$"] * 2) == [1.0, 0.0]
    gsm = resolve_reward("gsm8k")
    assert gsm(["... #### 72", "#### 7.0", "72"], ["She sold 72 clips.\n#### 72", "7", "72"]) == [1.0, 1.0, 0.0]


def test_dotted_path_and_weights():
    rewards = WeightedRewards.from_specs([RewardSpec("arithmetic", 1.0), RewardSpec("qarl.rewards:format_reward", 0.5)])
    total, parts = rewards(["12", "ab"], ["12", "12"])
    assert total == [1.5, 0.0]
    assert parts == {"reward/arithmetic": 0.5, "reward/qarl.rewards:format_reward": 0.5}


@pytest.mark.parametrize("name", ["nonexistent", "qarl.rewards:nope", "no_such_module.fn"])
def test_unknown_reward_is_a_clear_error(name):
    with pytest.raises(ConfigError, match="reward"):
        WeightedRewards.from_specs([RewardSpec(name)])


def flaky(completions, answers):
    if "boom" in completions:
        raise ValueError("cannot parse")
    return [1.0] * len(completions)


def short(completions, answers):
    return [1.0]


def test_reward_that_raises_errors_by_default_and_scores_zero_if_asked():
    strict = WeightedRewards.from_specs([RewardSpec("tests.unit.test_rewards:flaky")])
    with pytest.raises(RewardError, match="flaky.*cannot parse.*reward_error=zero"):
        strict(["1", "boom"], ["1", "1"])
    lenient = WeightedRewards.from_specs([RewardSpec("tests.unit.test_rewards:flaky")], on_error="zero")
    assert lenient(["1", "boom", "2"], ["1", "1", "1"])[0] == [1.0, 0.0, 1.0]  # only the bad sample gets 0


def test_reward_of_wrong_length_is_an_error():
    with pytest.raises(RewardError, match="returned 1 values for 2 completions"):
        WeightedRewards.from_specs([RewardSpec("tests.unit.test_rewards:short")])(["1", "2"], ["1", "2"])
