"""benchmarks/smollm2_gpu.sh refuses, at once and before it copies anything, a pipeline that could not run: a bad
RUNS, a machine without a GPU, a Python without torch, vLLM or ModelOpt. Each of those used to start runs that failed
three times each, minutes later, in the pipeline's log (a GPU session's device time spent on nothing). Its `plan`
shows what each run gets: its start, its kind's overrides and a variant's after them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

SCRIPT = REPO / "benchmarks" / "smollm2_gpu.sh"
STUDY = REPO / "benchmarks" / "w4a4_study.sh"


def start(tmp_path: Path, runs: str, path: str | None = None, stage: str = "start", script: Path = SCRIPT,
          **settings: str) -> subprocess.CompletedProcess:
    """`bash SCRIPT STAGE` with these RUNS (the study script sets its own), one seed, no matrix, no ARGS_ of ours."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("ARGS_")}, "RUNS": runs, "SEEDS": "0",
           "MATRICES": "none", "WORKDIR": str(tmp_path / "work"), **settings}
    if path is not None:
        env["PATH"] = path
    return subprocess.run(["bash", str(script), stage], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=60)


def plan(tmp_path: Path, runs: str, script: Path = SCRIPT, **settings: str) -> dict[str, str]:
    """{run name: its `qarl` arguments}."""
    proc = start(tmp_path, runs, stage="plan", script=script, **settings)
    assert proc.returncode == 0, proc.stderr
    return dict(line.split(": qarl ", 1) for line in proc.stdout.splitlines())


