"""Shared fixtures. vLLM engines are expensive (~30 s to start and warm up on 2 cores), so one engine
on the embedded tiny model serves every test that needs one; each test sets its format and refits."""

from __future__ import annotations

import pytest
import torch

from qarl.config import GenerationConfig, PolicyConfig
from qarl.policy import build_policy, resolve_model_dir, score_completions
from qarl.tasks import ArithmeticTask

FORMATS = ["quant_configs/nvfp4_a16.yaml", "quant_configs/nvfp4_w4a4.yaml", "quant_configs/fp8_w8a8.yaml"]


@pytest.fixture(scope="session")
def task() -> ArithmeticTask:
    return ArithmeticTask(num_train=400, num_eval=32, seed=0)


@pytest.fixture(scope="session")
def tiny_dir() -> str:
    return resolve_model_dir("embedded:tiny")


def tiny_policy(task, tiny_dir: str, quant_cfg: str = "none", calib_size: int = 32, trainable: bool = False,
                **overrides):
    """A freshly loaded, quantized and calibrated tiny policy (`trainable`: with master weights, as the
    training loops build it); `overrides` are PolicyConfig fields."""
    cfg = PolicyConfig(quant_cfg=quant_cfg, quant_calib_size=calib_size, **overrides)
    torch.manual_seed(0)
    return build_policy(cfg, task.calibration_texts(calib_size), model_dir=tiny_dir, trainable=trainable)


def answer_loss(policy, task, scale: float = 1.0) -> torch.Tensor:
    """-(sum of the log-probs of 8 training answers) * scale: a real loss through the policy's forward."""
    tok = policy.tokenizer
    prompts = [tok(p.prompt).input_ids for p in task.train[:8]]
    answers = [tok(p.answer).input_ids for p in task.train[:8]]
    return -score_completions(policy.model, prompts, answers, tok.pad_token_id).logprobs.sum() * scale


@pytest.fixture(scope="session")
def make_policy(task, tiny_dir):
    """make_policy(quant_cfg) -> a freshly loaded, quantized and calibrated policy (fp32)."""

    def make(quant_cfg: str = "none", **overrides):
        return tiny_policy(task, tiny_dir, quant_cfg, **overrides)

    return make


@pytest.fixture(scope="session")
def engine(tiny_dir):
    from qarl.generation import VLLMEngine

    return VLLMEngine(tiny_dir, GenerationConfig(max_new_tokens=16, kv_cache_gib=1), dtype="float32", seed=0)
