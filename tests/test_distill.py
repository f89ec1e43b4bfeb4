"""QAD: the reverse-KL loss against a direct computation (full vocabulary and top-k, with the top-k
error bound), the teacher checks (tokenizer, memory), and the whole loop for a few steps in
subprocesses (real vLLM, real ModelOpt), killed, resumed, and compared with an uninterrupted run."""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from qarl.config import ConfigError, RecipeConfig, load_recipe
from qarl.distill import check_tokenizers, distill, teacher_source
from qarl.distill_loss import reverse_kl, topk_error
from qarl.metrics import read_metrics

RECIPE = "recipes/qa_distillation_tiny.yaml"
COMMAND = [sys.executable, "-m", "qarl", "distill", RECIPE]
SMALL = ["trainer.steps=3", "trainer.batch_size=16", "trainer.num_generations=2", "trainer.micro_batch_size=8", "warm_start.steps=30",
         "checkpoint.every=2", "eval.every=2", "eval.num_prompts=16", "task.num_train=200", "task.num_eval=16",
         "policy.quant_calib_size=16", "policy.generation.max_new_tokens=6"]


# -- the loss ------------------------------------------------------------------------------------
def _softmax(row: list[float], temperature: float) -> list[float]:
    z = [x / temperature for x in row]
    top = max(z)
    e = [math.exp(x - top) for x in z]
    return [x / sum(e) for x in e]


def _direct_kl(s_row: list[float], t_row: list[float], temperature: float, top_k: int = 0) -> float:
    """The definition, one position at a time in float64 Python arithmetic."""
    p, q = _softmax(s_row, temperature), _softmax(t_row, temperature)
    if top_k <= 0:
        return sum(pv * (math.log(pv) - math.log(qv)) for pv, qv in zip(p, q))
    keep = sorted(range(len(p)), key=lambda v: -p[v])[:top_k]
    head = sum(p[v] * (math.log(p[v]) - math.log(q[v])) for v in keep)
    rest_p, rest_q = 1 - sum(p[v] for v in keep), 1 - sum(q[v] for v in keep)
    return head + (rest_p * math.log(rest_p / rest_q) if rest_p > 0 else 0.0)


@pytest.mark.parametrize("top_k", [0, 1, 5, 31])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_reverse_kl_matches_a_direct_computation(top_k, temperature):
    torch.manual_seed(top_k)
    student, teacher = torch.randn(3, 4, 32) * 2, torch.randn(3, 4, 32) * 2
    got = reverse_kl(student, teacher, temperature, top_k)
    want = torch.tensor([[_direct_kl(s.tolist(), t.tolist(), temperature, top_k) for s, t in zip(ss, tt)]
                         for ss, tt in zip(student, teacher)], dtype=torch.float64)
    assert got.shape == (3, 4)
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-5)


def test_full_vocabulary_gradient_is_the_analytic_one():
    """d KL / d z_s(v) = p_s(v) (log p_s(v) - log p_t(v) - KL) / T; the teacher gets no gradient."""
    torch.manual_seed(0)
    temperature = 0.8
    student = (torch.randn(5, 50) * 3).requires_grad_()
    teacher = torch.randn(5, 50) * 3
    reverse_kl(student, teacher, temperature).sum().backward()
    log_s, log_t = (torch.log_softmax(x.detach().double() / temperature, -1) for x in (student, teacher))
    kl = (log_s.exp() * (log_s - log_t)).sum(-1, keepdim=True)
    torch.testing.assert_close(student.grad.double(), log_s.exp() * (log_s - log_t - kl) / temperature,
                               atol=1e-6, rtol=1e-4)


def test_identical_models_have_zero_kl_and_top_k_of_the_whole_vocabulary_is_exact():
    logits = torch.randn(2, 3, 40)
    assert reverse_kl(logits, logits.clone()).abs().max() < 1e-6
    assert reverse_kl(logits, logits.clone(), top_k=5).abs().max() < 1e-6
    other = torch.randn(2, 3, 40)
    torch.testing.assert_close(reverse_kl(logits, other, top_k=40), reverse_kl(logits, other))


