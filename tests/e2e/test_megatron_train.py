"""The Megatron backend in the training loops (`policy.backend=megatron`), end to end on the embedded default with
real megatron-core, ModelOpt, vLLM and torch.distributed: QA-GRPO at TP=2 (two processes under torchrun, gloo,
vLLM's external launcher) follows the HF backend's run and resumes exactly after SIGKILL (`-m slow`, as does
the data-parallel layout); checkpoints are Hugging Face ones with fp32 master weights; QAD and a mixture of experts
run on it (`-m slow`)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qarl.checkpoint import complete_checkpoints, load_policy_checkpoint, load_trainer_state, trained_dtype
from qarl.config import ConfigError, PolicyConfig
from qarl.metrics import read_metrics

from tests.loops import GRPO, QAD, deterministic, kill_after_first_checkpoint

MEGATRON = ["policy.backend=megatron"]
# a KL term (the step-0 reference is rebuilt on resume) and two micro-batches per step (one per data-parallel rank)
BETA = ["trainer.beta=0.04", "trainer.micro_batch_size=8"]


def two_processes(run_dir: Path, tp: int = 2, *extra: str) -> list[str]:
    """`qarl train` under torchrun, two processes (the vLLM engine spans both): the Megatron policy at TP=2, or
    at TP=1 and two data-parallel ranks."""
    command = GRPO.command(run_dir, *MEGATRON, *BETA, f"policy.tensor_parallel_size={tp}", *extra)
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *command[1:]]


def run(command: list[str]) -> None:
    subprocess.run(command, check=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})


class RunsOnDemand:
    """Named runs, each made on first use and kept for the module: a run only a `-m slow` test reads is not made in
    the default suite."""

    def __init__(self, commands: dict[str, tuple[Path, list[str]]]):
        self._commands, self._made = commands, set()

    def __getitem__(self, name: str) -> Path:
        run_dir, command = self._commands[name]
        if name not in self._made:
            run(command)
            self._made.add(name)
        return run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> RunsOnDemand:
    """The same QA-GRPO run (fp32) on the HF backend and, on the Megatron backend, at TP=2 and data parallel (two
    processes at TP=1), and a mixed-precision Megatron run (bf16 compute, fp32 masters)."""
    root = tmp_path_factory.mktemp("megatron_train")
    return RunsOnDemand({"hf": (root / "hf", GRPO.command(root / "hf", *BETA)),
                         "tp2": (root / "tp2", two_processes(root / "tp2")),
                         "dp2": (root / "dp2", two_processes(root / "dp2", 1)),
                         "mixed": (root / "mixed", GRPO.command(root / "mixed", *MEGATRON, "policy.dtype=bfloat16"))})


# dp2 with -m slow: the data-parallel gradients equal the HF backend's in tests/integration/test_megatron.py
# (test_megatron_data_parallel_gradients); a DP=2 Megatron QA-GRPO run trains in tests/e2e/test_megatron_multinode.py
@pytest.mark.parametrize("layout", ["tp2", pytest.param("dp2", marks=pytest.mark.slow)])
def test_megatron_qa_grpo_in_two_processes_follows_the_hf_backend(runs, layout):
    """fp32: the Megatron policy in two processes (TP=2, or two data-parallel ranks, each backpropagating its share
    of the micro-batches) and its engine spanning both sample what the HF backend's run samples (the same
    completions, so equal rewards and held-out accuracy at every step); losses, KL and gradient norms (summed
    over the shards, or the ranks) agree to the fp32 floor; the engine is synced with the policy."""
    hf, ours_rows = read_metrics(runs["hf"] / "metrics.jsonl"), read_metrics(runs[layout] / "metrics.jsonl")
    assert [r["step"] for r in ours_rows] == [r["step"] for r in hf] == [0, 1, 2, 3, 4]
    for ours, theirs in zip(ours_rows, hf):
        for key in ("reward/mean", "reward/std", "eval/accuracy", "completion/mean_length"):
            assert ours.get(key) == theirs.get(key), (ours["step"], key)
        for key in ("loss", "grad_norm", "kl/ref", "entropy"):
            if theirs.get(key) is not None:
                assert math.isclose(ours[key], theirs[key], rel_tol=1e-4, abs_tol=1e-7), (ours["step"], key)
        if "mismatch/max_abs_logprob_diff" in ours:
            assert ours["mismatch/max_abs_logprob_diff"] < 1e-4


def test_megatron_tp2_checkpoint_is_a_hugging_face_one(runs):
    """A TP=2 checkpoint holds one trainer state per process, and its policy (weights gathered by Hugging Face
    name, the quantizer state) loads into the HF backend, next to the HF backend's own after the same steps."""
    checkpoint = complete_checkpoints(runs["tp2"])[-1]
    assert (checkpoint / "trainer_state.pt").is_file() and (checkpoint / "trainer_state.rank1.pt").is_file()
    ours, theirs = load_policy_checkpoint(runs["tp2"], PolicyConfig()), load_policy_checkpoint(runs["hf"], PolicyConfig())
    assert ours.format.name == theirs.format.name == "nvfp4_a16"
    weights, reference = ours.model.state_dict(), theirs.model.state_dict()
    assert weights.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.allclose(weights[name], tensor, rtol=0, atol=1e-5), name
    with pytest.raises(ConfigError, match="written by 2 process"):  # resumed by one process: refused
        load_trainer_state(checkpoint)


