"""Shared fixtures. vLLM engines are expensive (~30 s to start and warm up on 2 cores), so one engine
on the embedded tiny model serves every test that needs one; each test sets its format and refits."""

from __future__ import annotations

import pytest
import torch

from qarl.config import GenerationConfig, PolicyConfig
from qarl.policy import build_policy, resolve_model_dir
from qarl.tasks import ArithmeticTask

FORMATS = ["quant_configs/nvfp4_a16.yaml", "quant_configs/nvfp4_w4a4.yaml", "quant_configs/fp8_w8a8.yaml"]


@pytest.fixture(scope="session")
def task() -> ArithmeticTask:
    return ArithmeticTask(num_train=400, num_eval=32, seed=0)


@pytest.fixture(scope="session")
def tiny_dir() -> str:
    return resolve_model_dir("embedded:tiny")


@pytest.fixture(scope="session")
def make_policy(task, tiny_dir):
    """make_policy(quant_cfg) -> a freshly loaded, quantized and calibrated policy (fp32)."""

    def make(quant_cfg: str = "none", **overrides):
        cfg = PolicyConfig(quant_cfg=quant_cfg, quant_calib_size=32, **overrides)
        torch.manual_seed(0)
        return build_policy(cfg, task.calibration_texts(32), model_dir=tiny_dir)

    return make


@pytest.fixture(scope="session")
def engine(tiny_dir):
    from qarl.generation import VLLMEngine

    return VLLMEngine(tiny_dir, GenerationConfig(max_new_tokens=16, kv_cache_gib=1), dtype="float32", seed=0)
