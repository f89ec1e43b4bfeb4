"""QA-GRPO's own end-to-end checks (real vLLM, real ModelOpt, in subprocesses): a reward that raises stops the run
and keeps its checkpoints, Ctrl-C stops it with one line naming the command that resumes it, `qarl eval` of a
run reports what the run evaluated, and a resume past a damaged newest checkpoint continues from the one before
it. What GRPO shares with QAD (a few
steps, exact resume after SIGKILL): tests/e2e/test_loops.py; its input checks: tests/unit/test_loop_checks.py."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from qarl.checkpoint import complete_checkpoints, load_policy_checkpoint
from qarl.config import PolicyConfig
from qarl.metrics import read_metrics
from qarl.run_dir import checkpoint_damage, checkpoint_run_id, read_identity
from tests.loops import GRPO, deterministic, kill_after_first_checkpoint


def test_a_reward_that_raises_stops_the_run_and_keeps_its_checkpoints(tmp_path):
    run_dir = tmp_path / "raises"
    env = {**os.environ, "QARL_TEST_RAISE_AFTER_CALLS": "4"}  # the first call: the sample before the model loads
    proc = subprocess.run(GRPO.command(run_dir, "trainer.rewards=[{name: tests.rewards_for_tests:raises_later}]"),
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    assert "raises_later" in proc.stderr and "reward_error=zero" in proc.stderr
    assert [c.name for c in complete_checkpoints(run_dir)] == ["step_2"]
    load_policy_checkpoint(run_dir, PolicyConfig())  # intact and loadable


def test_a_start_with_no_learning_signal_is_told_and_stopped(tmp_path):
    """trainer.no_signal_watch=stop on a run whose every reward is 0: the window's last row records the judgement, and
    the run ends there with one line that says what it saw and what to change (qarl/learning_signal.py)."""
    run_dir = tmp_path / "no_signal"
    proc = subprocess.run(GRPO.command(run_dir, "trainer.rewards=[{name: tests.rewards_for_tests:always_zero}]",
                                       "trainer.no_signal_watch=stop", "trainer.no_signal_window=3"),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("qarl: error: no learning signal in steps 0-2: 100 % of the groups of 4 completions"), last
    assert "QAD repair" in last and "trainer.no_signal_watch=stop" in last
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[-1]["no_signal/fired"] == 1.0
    assert rows[-1]["no_signal/zero_std_share"] == 1.0


def test_ctrl_c_stops_with_one_line_naming_the_resume_command(tmp_path):
    run_dir = tmp_path / "interrupted"
    with open(tmp_path / "stderr", "w+") as stderr:
        code = kill_after_first_checkpoint(GRPO.command(run_dir, "trainer.steps=40"), run_dir, signal.SIGINT, stderr)
        stderr.seek(0)
        printed = stderr.read()
    last = printed.strip().splitlines()[-1]
    assert code == 130 and "Traceback" not in printed, printed[-3000:]
    assert last.startswith("qarl: error: interrupted (Ctrl-C); the last complete checkpoint is step_"), last
    resume = shlex.split(last.split("`")[1])
    assert resume[:3] == ["qarl", "train", GRPO.recipe] and f"run.dir={run_dir}" in resume
    assert resume[-1] == "trainer.resume=true" and "trainer.steps=40" in resume
    subprocess.run([sys.executable, "-m", "qarl", "config", *resume[2:]], check=True, capture_output=True)  # it loads


def test_eval_reports_quantized_and_unquantized_accuracy(loop_runs):
    uninterrupted = loop_runs.uninterrupted(GRPO)
    out = subprocess.run([sys.executable, "-m", "qarl", "eval", str(uninterrupted)], check=True, capture_output=True,
                         text=True, timeout=600).stdout
    result = json.loads(out)
    assert result["format"] == "nvfp4_a16" and result["num_prompts"] == 16
    assert 0.0 <= result["quantized"] <= 1.0 and 0.0 <= result["unquantized"] <= 1.0
    final = read_metrics(uninterrupted / "metrics.jsonl")[-1]
    assert result["quantized"] == final["eval/accuracy"]  # the same greedy evaluation as the training run's
    assert result["checkpoint"] == str(uninterrupted / "checkpoints" / "step_4") and result["step"] == 4
    assert result["run_id"] == read_identity(uninterrupted)["run_id"]


def test_a_second_run_into_a_finished_runs_directory_loses_nothing(loop_runs):
    """The newcomer's data loss: a second run into the directory of a finished one is refused before anything
    loads, and the first run's config, metrics and checkpoints are as they were."""
    run_dir = loop_runs.uninterrupted(GRPO)
    files = ["config.yaml", "metrics.jsonl", *(f"checkpoints/{c.name}/COMPLETE" for c in complete_checkpoints(run_dir))]
    before = {f: (run_dir / f).read_bytes() for f in files}
    proc = subprocess.run(GRPO.command(run_dir, "trainer.steps=2"), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2 and "holds another run" in proc.stderr
    assert {f: (run_dir / f).read_bytes() for f in files} == before
    run_id = read_identity(run_dir)["run_id"]
    assert all(checkpoint_run_id(c) == run_id for c in complete_checkpoints(run_dir))


def test_a_resume_past_a_damaged_newest_checkpoint_continues_from_the_one_before(loop_runs, tmp_path):
    """The newest checkpoint's model.safetensors cut short under its COMPLETE marker (a full disk, a partial copy):
    the resume names it once, continues from step_2, and reproduces the uninterrupted run (once a raw SafetensorError
    after "resuming from step 4")."""
    uninterrupted = loop_runs.uninterrupted(GRPO)
    run_dir = Path(shutil.copytree(uninterrupted, tmp_path / "run"))
    model = run_dir / "checkpoints" / "step_4" / "policy" / "model.safetensors"
    size = model.stat().st_size
    with model.open("r+b") as f:
        f.truncate(size // 2)
    proc = subprocess.run(GRPO.command(run_dir, "trainer.resume=true"), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("step_4 (policy/model.safetensors") == 1
    line = next(line for line in proc.stdout.splitlines() if line.startswith("resuming from step"))
    assert line.startswith(f"resuming from step 2 ({run_dir}/checkpoints/step_2)"), line
    assert line.endswith(f"; skipped the newer damaged checkpoint(s): {run_dir}/checkpoints/step_4 "
                         f"(policy/model.safetensors is {size // 2:,} bytes, not {size:,})"), line
    assert deterministic(read_metrics(run_dir / "metrics.jsonl")) == deterministic(
        read_metrics(uninterrupted / "metrics.jsonl"))
    assert checkpoint_damage(run_dir / "checkpoints" / "step_4") is None  # written again
