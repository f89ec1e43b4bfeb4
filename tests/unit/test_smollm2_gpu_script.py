"""benchmarks/smollm2_gpu.sh refuses, at once and before it copies anything, a pipeline that could not run: a bad
RUNS, a machine without a GPU, a Python without torch, vLLM or ModelOpt. Each of those used to start runs that failed
three times each, minutes later, in the pipeline's log (a GPU session's device time spent on nothing)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

SCRIPT = REPO / "benchmarks" / "smollm2_gpu.sh"


def start(tmp_path: Path, runs: str, path: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "RUNS": runs, "SEEDS": "0", "MATRICES": "none", "WORKDIR": str(tmp_path / "work")}
    if path is not None:
        env["PATH"] = path
    return subprocess.run(["bash", str(SCRIPT), "start"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=60)


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


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine may have a GPU")
def test_a_machine_without_a_gpu_is_refused(tmp_path: Path):
    proc = start(tmp_path, "grpo_bf16")
    assert proc.returncode == 2 and "nvidia-smi lists no GPU" in proc.stderr, proc.stderr
    assert not (tmp_path / "work").exists()


def test_a_python_without_the_gpu_libraries_is_refused_naming_them_and_the_fix(tmp_path: Path):
    # -S: no site-packages, so none of torch, vllm, modelopt is importable
    proc = start(tmp_path, "grpo_bf16", fake_gpu(tmp_path, f'exec "{sys.executable}" -S "$@"'))
    assert proc.returncode == 2, proc.stderr
    assert "cannot import torch, vllm, modelopt" in proc.stderr and "open.sh" in proc.stderr, proc.stderr
    assert not (tmp_path / "work").exists()