@pytest.mark.parametrize("top_k", [1, 8, 64])
def test_top_k_error_is_the_tail_term_and_within_its_bound(top_k):
    """KL_full - KL_k = m_s KL(p_s(.|tail) || p_t(.|tail)), in [0, m_s max log-ratio]; checked on peaked
    (LLM-like) and flat rows."""
    torch.manual_seed(top_k)
    for scale in (1.0, 4.0):
        student = torch.randn(64, 512) * scale
        teacher = student + torch.randn(64, 512) * 0.5
        err = topk_error(student, teacher, 1.0, top_k)
        assert (err["error"] >= -1e-5).all()
        assert (err["error"] <= err["bound"] + 1e-5).all()
        # the identity, directly: tail mass times the KL of the renormalised tails
        log_s, log_t = torch.log_softmax(student.double(), -1), torch.log_softmax(teacher.double(), -1)
        tail = torch.ones_like(log_s, dtype=torch.bool).scatter(-1, log_s.topk(top_k, -1).indices, False)
        cond_s = log_s.masked_fill(~tail, -torch.inf)
        cond_s = cond_s - cond_s.logsumexp(-1, keepdim=True)
        cond_t = log_t.masked_fill(~tail, -torch.inf)
        cond_t = cond_t - cond_t.logsumexp(-1, keepdim=True)
        tail_kl = torch.where(tail, cond_s.exp() * (cond_s - cond_t), torch.zeros_like(cond_s)).sum(-1)
        torch.testing.assert_close(err["error"].double(), err["tail_mass"].double() * tail_kl, atol=2e-5, rtol=1e-3)


# -- the teacher checks --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_dir() -> str:
    from qarl.models.resolve import resolve_model_dir

    return resolve_model_dir("embedded:tiny")


def _cfg(tmp_path: Path, *overrides: str) -> RecipeConfig:
    return load_recipe(RECIPE, [f"run.dir={tmp_path / 'run'}", *overrides], RecipeConfig)


def test_a_teacher_with_another_tokenizer_is_a_clear_error(tmp_path, tiny_dir):
    from transformers import AutoTokenizer

    other = tmp_path / "other_teacher"
    shutil.copytree(tiny_dir, other)
    tokenizer = AutoTokenizer.from_pretrained(other)
    tokenizer.add_tokens(["<extra>"])
    tokenizer.save_pretrained(other)
    with pytest.raises(ConfigError, match=r"does not share the student's tokenizer.*vocabularies differ") as e:
        check_tokenizers(tiny_dir, str(other))
    assert str(other) in str(e.value) and tiny_dir in str(e.value)
    with pytest.raises(ConfigError, match="teacher.model_name"):
        distill(_cfg(tmp_path, f"teacher.model_name={other}"))
    assert not (tmp_path / "run").exists()  # failed before the run started: nothing loaded, nothing written


def test_a_teacher_that_does_not_fit_names_the_settings_to_change(tmp_path, tiny_dir):
    """A 68B-parameter teacher (architecture only: counted on the meta device) beside the tiny student."""
    import json

    huge = tmp_path / "huge_teacher"
    huge.mkdir()
    for f in Path(tiny_dir).iterdir():
        if "token" in f.name:
            shutil.copy(f, huge)
    config = json.loads((Path(tiny_dir) / "config.json").read_text())
    config.update(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                  num_key_value_heads=8, layer_types=["full_attention"] * 80)
    (huge / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"does not fit.*teacher.dtype.*smaller teacher.model_name.*kv_cache_gib"):
        distill(_cfg(tmp_path, f"teacher.model_name={huge}"))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("overrides, needle", [
    (["distill.top_k=-1"], "distill.top_k"),
    (["teacher.dtype=int8"], "teacher.dtype"),
    (["trainer.batch_size=10", "trainer.num_generations=4"], "not divisible"),
    (["teacher.model_name=/no/such/teacher"], "model not found"),
    (["teacher.model_name=no-such-org/no-such-model"], "could not be loaded.*HF_HUB_OFFLINE"),
    (["distill.lr_schedule=linear"], "distill.lr_schedule"),
])
def test_bad_settings_fail_before_any_model_is_loaded(tmp_path, overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        distill(_cfg(tmp_path, *overrides))
    assert not (tmp_path / "run").exists()


# -- the whole loop ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """Three steps, killed (SIGKILL) once the checkpoint of step 2 is written, then resumed."""
    run = tmp_path_factory.mktemp("qad") / "run"
    proc = subprocess.Popen([*COMMAND, f"run.dir={run}", *SMALL], start_new_session=True)
    deadline = time.time() + 600
    while not (run / "checkpoints" / "step_2" / "COMPLETE").exists():
        assert proc.poll() is None, "the run ended before its first checkpoint"
        assert time.time() < deadline
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)  # in step 2, before its checkpoint at the end
    proc.wait()
    assert not (run / "checkpoints" / "step_3").exists()
    subprocess.run([*COMMAND, f"run.dir={run}", "trainer.resume=true", *SMALL], check=True, timeout=600)
    return run


