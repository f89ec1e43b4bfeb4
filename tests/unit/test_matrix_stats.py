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


def test_share_of_the_unquantized_rl_gain():
    """The one trained row that is not quantized (GRPO in bf16) is the reference: every cell's gain over it."""
    from pathlib import Path

    from qarl.matrix import FULL, TRAINED, ModelSource, Plan, Precision, markdown, summarize
    from qarl.quant import resolve_format

    w4a16 = resolve_format("quant_configs/nvfp4_a16.yaml")
    ckpt = Path("run/checkpoints/step_1")
    models = {"base": [ModelSource("base", "base")],
              "grpo": [ModelSource("grpo", "g", ckpt)],
              "qa_grpo": [ModelSource("qa", "q", ckpt, w4a16)]}
    plan = Plan(None, [None] * 4, None, [], models, [Precision(FULL), Precision("nvfp4_a16 max", w4a16),
                                                     Precision(TRAINED, trained=True)],
                {"qa_grpo": "nvfp4_a16 max"})
    results = {"base": {FULL: [_result([1, 0, 0, 0])], "nvfp4_a16 max": [_result([0, 0, 0, 0])]},
               "grpo": {FULL: [_result([1, 1, 1, 0])], "nvfp4_a16 max": [_result([1, 1, 0, 0])]},
               "qa_grpo": {FULL: [_result([1, 1, 0, 0])], TRAINED: [_result([1, 1, 1, 0])]}}
    report = summarize(plan, results)
    assert report["reference"] == "grpo"  # gain 0.5 at full precision
    assert report["share"]["grpo"] == pytest.approx({FULL: 1.0, "nvfp4_a16 max": 1.0})
    assert report["share"]["qa_grpo"] == pytest.approx({FULL: 0.5, TRAINED: 1.5})  # 0.75 over the base's W4A16 PTQ
    assert "Share of grpo's unquantized gain kept" in markdown(report) and "150 %" in markdown(report)
    # two unquantized rows: no single reference, no share table
    plan.models["grpo_2"] = [ModelSource("g2", "g2", ckpt)]
    report = summarize(plan, {**results, "grpo_2": results["grpo"]})
    assert report["reference"] is None and "Share of" not in markdown(report)
