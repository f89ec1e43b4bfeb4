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


def strings(completions, answers):
    return ["1"] * len(completions)


def nan_for_empty(completions, answers):
    return [float("nan") if not c else 1.0 for c in completions]


def one_argument(completions):
    return [1.0] * len(completions)


def test_a_reward_returning_strings_is_refused_not_converted():
    for on_error in ("raise", "zero"):  # not a sample the function fails on: the function is wrong
        rewards = WeightedRewards.from_specs([RewardSpec("tests.unit.test_rewards:strings")], on_error=on_error)
        with pytest.raises(RewardError, match=r"returned str values \('1' for completion 0\)"):
            rewards(["1"], ["1"])


def test_a_non_finite_reward_stops_the_run_naming_the_reward_or_scores_zero_if_asked():
    strict = WeightedRewards.from_specs([RewardSpec("tests.unit.test_rewards:nan_for_empty")])
    with pytest.raises(RewardError, match=r"reward 'tests.unit.test_rewards:nan_for_empty' returned nan for "
                                          r"completion 1 \(''\)"):
        strict(["1", ""], ["1", "1"])
    lenient = WeightedRewards.from_specs([RewardSpec("tests.unit.test_rewards:nan_for_empty")], on_error="zero")
    assert lenient(["1", ""], ["1", "1"])[0] == [1.0, 0.0]


@pytest.mark.parametrize("name, message", [
    ("tests.unit.test_rewards:one_argument", r"takes \(completions\); a reward takes \(completions, answers\)"),
    ("tests.unit.test_rewards:strings", r"returned str values .*called on a sample before the run: completions "
                                        r"\['21', ''\]"),
    ("tests.unit.test_rewards:nan_for_empty", r"returned nan for completion 1"),
    ("tests.unit.test_rewards:flaky", None),  # a sample it handles: nothing to say
])
def test_each_reward_is_called_once_on_a_sample_before_the_run(name, message):
    rewards = WeightedRewards.from_specs([RewardSpec("arithmetic"), RewardSpec(name)])
    if message is None:
        rewards.check_on_sample("21")
        return
    with pytest.raises(ConfigError, match=message):
        rewards.check_on_sample("21")


def test_a_reward_raising_on_the_sample_is_refused_unless_scored_zero():
    def keyed(completions, answers):
        return [{"21": 1.0}[c] for c in completions]

    rewards = WeightedRewards([("keyed", keyed, 1.0)])
    with pytest.raises(ConfigError, match=r"reward 'keyed' raised KeyError: ''"):
        rewards.check_on_sample("21")
    WeightedRewards([("keyed", keyed, 1.0)], on_error="zero").check_on_sample("21")
