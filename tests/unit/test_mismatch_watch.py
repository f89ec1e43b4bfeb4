"""`MismatchWatch`: a run whose train and rollout log-probs must be equal (the exact forward) says so on the
terminal at the first step where they are not, once; other runs, whose mismatch is expected, say nothing."""

from __future__ import annotations

from qarl.metrics import MismatchWatch


def _rows(*diffs: float | None) -> list[dict]:
    return [{"step": step, "mismatch/max_abs_logprob_diff": diff, "mismatch/kl": diff and diff / 10}
            for step, diff in enumerate(diffs)]


def test_the_first_step_that_breaks_the_exact_forwards_promise_is_said_once():
    said: list[str] = []
    watch = MismatchWatch(expect_zero=True)
    for row in _rows(0.0, None, 0.0, 0.25, 0.5, 0.0):
        watch(row["step"], row, said.append)
    assert len(said) == 1
    assert "policy.exact_forward: at step 3" in said[0] and "0.25" in said[0] and "KV cache" in said[0]


def test_runs_whose_mismatch_is_expected_or_zero_say_nothing():
    said: list[str] = []
    for expect_zero, rows in ((False, _rows(0.0, 0.3, 1.2)), (True, _rows(0.0, None, 0.0))):
        watch = MismatchWatch(expect_zero=expect_zero)
        for row in rows:
            watch(row["step"], row, said.append)
    assert said == []