@pytest.mark.slow  # exact resume after SIGKILL: tests/e2e/test_loops.py (both loops) in the default suite
def test_megatron_tp2_resume_after_sigkill_reproduces_the_uninterrupted_run(runs, tmp_path):
    """Killed after its step-2 checkpoint and resumed at TP=2: the uninterrupted run's metrics, every value. It keeps
    one checkpoint of every step, so the resumed policy's own source directory is gone before its last save."""
    run_dir = tmp_path / "killed"
    every_step = ["checkpoint.every=1", "checkpoint.keep=1"]
    kill_after_first_checkpoint(two_processes(run_dir, 2, *every_step), run_dir)
    run(two_processes(run_dir, 2, *every_step, "trainer.resume=true"))
    assert deterministic(read_metrics(run_dir / "metrics.jsonl")) == deterministic(
        read_metrics(runs["tp2"] / "metrics.jsonl"))
    assert [c.name for c in complete_checkpoints(run_dir)] == ["step_4"]


def test_a_resume_in_another_parallel_layout_is_refused(runs, task, tiny_dir):
    """Optimizer state of TP shards does not fit other parameters: refused by name, not loaded into the wrong ones
    (here: the TP=2 run's rank-0 state into the HF backend's optimizer; TP=2 into TP=1 x DP=2 alike)."""
    from qarl.optim import PolicyOptimizer

    from tests.conftest import tiny_policy

    state = torch.load(complete_checkpoints(runs["tp2"])[-1] / "trainer_state.pt", weights_only=True)
    policy = tiny_policy(task, tiny_dir, "quant_configs/nvfp4_a16.yaml", trainable=True)
    with pytest.raises(ConfigError, match="other shapes"):
        PolicyOptimizer(policy, 1e-4, 0.0, 1.0).load_state_dict(state["optimizer"])


def test_megatron_mixed_precision_checkpoint_holds_fp32_masters(runs):
    """bf16 compute with fp32 masters: the checkpoint keeps the masters (fp32 values, not the bf16 compute copy)
    and says the policy computed in bf16, as the HF backend's checkpoints do; the run stays synced."""
    checkpoint = complete_checkpoints(runs["mixed"])[-1]
    tensors = load_file(str(checkpoint / "policy" / "model.safetensors"))
    assert {t.dtype for t in tensors.values()} == {torch.float32}
    assert any(not torch.equal(t, t.to(torch.bfloat16).float()) for t in tensors.values())
    assert trained_dtype(checkpoint) == "bfloat16"
    rows = read_metrics(runs["mixed"] / "metrics.jsonl")
    assert all(abs(r["mismatch/kl"]) < 1e-3 for r in rows if r.get("mismatch/kl") is not None)


@pytest.mark.slow  # the loops never branch on the backend: QAD's loop in tests/e2e/test_loops.py, the Megatron
# backend's calibration (amax equal to the HF backend's) in tests/integration/test_megatron.py
def test_qad_runs_on_the_megatron_backend(tmp_path):
    """QAD (NVFP4 W4A4 student) on the Megatron backend: the teacher is measured, the engine stays synced, and the
    student was calibrated exactly as the HF backend calibrates it (the same padded batches, padding masked as
    transformers masks it): its input and weight amax are the HF backend's to the last bits of the fused GEMMs."""
    from qarl.checkpoint import checkpoint_format
    from qarl.config import RecipeConfig, load_recipe
    from qarl.quant import quantizer_state
    from qarl.tasks import build_task
    from qarl.run import initial_policy

    run(QAD.command(tmp_path, *MEGATRON))
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert rows[0].get("eval/teacher_accuracy") is not None
    assert all(abs(r["mismatch/kl"]) < 1e-4 for r in rows if r.get("mismatch/kl") is not None)
    cfg = load_recipe(QAD.recipe, [f"run.dir={tmp_path}", *QAD.small], RecipeConfig)
    hf = initial_policy(cfg, build_task(cfg.task, cfg.run.seed))  # the HF backend, calibrated as QAD calibrates
    checkpoint = complete_checkpoints(tmp_path)[-1]
    assert checkpoint_format(checkpoint).name == hf.format.name
    ours, theirs = load_file(str(checkpoint / "quantizer_state.safetensors")), quantizer_state(hf.model)
    assert ours.keys() == theirs.keys() and any("input_quantizer" in k for k in ours)
    for name, amax in theirs.items():
        if "input_quantizer" in name:  # weight amax move with training; the input amax are calibration's
            assert torch.allclose(ours[name], amax, rtol=1e-5, atol=0), name


@pytest.mark.slow  # MoE at TP=2 against the HF backend (trained 3 steps), refits: tests/integration/test_megatron.py
def test_megatron_qa_grpo_of_a_mixture_of_experts_in_two_processes(tmp_path):
    """Qwen3-MoE QA-GRPO (NVFP4 W4A16) at TP=2, the engine spanning both processes: every refit reaches the engine's
    experts (policy and engine log-probs agree to the fp32 floor at every step), and the checkpoint is a Hugging Face
    one with the model's own tensor names and each expert's weight quantizer under the HF backend's name."""
    from qarl.models.resolve import resolve_model_dir

    model = "embedded:tiny-qwen3moe"
    run(two_processes(tmp_path, 2, f"policy.model_name={model}", "warm_start.enabled=false"))
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(GRPO.steps + 1))  # the last row: the final evaluation
    mismatch = [r["mismatch/max_abs_logprob_diff"] for r in rows if "mismatch/max_abs_logprob_diff" in r]
    assert len(mismatch) == GRPO.steps and max(mismatch) < 1e-4
    checkpoint = complete_checkpoints(tmp_path)[-1]
    saved = load_file(str(checkpoint / "policy" / "model.safetensors"))
    assert saved.keys() == load_file(str(Path(resolve_model_dir(model)) / "model.safetensors")).keys()
    amax = load_file(str(checkpoint / "quantizer_state.safetensors"))
    assert "model.layers.0.mlp.experts.gate_up_proj_weight_quantizers.7" in amax
