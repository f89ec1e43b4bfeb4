"""Run directories own their runs (qarl/run_dir.py): what a training command may do with run.dir, the identity it
writes, and checkpoints kept to one run. The end-to-end case (a second `scripts/run.sh`-style run next to a first,
and a resume that says its step) is in tests/e2e/test_train.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qarl.config import ConfigError
from qarl.run_dir import (CHECKPOINT_RUN, IDENTITY, claim_run_dir, complete_checkpoints, plan_run_dir, read_identity,
                          recipe_hash)

RECIPE = {"run": {"dir": "x", "seed": 0, "overwrite": False}, "trainer": {"steps": 4, "resume": "false"}}


def _checkpoint(run_dir: Path, step: int, run_id: str | None) -> Path:
    path = run_dir / "checkpoints" / f"step_{step}"
    path.mkdir(parents=True)
    (path / "COMPLETE").write_text(str(step))
    if run_id is not None:
        (path / CHECKPOINT_RUN).write_text(json.dumps({"run_id": run_id, "step": step}))
    return path


def _started(run_dir: Path) -> str:
    return claim_run_dir(plan_run_dir(run_dir, "false", False), RECIPE, "run: {}\n")


def test_a_new_directory_is_claimed_with_an_identity(tmp_path):
    run_dir = tmp_path / "run"
    plan = plan_run_dir(run_dir, "false", False)
    assert plan.action == "new" and not run_dir.exists(), "planning writes nothing"
    run_id = claim_run_dir(plan, RECIPE, "run: {}\n")
    identity = read_identity(run_dir)
    assert identity["run_id"] == run_id and identity["recipe_hash"] == recipe_hash(RECIPE)
    assert (run_dir / "config.yaml").is_file()


def test_a_run_that_finished_no_step_may_be_started_again(tmp_path):
    _started(tmp_path / "run")  # identity and config.yaml only: it died before its first metrics row
    assert plan_run_dir(tmp_path / "run", "false", False).action == "new"


def test_another_runs_data_is_refused_with_the_ways_out(tmp_path):
    run_dir = tmp_path / "run"
    _started(run_dir)
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
    with pytest.raises(ConfigError, match=r"holds another run \(2 metrics rows.*trainer.resume=true.*run.overwrite"):
        plan_run_dir(run_dir, "false", False)


def test_files_qarl_did_not_write_are_refused(tmp_path):
    (tmp_path / "thesis.tex").write_text("mine")
    with pytest.raises(ConfigError, match="thesis.tex"):
        plan_run_dir(tmp_path, "false", False)


def test_resume_modes(tmp_path):
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError, match="no complete checkpoint"):
        plan_run_dir(run_dir, "true", False)
    assert plan_run_dir(run_dir, "auto", False).action == "new"
    run_id = _started(run_dir)
    _checkpoint(run_dir, 2, run_id)
    plan = plan_run_dir(run_dir, "true", False)
    assert plan.action == "resume" and plan.resume_step == 2
    assert plan_run_dir(run_dir, "auto", False).resume_step == 2
    with pytest.raises(ConfigError, match="choose one"):
        plan_run_dir(run_dir, "true", True)


def test_resume_names_its_step_and_the_changed_settings(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_id = _started(run_dir)
    (run_dir / "config.yaml").write_text("trainer:\n  steps: 4\n")
    _checkpoint(run_dir, 2, run_id)
    longer = {**RECIPE, "trainer": {"steps": 8, "resume": "true"}}
    assert claim_run_dir(plan_run_dir(run_dir, "true", False), longer, "trainer:\n  steps: 8\n") == run_id
    out = capsys.readouterr().out
    assert "resuming from step 2" in out and "trainer.steps 4 -> 8" in out
    assert read_identity(run_dir)["resumed"][0]["from_step"] == 2


def test_overwrite_clears_and_says_so(tmp_path, capsys):
    run_dir = tmp_path / "run"
    _started(run_dir)
    _checkpoint(run_dir, 5, None)
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\n')
    plan = plan_run_dir(run_dir, "false", True)
    assert plan.action == "overwrite"
    claim_run_dir(plan, RECIPE, "run: {}\n")
    assert "clearing" in capsys.readouterr().out
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.yaml", IDENTITY]


def test_overwrite_never_clears_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="holds the working directory"):
        plan_run_dir(tmp_path, "false", True)
    with pytest.raises(ConfigError, match="holds the working directory"):
        plan_run_dir(tmp_path.parent, "false", True)


def test_checkpoints_of_another_run_are_not_this_runs(tmp_path):
    """What pruning and resuming read: an old run's step_150 never counts as the newest of a new run's."""
    run_dir = tmp_path / "run"
    _checkpoint(run_dir, 150, "old-run")
    mine = [_checkpoint(run_dir, s, "new-run") for s in (2, 4)]
    legacy = _checkpoint(run_dir, 1, None)  # written before checkpoints carried a run id
    assert complete_checkpoints(run_dir, "new-run") == [legacy, *mine]
    assert complete_checkpoints(run_dir)[-1].name == "step_150"
