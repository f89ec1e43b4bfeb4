"""Checkpoints carry a manifest of their files (size and sha256, qarl/run_dir.py), written by the real save path
(`save_checkpoint`, real safetensors of the tiny policy) before COMPLETE; a damaged newest checkpoint is named and
skipped for the one before it, by a resume, by `qarl eval`'s lookup and by pruning. The end-to-end resume past a
truncated checkpoint is in tests/e2e/test_train.py.

A checkpoint is damaged here in a copy of its run directory: a process remembers the hashes of what it wrote (so
pruning does not read a checkpoint again), and the damage these tests make is found by the next process, as a
user's would be."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from qarl.checkpoint import load_policy_checkpoint, save_checkpoint
from qarl.config import ConfigError, PolicyConfig, RecipeConfig, load_recipe
from qarl.run import pinned_start
from qarl.run_dir import (MANIFEST, RunDirPlan, checkpoint_damage, checkpoint_step, claim_run_dir, latest_checkpoint,
                          plan_run_dir, resolve_checkpoint)
from tests.conftest import REPO, W4A16, tiny_policy

MODEL = "policy/model.safetensors"
TINY = REPO / "recipes" / "qa_grpo_tiny.yaml"


@pytest.fixture(scope="module")
def saved(task, tiny_dir, tmp_path_factory) -> Path:
    """A run directory with checkpoints step_2 and step_4 of a quantized tiny policy."""
    policy = tiny_policy(task, tiny_dir, W4A16, calib_size=8)
    run_dir = tmp_path_factory.mktemp("manifest") / "run"
    for step in (2, 4):
        save_checkpoint(run_dir, step, policy, {"step": step, "processes": 1}, keep=3)
    return run_dir


@pytest.fixture
def run_dir(saved, tmp_path) -> Path:
    return Path(shutil.copytree(saved, tmp_path / "run"))


def truncate(path: Path) -> int:
    size = path.stat().st_size
    with path.open("r+b") as f:
        f.truncate(size // 2)
    return size


def test_every_file_is_in_the_manifest_with_its_size_and_sha256(saved):
    step = saved / "checkpoints" / "step_4"
    files = json.loads((step / MANIFEST).read_text())["files"]
    on_disk = {p.relative_to(step).as_posix() for p in step.rglob("*") if p.is_file()}
    assert set(files) == on_disk - {MANIFEST, "COMPLETE"}
    assert {MODEL, "quantizer_state.safetensors", "trainer_state.pt", "run.json"} <= set(files)
    model = step / MODEL
    assert files[MODEL] == {"bytes": model.stat().st_size, "sha256": hashlib.sha256(model.read_bytes()).hexdigest()}
    assert checkpoint_damage(step) is None


def test_a_truncated_newest_checkpoint_is_named_and_the_one_before_it_resumed(run_dir, capsys):
    size = truncate(run_dir / "checkpoints" / "step_4" / MODEL)
    plan = plan_run_dir(run_dir, "true", False)  # as the command starts: sizes only
    assert plan.checkpoint == run_dir / "checkpoints" / "step_2" and plan.resume_step == 2
    claim_run_dir(plan, {}, "run: {}\n")
    out = capsys.readouterr().out
    assert out.count("step_4") == 1 and "resuming from step 2" in out
    assert f"skipped the newer damaged checkpoint(s): {run_dir}/checkpoints/step_4 ({MODEL} is {size // 2:,} bytes, " \
           f"not {size:,})" in out


def test_a_same_size_change_is_found_by_its_hash_where_the_checkpoint_loads(run_dir):
    state = run_dir / "checkpoints" / "step_4" / "trainer_state.pt"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF
    state.write_bytes(bytes(data))
    assert plan_run_dir(run_dir, "true", False).resume_step == 4, "the command's sizes cannot tell"
    plan = plan_run_dir(run_dir, "true", False, hashes=True)  # as the run starts (qarl/run.py start_run)
    assert plan.resume_step == 2
    assert plan.damaged == (f"{run_dir}/checkpoints/step_4 (trainer_state.pt: content differs from the manifest's "
                            "sha256)",)


def test_eval_and_export_use_the_newest_intact_checkpoint_and_refuse_a_damaged_one_named(run_dir, capsys):
    truncate(run_dir / "checkpoints" / "step_4" / "quantizer_state.safetensors")
    assert resolve_checkpoint(run_dir) == latest_checkpoint(run_dir) == run_dir / "checkpoints" / "step_2"
    assert "skipped the newer damaged checkpoint(s)" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="step_4 is damaged .*quantizer_state.safetensors is .* give an earlier"):
        resolve_checkpoint(run_dir / "checkpoints" / "step_4")
    policy = load_policy_checkpoint(run_dir, PolicyConfig(quant_cfg=W4A16))
    assert torch.isfinite(next(policy.model.parameters())).all()


def test_when_every_checkpoint_is_damaged_the_error_is_one_line(run_dir):
    for step in (2, 4):
        (run_dir / "checkpoints" / f"step_{step}" / "trainer_state.pt").unlink()
    with pytest.raises(ConfigError, match=r"every checkpoint is damaged .*step_4 \(trainer_state.pt is missing\); "
                                          r".*step_2 .*run.overwrite=true") as e:
        plan_run_dir(run_dir, "auto", False)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="every checkpoint of .* is damaged"):
        latest_checkpoint(run_dir)


def test_a_checkpoint_written_before_manifests_is_accepted_as_before(run_dir):
    for step in (2, 4):
        (run_dir / "checkpoints" / f"step_{step}" / MANIFEST).unlink()
    truncate(run_dir / "checkpoints" / "step_4" / MODEL)  # nothing to tell it by: its COMPLETE marker is all there is
    assert plan_run_dir(run_dir, "true", False, hashes=True).resume_step == 4


def test_pruning_never_deletes_the_last_intact_checkpoint_for_a_damaged_one(run_dir, task, tiny_dir):
    truncate(run_dir / "checkpoints" / "step_4" / MODEL)
    policy = tiny_policy(task, tiny_dir, W4A16, calib_size=8)
    save_checkpoint(run_dir, 6, policy, {"step": 6, "processes": 1}, keep=2)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_2", "step_4", "step_6"]
    save_checkpoint(run_dir, 8, policy, {"step": 8, "processes": 1}, keep=2)  # two intact ones newer than step_4
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_6", "step_8"]


def test_a_damaged_run_file_in_the_newest_checkpoint_is_skipped_not_a_traceback(run_dir, capsys):
    (run_dir / "qarl_run.json").write_text(json.dumps({"run_id": "r1"}))
    (run_dir / "checkpoints" / "step_4" / "run.json").write_text('{"run_')  # cut short
    plan = plan_run_dir(run_dir, "true", False, hashes=True)
    assert plan.checkpoint == run_dir / "checkpoints" / "step_2" and "step_4" in plan.damaged[0]


def test_a_damaged_identity_file_is_one_error_naming_it(run_dir):
    (run_dir / "qarl_run.json").write_bytes(b'{"run_id": "r')
    with pytest.raises(ConfigError, match="qarl_run.json is damaged .*restore it, or start the run again"):
        plan_run_dir(run_dir, "true", False)


def test_an_emptied_complete_marker_gives_no_step_not_a_traceback(run_dir, tmp_path):
    copy = Path(shutil.copytree(run_dir / "checkpoints" / "step_4", tmp_path / "mine"))
    (copy / "COMPLETE").write_text("")
    assert checkpoint_step(copy) is None


def test_a_metrics_row_with_bytes_not_utf8_still_counts(tmp_path):
    (tmp_path / "metrics.jsonl").write_bytes(b'{"step": 0}\n{"step": 1, "x": "\xe9"}\n')
    with pytest.raises(ConfigError, match=r"holds another run \(2 metrics rows\)"):
        plan_run_dir(tmp_path, "false", False)


def test_a_second_stage_is_pinned_to_one_checkpoint_of_the_first(run_dir, tmp_path, capsys):
    """policy.model_name naming a run stands for its newest checkpoint when the second run starts, and a resume of
    the second run keeps the one it started from (its config.yaml's) after the first has written a newer one."""
    cfg = load_recipe(TINY, [f"policy.model_name={run_dir}"], RecipeConfig)
    second = tmp_path / "second"
    started = pinned_start(cfg, RunDirPlan(second, "new")).policy.model_name
    assert started == str(run_dir / "checkpoints" / "step_4")
    second.mkdir()
    (second / "config.yaml").write_text(f"policy:\n  model_name: {run_dir / 'checkpoints' / 'step_2'}\n")
    resumed = pinned_start(cfg, RunDirPlan(second, "resume")).policy.model_name
    assert resumed == str(run_dir / "checkpoints" / "step_2")
    assert f"starting, as this run did, from {run_dir}/checkpoints/step_2" in capsys.readouterr().out
