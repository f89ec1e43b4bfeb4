"""`qarl matrix`: the table's arithmetic (accuracy, gain, survival and their standard errors, the shares of GRPO's gain)
against direct computation, its paired tests against known values (McNemar by hand, exact sign-flip distributions
by enumeration, the bootstrap against the normal approximation), and the CLI's refusal of bad settings (exit code 2).
On real models: tests/integration/test_matrix.py."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from qarl.evaluate import EvalResult
from qarl.matrix import bootstrap_interval, gain, mean_and_se, paired_test, per_prompt, sign_flip_p, survival


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


def test_mcnemar_on_one_seed_a_row_matches_the_binomial_by_hand():
    """12 prompts only row a gets right, 3 only row b, 85 both or neither: the exact McNemar p is
    2 P(X <= 3), X ~ Bin(15, 1/2) = 2 (1 + 15 + 105 + 455) / 2^15; the mid-p counts P(X = 3) once."""
    a = [1.0] * 12 + [0.0] * 3 + [1.0] * 40 + [0.0] * 45
    b = [0.0] * 12 + [1.0] * 3 + [1.0] * 40 + [0.0] * 45
    test = paired_test(a, b, 1, 1)
    assert test["p_exact"] == pytest.approx(2 * 576 / 2**15) and test["p"] == pytest.approx((2 * 121 + 455) / 2**15)
    assert test["difference"] == pytest.approx(0.09) and test["test"] == "mcnemar"
    try:
        from scipy.stats import binomtest
    except ImportError:
        return
    assert test["p_exact"] == pytest.approx(binomtest(3, 15).pvalue)
    assert paired_test(b, a, 1, 1)["p"] == test["p"]  # two-sided


def test_the_sign_flip_test_of_seed_means_is_exact():
    """Seeds pooled per prompt (6 and 3 seeds: differences in sixths): the p-values equal the share of all 2^12 sign
    assignments whose sum is at least as far from 0 as the observed one (mid-p: ties counted half)."""
    rng = random.Random(2)
    a = [rng.randrange(7) / 6 for _ in range(12)]
    b = [rng.randrange(4) / 3 for _ in range(12)]
    integers = [round(6 * (x - y)) for x, y in zip(a, b)]
    observed = abs(sum(integers))
    sums = [sum(s * d for s, d in zip(signs, integers)) for signs in itertools.product((1, -1), repeat=12)]
    above, at = sum(x > observed for x in sums) / 2**12, sum(x == observed for x in sums) / 2**12
    test = paired_test(a, b, 6, 3)
    assert test["p_exact"] == pytest.approx(min(1.0, 2 * (above + at)))
    assert test["p"] == pytest.approx(min(1.0, 2 * (above + at / 2))) and test["test"] == "sign-flip"
    assert sign_flip_p([0, 0, 0]) == (1.0, 1.0)  # no discordant prompt: nothing against the null


def test_the_paired_bootstrap_interval():
    """Identical rows: [0, 0]. On 1,000 prompts the percentile interval is close to mean +- 1.96 paired SE (the
    normal approximation), the same on every call (seeded), and as wide as resampling the prompts themselves."""
    assert paired_test([1.0, 0.0, 1.0], [1.0, 0.0, 1.0], 1, 1)["ci95"] == [0.0, 0.0]
    rng = random.Random(0)
    a = [float(rng.random() < 0.6) for _ in range(1000)]
    b = [float(rng.random() < 0.5) for _ in range(1000)]
    d = [x - y for x, y in zip(a, b)]
    mean, se = mean_and_se(d)
    low, high = bootstrap_interval(d)
    assert low == pytest.approx(mean - 1.96 * se, abs=0.004) and high == pytest.approx(mean + 1.96 * se, abs=0.004)
    assert bootstrap_interval(d) == (low, high)
    means = sorted(sum(rng.choice(d) for _ in range(1000)) / 1000 for _ in range(2000))  # prompts resampled
    assert means[50] == pytest.approx(low, abs=0.006) and means[1949] == pytest.approx(high, abs=0.006)


def test_shares_and_paired_comparisons_in_the_report():
    """The share of GRPO's gain has one definition: (accuracy - the base's unquantized) / (GRPO's unquantized - the
    base's unquantized). The PTQ-relative figure (gain over the base at the same precision, for the trained column
    over the base's PTQ in its format) is kept under its own name. Every pair of cells gets a paired test."""
    from pathlib import Path

    from qarl.matrix import FULL, TRAINED, ModelSource, Plan, Precision, markdown, summarize
    from qarl.quant import resolve_format

    w4a16 = resolve_format("quant_configs/nvfp4_a16.yaml")
    ckpt = Path("run/checkpoints/step_1")
    models = {"base": [ModelSource("base", "base")],
              "grpo": [ModelSource("grpo", "g", ckpt)],
              "qa_grpo": [ModelSource("qa", "q", ckpt, w4a16)]}
    plan = Plan(None, {"test": [None] * 4}, None, [], models, [Precision(FULL), Precision("nvfp4_a16 max", w4a16),
                                                                 Precision(TRAINED, trained=True)],
                {"qa_grpo": "nvfp4_a16 max"})
    test = {"base": {FULL: [_result([1, 0, 0, 0])], "nvfp4_a16 max": [_result([0, 0, 0, 0])]},
            "grpo": {FULL: [_result([1, 1, 1, 0])], "nvfp4_a16 max": [_result([1, 1, 0, 0])]},
            "qa_grpo": {FULL: [_result([1, 1, 0, 0])], TRAINED: [_result([1, 1, 1, 0])]}}
    report = summarize(plan, {"test": test})
    split = report["splits"]["test"]
    assert report["reference"] == "grpo" and split["num_prompts"] == 4  # grpo: +0.5 over the base's 0.25
    assert split["share"]["grpo"] == pytest.approx({FULL: 1.0, "nvfp4_a16 max": 0.5})
    assert split["share"]["qa_grpo"] == pytest.approx({FULL: 0.5, TRAINED: 1.0})
    assert split["share"]["base"] == pytest.approx({FULL: 0.0, "nvfp4_a16 max": -0.5})
    assert split["ptq_relative_share"]["qa_grpo"] == pytest.approx({FULL: 0.5, TRAINED: 1.5})  # 0.75 over 0 PTQ
    assert split["ptq_relative_share"]["grpo"] == pytest.approx({FULL: 1.0, "nvfp4_a16 max": 1.0})
    pairs = {(tuple(c["a"]), tuple(c["b"])): c for c in split["paired"]}
    assert len(pairs) == 15  # 6 cells
    qat_vs_ptq = pairs[("qa_grpo", TRAINED), ("grpo", "nvfp4_a16 max")]  # one prompt only qa_grpo gets right
    assert qat_vs_ptq["difference"] == pytest.approx(0.25) and qat_vs_ptq["same_format"]
    assert (qat_vs_ptq["p_exact"], qat_vs_ptq["p"]) == pytest.approx((1.0, 0.5))
    assert not pairs[("qa_grpo", TRAINED), ("grpo", FULL)]["same_format"]
    text = markdown(report)
    assert "Share of grpo's gain" in text and "PTQ-relative share" in text and "150 %" in text
    assert "| qa_grpo, trained | grpo, nvfp4_a16 max | +25.0 |" in text
    assert "| qa_grpo, trained | grpo, full |" not in text  # other formats, not against the base: matrix.json only
    assert "exports' kernels" not in text  # no exported column
    report["served_kernels"] = {"exported nvfp4_w4a4_compressed_tensors": {"EmulationNvFp4LinearKernel": 630}}
    assert "- exported nvfp4_w4a4_compressed_tensors: EmulationNvFp4LinearKernel (630)" in markdown(report)
    # two unquantized rows: no single reference, no share tables; a transfer split gets its own section
    plan.models["grpo_2"] = [ModelSource("g2", "g2", ckpt)]
    report = summarize(plan, {"test": {**test, "grpo_2": test["grpo"]}, "transfer": {**test, "grpo_2": test["grpo"]}})
    assert report["reference"] is None and report["splits"]["transfer"]["share"] == {}
    text = markdown(report)
    assert "Share of" not in text and "## The transfer split (4 prompts)" in text