def test_a_few_steps_write_the_distillation_metrics(run_dir):
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert rows[0]["eval/teacher_accuracy"] is not None  # the teacher, unquantized, in the same engine
    for r in rows[:3]:
        # the engine samples from the fake-quantized student (the mean, since W4A4 can flip a rare token, more
        # of them on a CPU whose GEMM sums in an order set by the number of rows: tests/test_lora.py)
        assert r["distill/kl"] >= 0 and abs(r["mismatch/kl"]) < 1e-4
        assert all(k in r for k in ("entropy", "grad_norm", "reward/mean", "perf/step_s"))
    for r in (rows[0], rows[2], rows[3]):  # step 0 (= PTQ), every eval.every, and the end
        assert 0 <= r["eval/accuracy"] <= 1 and r["eval/teacher_kl"] > 0
    assert abs(rows[0]["eval/teacher_kl"] - rows[0]["distill/kl"]) < 0.1  # the same quantity, other prompts
    assert (run_dir / "metrics.png").is_file()
    assert [p.name for p in sorted((run_dir / "checkpoints").iterdir())] == ["step_2", "step_3"]


def test_the_resumed_run_reproduces_the_uninterrupted_one(run_dir, tmp_path):
    straight = tmp_path / "straight"
    subprocess.run([*COMMAND, f"run.dir={straight}", *SMALL], check=True, timeout=600)
    deterministic = lambda rows: [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]  # noqa: E731
    assert deterministic(read_metrics(run_dir / "metrics.jsonl")) == deterministic(read_metrics(straight / "metrics.jsonl"))


def test_a_qarl_checkpoint_is_a_teacher(run_dir, tmp_path):
    cfg = _cfg(tmp_path, f"teacher.model_name={run_dir}")
    assert teacher_source(cfg) == str(run_dir / "checkpoints" / "step_3" / "policy")


def test_qad_trains_a_qlora_adapter_over_the_frozen_quantized_student(tmp_path):
    """QAD with policy.lora: only the adapter learns (the checkpoint is an adapter on the warm-started
    base), the engine serves it (mismatch at the floor), and the KL is finite at every step."""
    from safetensors.torch import load_file

    run = tmp_path / "qlora"  # in a subprocess, as the other runs: an engine torn down in-process breaks later ones
    subprocess.run([*COMMAND, f"run.dir={run}", *SMALL, "policy.lora.mode=qlora", "trainer.lr=3.0e-3",
                    "checkpoint.every=3"], check=True, timeout=600)
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for r in rows[:3]:
        assert math.isfinite(r["distill/kl"]) and abs(r["mismatch/kl"]) < 1e-4
    checkpoint = run / "checkpoints" / "step_3"
    assert (checkpoint / "lora.json").is_file() and not (checkpoint / "policy").exists()
    adapter = load_file(str(checkpoint / "adapter" / "adapter_model.safetensors"))
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in adapter.items())  # B starts at 0