def fake_gpu(tmp_path: Path, python: str) -> str:
    """A PATH whose nvidia-smi lists one GPU and whose python3 is `python` (a shell line), so the check past the GPU's
    runs on any machine."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: a test stand-in'\n")
    (bin_dir / "python3").write_text(f"#!/bin/sh\n{python}\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    return f"{bin_dir}:{os.environ['PATH']}"


def test_an_unknown_kind_is_refused_before_the_copy(tmp_path: Path):
    proc = start(tmp_path, "grpo_bf16 qad_w4a44")
    assert proc.returncode == 2 and "unknown run kind qad_w4a44" in proc.stderr, proc.stderr
    assert not (tmp_path / "work").exists()


def test_a_run_whose_start_is_not_planned_is_refused(tmp_path: Path):
    proc = start(tmp_path, "qad_w4a4")
    assert proc.returncode == 2 and "add grpo_bf16 with seed 0 to RUNS" in proc.stderr, proc.stderr


def test_a_workdir_holding_a_pipeline_s_runs_is_refused_and_kept(tmp_path: Path):
    kept = tmp_path / "work" / "runs" / "smollm2" / "grpo_bf16_s0" / "metrics.jsonl"
    kept.parent.mkdir(parents=True)
    kept.write_text('{"step": 0}\n')
    proc = start(tmp_path, "grpo_bf16")
    assert proc.returncode == 2 and "holds a pipeline's runs" in proc.stderr and "keep TAR" in proc.stderr, proc.stderr
    assert kept.read_text() == '{"step": 0}\n'


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine may have a GPU")
def test_a_machine_without_a_gpu_is_refused(tmp_path: Path):
    proc = start(tmp_path, "grpo_bf16")
    assert proc.returncode == 2 and "nvidia-smi lists no GPU" in proc.stderr, proc.stderr
    assert not (tmp_path / "work").exists()


def test_a_python_without_the_gpu_libraries_is_refused_naming_them_and_the_fix(tmp_path: Path):
    # -I -S: no site-packages and no PYTHONPATH (the GPU kit's holds them), so none of torch, vllm, modelopt imports
    proc = start(tmp_path, "grpo_bf16", fake_gpu(tmp_path, f'exec "{sys.executable}" -I -S "$@"'))
    assert proc.returncode == 2, proc.stderr
    assert "cannot import torch, vllm, modelopt" in proc.stderr and "open.sh" in proc.stderr, proc.stderr
    assert not (tmp_path / "work").exists()


def test_plan_gives_a_variant_its_kind_s_overrides_then_its_own_and_its_start(tmp_path: Path):
    chain = "grpo_bf16 qad_w4a4 qad_w4a4+lr3:0 qad_grpo_then_qa_grpo_w4a4 qad_grpo_then_qa_grpo_w4a4+lr3:0"
    runs = plan(tmp_path, chain, SEEDS="0 1", ARGS_qad_w4a4="trainer.micro_batch_size=32",
                ARGS_qad_w4a4_lr3="trainer.lr=3e-5")
    assert list(runs) == ["grpo_bf16_s0", "grpo_bf16_s1", "qad_w4a4_s0", "qad_w4a4_s1", "qad_w4a4+lr3_s0",
                          "qad_grpo_then_qa_grpo_w4a4_s0", "qad_grpo_then_qa_grpo_w4a4_s1",
                          "qad_grpo_then_qa_grpo_w4a4+lr3_s0"]
    variant = runs["qad_w4a4+lr3_s0"].split()
    assert variant[:3] == ["distill", "recipes/qa_distillation_smollm2.yaml", "run.dir=runs/smollm2/qad_w4a4+lr3_s0"]
    assert variant[-3:] == ["teacher.model_name=runs/smollm2/grpo_bf16_s0", "trainer.micro_batch_size=32",
                            "trainer.lr=3e-5"]  # the last of a key wins: the shared micro-batch of 8 comes before
    assert "trainer.lr=3e-5" not in runs["qad_w4a4_s0"]
    assert "policy.model_name=runs/smollm2/qad_w4a4+lr3_s0" in runs["qad_grpo_then_qa_grpo_w4a4+lr3_s0"]
    assert "policy.model_name=runs/smollm2/qad_w4a4_s1" in runs["qad_grpo_then_qa_grpo_w4a4_s1"]


def test_plan_keeps_every_override_of_a_kind_written_over_two_lines(tmp_path: Path):
    runs = plan(tmp_path, "qa_grpo_w4a16_kv_fp8_default")
    assert runs["qa_grpo_w4a16_kv_fp8_default_s0"].split()[-3:] == [
        "policy.exact_forward=false", "policy.generation.allow_quant_mismatch=true", "run.seed=0"]


def test_a_variant_of_a_later_stage_starts_from_its_kind_s_run_where_its_start_has_no_such_variant(tmp_path: Path):
    runs = plan(tmp_path, "grpo_bf16 qad_w4a4 qad_grpo_then_qa_grpo_w4a4+lr3")
    assert "policy.model_name=runs/smollm2/qad_w4a4_s0" in runs["qad_grpo_then_qa_grpo_w4a4+lr3_s0"]


@pytest.mark.parametrize(("runs", "settings", "problem"), [
    ("grpo_bf16 qad_w4a4+methods", {}, "kind qad_w4a4_methods's own: choose another TAG"),
    ("grpo_bf16 qad_w4a4+lr-3", {}, "TAG letters and digits"),
    ("grpo_bf16 qad_w4a4+lr3", {"ARGS_qad_w4a4_lr4": "trainer.lr=3e-5"}, "qad_w4a4_lr4 is not a kind in RUNS"),
])
def test_a_variant_that_cannot_be_told_apart_is_refused(tmp_path: Path, runs: str, settings: dict, problem: str):
    proc = start(tmp_path, runs, stage="plan", **settings)
    assert proc.returncode == 2 and problem in proc.stderr and proc.stdout == "", proc.stderr


def test_the_w4a4_study_chains_each_method_alone_from_the_same_teachers(tmp_path: Path):
    runs = plan(tmp_path, "", script=STUDY, SEEDS="0 1 2")
    assert len(runs) == 51  # 3 seeds x (GRPO, QA-GRPO W4A4, 7 chains of QAD and QA-GRPO, QAD down_proj unquantized)
    mixed = runs["qad_w4a4_down_bf16_s1"].split()
    assert "teacher.model_name=runs/smollm2/grpo_bf16_s1" in mixed
    assert "recipes/qa_distillation_smollm2_down_bf16.yaml" in mixed
    configs = set()
    for tag in ("pt", "fos", "fosw", "had", "down"):
        qad, rl = runs[f"qad_w4a4+{tag}_s2"].split(), runs[f"qad_grpo_then_qa_grpo_w4a4+{tag}_s2"].split()
        assert "teacher.model_name=runs/smollm2/grpo_bf16_s2" in qad
        assert f"policy.model_name=runs/smollm2/qad_w4a4+{tag}_s2" in rl
        assert qad[-1] == rl[-1] and qad[-1].startswith("policy.quant_cfg=")  # both stages in the method's format
        configs.add(qad[-1].removeprefix("policy.quant_cfg="))
    assert len(configs) == 5 and all((REPO / config).is_file() for config in configs)
