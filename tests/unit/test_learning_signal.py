"""The no-signal watch (qarl/learning_signal.py) on the recorded GPU runs, real metrics rows of real runs: it fires on
every SmolLM2 run that never learned (QA-GRPO W4A16 seed 2, every QA-GRPO W4A4 seed: from their first 15 steps; the
two W4A16 runs of the overlong-punishment recipe that never got going: when their answers collapsed), and on none that
learned; then its edge cases on made-up rows, its lines, its record in the row, resuming, and stop against warn."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from qarl.config import ConfigError, NoLearningSignal, check_qad_recipe, load_recipe
from qarl.learning_signal import RECENT, NoSignalWatch, Settings, read_window, training_rows
from qarl.metrics import read_metrics
from tests.conftest import REPO

RESULTS = REPO / "benchmarks" / "results"
SMOLLM2 = sorted((RESULTS / "gpu" / "smollm2").rglob("*.metrics.jsonl"))
OTHER_MODELS = [RESULTS / "gpu" / f"qa_grpo_0p5b_{run}.metrics.jsonl" for run in (
    "bf16", "fp16", "nvfp4_a16_exact_false", *(f"nvfp4_w4a4_exact_{e}_seed{s}" for e in ("false", "true")
                                               for s in range(3)))] + [
    RESULTS / "megatron_tp2_cpu_qa_grpo_tiny.metrics.jsonl", RESULTS / "moe_w4a4_cpu.metrics.jsonl"]
WINDOW = 15
QUANTIZED = Settings(quantized=True, num_generations=8, temperature=1.0, lr=1e-5, stop=False)


COLLAPSED = {"qa_grpo_w4a16_s2": 23, "qa_grpo_w4a16_kv_fp8_s0": 28}  # kv_cache_exact/: the step the watch fires


def never_learned(path: Path) -> bool:
    """The SmolLM2 runs that did not get going (docs/results/smollm2.md): every QA-GRPO W4A4 seed (QAD then QA-GRPO
    W4A4 learned), QA-GRPO W4A16's seed 2 of the sessions in matrix/ and three_seeds/ (on the later recipes, kv_cache/,
    it learned), and on the overlong-punishment recipe W4A16 seed 2 (12.6 %) and with the FP8 cache seed 0 (29.2 %,
    from 8.1: a late start) of kv_cache_exact/."""
    return path.name.startswith("qa_grpo_w4a4") or (
        path.name.startswith("qa_grpo_w4a16_s2") and path.parent.name in ("matrix", "three_seeds")) or (
        path.parent.name == "kv_cache_exact" and path.name.split(".")[0] in COLLAPSED)


def grpo_runs(paths: list[Path]) -> list[Path]:
    return [p for p in paths if len(training_rows(read_metrics(p))) >= WINDOW]


def test_the_evidence_is_all_there():
    runs = grpo_runs(SMOLLM2)
    assert len(runs) == 103 and sum(map(never_learned, runs)) == 11  # 7 W4A4 runs, 4 W4A16
    assert all(p.is_file() for p in OTHER_MODELS)


@pytest.mark.parametrize("path", grpo_runs(SMOLLM2), ids=lambda p: f"{p.parent.name}/{p.name.split('.')[0]}")
def test_fires_on_the_smollm2_runs_that_never_learned_and_on_no_other(path: Path):
    rows = training_rows(read_metrics(path))
    told = [(row["step"], alarm.line) for row, alarm in zip(rows, run_watch(rows)) if alarm]
    if not never_learned(path):
        assert told == []
    elif path.parent.name == "kv_cache_exact":
        assert [step for step, _ in told] == [COLLAPSED[path.name.split(".")[0]]] and "answers shrank" in told[0][1]
    else:
        judged = read_window(rows[:WINDOW])
        assert judged.cause == ("noise" if "w4a16_s2" in path.name else "no_signal"), judged
        assert [step for step, _ in told] == [WINDOW - 1]  # told once: a W4A4 run's answers that collapse later too


@pytest.mark.parametrize("path", OTHER_MODELS, ids=lambda p: p.name.split(".")[0])
def test_runs_of_other_models_and_tasks_that_learned_are_left_alone(path: Path):
    """The embedded 0.5B model (57 % at the start, partial-credit rewards: the reward rises slowly against its
    spread) and the tiny ones, every format: plenty of groups with a signal."""
    judged = read_window(training_rows(read_metrics(path))[:WINDOW])
    assert judged.cause is None and judged.zero_std_share < 0.3, judged


def run_watch(rows: list[dict], settings: Settings = QUANTIZED, window: int = WINDOW, earlier=()) -> list:
    watch = NoSignalWatch(window, settings, earlier)
    return [watch(row["step"], row) for row in rows]


def test_seed_2_is_told_once_at_the_windows_end_with_its_numbers_and_what_to_change():
    rows = read_metrics(RESULTS / "gpu" / "smollm2" / "three_seeds" / "qa_grpo_w4a16_s2.metrics.jsonl")[:20]
    alarms = run_watch(rows)
    assert [i for i, a in enumerate(alarms) if a] == [14]
    line = alarms[14].line
    assert line.startswith("no learning signal in steps 0-14: the policy's entropy fell 22 % (1.89 -> 1.48)"), line
    assert "did not rise (0.0164 -> 0.0156; 87 % of the groups of 8 completions" in line
    assert "sharpening on noise" in line
    assert "qad_then_qa_grpo_smollm2.yaml" in line and "trainer.num_generations (now 8)" in line
    assert "lower trainer.lr (now 1e-05)" in line and "\n" not in line
    assert rows[14]["no_signal/fired"] == 1.0
    assert math.isclose(rows[14]["no_signal/zero_std_share"], 0.873, abs_tol=1e-3)
    assert [r for r in rows if "no_signal/fired" in r] == [rows[14]]  # judged once


def test_a_w4a4_start_is_told_it_has_no_signal():
    rows = read_metrics(RESULTS / "gpu" / "smollm2" / "three_seeds" / "qa_grpo_w4a4_s1.metrics.jsonl")[:WINDOW]
    line = run_watch(rows)[-1].line
    assert "95 % of the groups of 8 completions got one reward for all" in line
    assert "the update had almost nothing to follow" in line and "QAD repair" in line
    assert "trainer.lr" not in line  # a policy that is not sharpening has no step size to blame


def test_a_learning_start_is_recorded_as_judged_and_not_told():
    rows = read_metrics(RESULTS / "gpu" / "smollm2" / "more_seeds" / "qa_grpo_w4a16_s5.metrics.jsonl")[:WINDOW]
    assert run_watch(rows) == [None] * WINDOW
    assert rows[-1]["no_signal/fired"] == 0.0 and rows[-1]["no_signal/reward_gain_sd"] > 0.3


def test_answers_that_collapse_after_the_window_are_told_once_with_what_to_change():
    rows = read_metrics(RESULTS / "gpu" / "smollm2" / "kv_cache_exact" / "qa_grpo_w4a16_s2.metrics.jsonl")
    settings = Settings(quantized=True, num_generations=8, temperature=1.0, lr=1e-5, stop=False, overlong_start_step=0)
    alarms = run_watch(rows, settings)
    assert [i for i, a in enumerate(alarms) if a] == [23]
    assert rows[14]["no_signal/fired"] == 0.0  # the window saw a start with a signal
    line = alarms[23].line
    assert line.startswith("no learning signal at step 23: the answers shrank to 11 tokens (from 92 at the start) "
                           "while 89 % of the groups of 8 completions got one task reward for all"), line
    assert "QAD repair" in line and "trainer.soft_overlong_start_step, now 0" in line and "trainer.lr" not in line
    assert rows[23]["no_signal/fired"] == 1.0 and rows[23]["no_signal/length_ratio"] < 0.12
    assert [r["step"] for r in rows if r.get("no_signal/fired")] == [23]
    assert "soft_overlong_start_step" not in run_watch(rows[:24], QUANTIZED)[23].line  # no punishment, not named


def test_a_run_resumed_past_the_window_still_watches_and_is_told_once():
    path = RESULTS / "gpu" / "smollm2" / "kv_cache_exact" / "qa_grpo_w4a16_kv_fp8_s0.metrics.jsonl"
    rows = read_metrics(path)
    resumed = run_watch([dict(r) for r in rows[20:]], earlier=rows[:20])
    assert [r["step"] for r, a in zip(rows[20:], resumed) if a] == [28]
    told = read_metrics(path)
    run_watch(told[:29])  # the run told at step 28, then stopped and resumed: not told again
    assert run_watch([dict(r) for r in told[29:]], earlier=told[:29]) == [None] * len(told[29:])


def test_the_watch_keeps_the_windows_rows_and_the_last_few():
    watch = NoSignalWatch(WINDOW, QUANTIZED)
    rows = read_metrics(RESULTS / "gpu" / "smollm2" / "seeds_2026-12-06" / "qa_grpo_w4a16_s3.metrics.jsonl")
    assert [watch(r["step"], r) for r in training_rows(rows)] == [None] * 60
    assert len(watch.rows) == WINDOW + RECENT


def step_rows(rewards: list[float], zero_std: float = 1.0, entropy: float | None = 2.0, spread: float = 0.0) -> list:
    return [{"step": s, "reward/mean": r, "reward/std": spread, "reward/frac_zero_std": zero_std, "entropy": entropy}
            for s, r in enumerate(rewards)]


def test_all_rewards_zero_from_the_start():
    rows = step_rows([0.0] * 6)
    alarms = run_watch(rows, window=6)
    assert alarms[-1] and alarms[-1].line.startswith("no learning signal in steps 0-5: 100 % of the groups")
    assert rows[-1]["no_signal/reward_gain_sd"] == 0.0  # no spread to divide by, no rise


def test_a_flat_start_whose_reward_then_rises_is_a_rise():
    window = read_window(step_rows([0.0, 0.0, 0.2, 0.3], zero_std=0.85, spread=0.0))
    assert window.reward_gain_sd == math.inf and window.cause is None


def test_steps_that_trained_nothing_have_no_entropy_and_are_skipped():
    rows = step_rows([0.1] * 6, zero_std=0.85, spread=0.3)
    rows[0]["entropy"] = rows[5]["entropy"] = None
    rows[1]["entropy"], rows[4]["entropy"] = 2.0, 1.0
    window = read_window(rows)
    assert (window.entropy_start, window.entropy_end) == (2.0, 1.0) and window.cause == "noise"
    assert read_window(step_rows([0.1] * 3, zero_std=0.85, entropy=None)).entropy_drop == 0.0


def test_a_run_shorter_than_the_window_and_steps_after_it_are_not_judged():
    rows = step_rows([0.0] * 8)
    assert run_watch(rows[:4], window=6) == [None] * 4 and "no_signal/fired" not in rows[3]
    assert run_watch(rows, window=6)[6:] == [None, None] and "no_signal/fired" not in rows[7]


def test_a_run_resumed_inside_the_window_judges_the_rows_it_wrote_before():
    rows = read_metrics(RESULTS / "gpu" / "smollm2" / "three_seeds" / "qa_grpo_w4a16_s2.metrics.jsonl")
    earlier, after = rows[:9], [dict(r) for r in rows[9:WINDOW]]
    resumed = run_watch(after, earlier=earlier + [{"step": 60, "eval/accuracy": 0.05}])  # a final eval row is skipped
    uninterrupted = run_watch(rows[:WINDOW])
    assert resumed[-1].line == uninterrupted[-1].line


def test_an_unquantized_run_is_not_sent_to_qad():
    settings = Settings(quantized=False, num_generations=4, temperature=0.7, lr=3e-6, stop=False)
    line = run_watch(step_rows([0.0] * 3), settings, window=3)[-1].line
    assert "QAD" not in line and "partial-credit reward" in line and "temperature (now 0.7)" in line


def test_warn_says_one_line_and_stop_ends_the_run_with_the_same_line():
    said: list[str] = []
    alarm = run_watch(step_rows([0.0] * 3), window=3)[-1]
    alarm.sound(said.append)
    assert len(said) == 1 and said[0].startswith("warning: no learning signal")
    assert "The run goes on (trainer.no_signal_watch=warn" in said[0]
    stopping = run_watch(step_rows([0.0] * 3), Settings(True, 8, 1.0, 1e-5, stop=True), window=3)[-1]
    with pytest.raises(NoLearningSignal, match=r"^no learning signal in steps 0-2: .* The run stops here"):
        stopping.sound(said.append)
    assert len(said) == 1


def test_the_watchs_settings_are_checked_as_the_recipe_loads():
    with pytest.raises(ConfigError, match="no_signal_watch"):
        load_recipe("recipes/qa_grpo_tiny.yaml", ["trainer.no_signal_watch=loud"])
    with pytest.raises(ConfigError, match="no_signal_window"):
        load_recipe("recipes/qa_grpo_tiny.yaml", ["trainer.no_signal_window=2"])
    with pytest.raises(ConfigError, match="QAD learns from its teacher's KL at every token"):
        check_qad_recipe(load_recipe("recipes/qa_distillation_tiny.yaml", ["trainer.no_signal_watch=stop"]))
