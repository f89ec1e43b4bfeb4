"""`qarl matrix`: the table's arithmetic (accuracy, gain, survival and their standard errors) against direct
computation, and the CLI's refusal of bad settings (exit code 2). On real models: tests/integration/test_matrix.py."""

from __future__ import annotations

import math
import random

import pytest

from qarl.evaluate import EvalResult
from qarl.matrix import gain, mean_and_se, per_prompt, survival


def _result(correct: list[float]) -> EvalResult:
    return EvalResult(correct=correct, parsed=[True] * len(correct), finish_reasons=["stop"] * len(correct),
                      lengths=[6] * len(correct))


def test_statistics_match_direct_computation():
    rng = random.Random(0)
    n = 1000
    base_f, base_q, model_f, model_q = ([float(rng.random() < p) for _ in range(n)] for p in (0.3, 0.25, 0.6, 0.55))
    p = sum(model_f) / n
    mean, se = mean_and_se(model_f)
    assert mean == pytest.approx(p) and se == pytest.approx(math.sqrt(p * (1 - p) / n))  # binomial SE
    assert se <= 0.016  # n = 1000: at most 1.6 points, the bound

    d = [m - b for m, b in zip(model_f, base_f)]
    d_mean = sum(d) / n
    g, g_se = gain(model_f, base_f)
    assert g == pytest.approx(sum(model_f) / n - sum(base_f) / n)
    assert g_se == pytest.approx(math.sqrt(sum((x - d_mean) ** 2 for x in d) / n) / math.sqrt(n))

    s, s_se = survival(model_q, base_q, model_f, base_f)
    direct = (sum(model_q) - sum(base_q)) / n - (sum(model_f) - sum(base_f)) / n
    assert s == pytest.approx(direct)
    e = [mq - bq - mf + bf for mq, bq, mf, bf in zip(model_q, base_q, model_f, base_f)]
    e_mean = sum(e) / n
    assert s_se == pytest.approx(math.sqrt(sum((x - e_mean) ** 2 for x in e) / n / n))

    # seeds are averaged prompt by prompt
    assert per_prompt([_result([1, 0, 1, 0]), _result([1, 1, 0, 0])]) == [1.0, 0.5, 0.5, 0.0]
    with pytest.raises(ValueError):
        mean_and_se([])


def test_cli_refuses_bad_settings_with_exit_code_2(capsys, tmp_path):
    from qarl.cli import main

    assert main(["matrix", "recipes/matrix_tiny.yaml", "matrix.ptq_methods=[gptq]"]) == 2
    assert "matrix.ptq_methods ['gptq']: choose among" in capsys.readouterr().err
    assert main(["diagnose", "qarl/recipe_defaults.yaml", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err
