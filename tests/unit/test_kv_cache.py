"""The FP8 KV cache (issue 73): the codes the engine's cache stores decode to what the policy's ModelOpt key and value
quantizers compute, bit for bit; the plan reads the cache from ModelOpt's own quantizers; what cannot run is refused
by name before an engine starts."""

from __future__ import annotations

import copy

import pytest
import torch
from modelopt.torch.quantization import tensor_quant  # noqa: F401  (registers ModelOpt's fake-quant ops)

from qarl.config import ConfigError
from qarl.generation.engine_quant import KVCacheScales
from qarl.generation.vllm_engine import check_kv_cache, holds_kv_cache_scales
from qarl.quant import QuantFormat, resolve_format
from qarl.quant.codes import decode_fp8_codes, fp8_codes, fp8_kernel_multiplier
from qarl.quant.modelopt_compat import scaled_quantize
from qarl.quant.ops import FP8, InputQuant, input_quant_plan, kv_cache_key, layer_inputs

from tests.conftest import tiny_policy

AMAXES = [0.0, 1e-30, 0.37, 0.8808, 3.0, 17.25, 1000.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp8_codes_decode_to_modelopts_fake_quant_bit_for_bit(dtype):
    generator = torch.Generator().manual_seed(0)
    for amax in AMAXES:
        x = (torch.randn(64, 4, 32, generator=generator) * 5).to(dtype)
        x[0, 0, :4] = torch.tensor([0.0, -0.0, 1e4, -1e4])  # signed zeros, saturation
        expected = scaled_quantize(x, torch.tensor(amax), 8, 4, False, False)
        multiplier = fp8_kernel_multiplier(torch.tensor(amax), "cpu")
        got = decode_fp8_codes(fp8_codes(x, multiplier), torch.reciprocal(multiplier), dtype)
        assert got.dtype == expected.dtype and torch.equal(got.view(torch.uint8), expected.view(torch.uint8)), amax


def test_plan_holds_a_kv_cache_per_attention_layer(tiny_dir):
    plan = input_quant_plan(tiny_dir, resolve_format("nvfp4_a16_kv_fp8"))
    assert plan == {kv_cache_key(f"model.layers.{i}.self_attn"): InputQuant(FP8) for i in range(2)}
    assert layer_inputs(plan) == {} and holds_kv_cache_scales(plan)  # weight-only: no layer input quantized
    plan = input_quant_plan(tiny_dir, resolve_format("fp8_w8a8_kv_fp8"))
    assert len(layer_inputs(plan)) == 14 and len(plan) == 16
    assert not holds_kv_cache_scales(input_quant_plan(tiny_dir, resolve_format("fp8_w8a8")))


def _with_kv_entry(entry: dict) -> QuantFormat:
    base = resolve_format("nvfp4_a16")
    cfg = copy.deepcopy(base.modelopt_cfg)
    cfg["quant_cfg"].insert(2, entry)  # after the '*' disable and the weights
    return QuantFormat("custom", "custom.yaml", cfg)


@pytest.mark.parametrize("entry, says", [
    ({"quantizer_name": "*[kv]_bmm_quantizer",
      "cfg": {"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}}}, "NVFP4"),
    ({"quantizer_name": "*k_bmm_quantizer", "cfg": {"num_bits": (4, 3), "axis": None}}, "keys and values alike"),
    ({"quantizer_name": "*[kv]_bmm_quantizer",  # ModelOpt's FP8_AFFINE_KV_CFG: a bias
      "cfg": {"num_bits": (4, 3), "axis": None, "bias": {-2: None, -4: None, "type": "static"}}},
     "otherwise than vLLM"),
    ({"quantizer_name": "*q_bmm_quantizer", "cfg": {"num_bits": (4, 3), "axis": None}}, "does not run"),
])
def test_kv_caches_the_engine_cannot_hold_are_refused(tiny_dir, entry, says):
    with pytest.raises(ConfigError, match=says):
        input_quant_plan(tiny_dir, _with_kv_entry(entry))


def test_this_cpu_engine_holds_the_cache(tiny_dir):
    fmt = resolve_format("nvfp4_a16_kv_fp8")
    check_kv_cache(tiny_dir, input_quant_plan(tiny_dir, fmt), fmt, exact=False, dtype="float32")  # AVX-512, head 32


def test_engine_cache_rows_are_the_policys_quantized_keys_and_values(task, tiny_dir):
    """KVCacheScales with the policy's amax store and return exactly what the policy's k/v_bmm_quantizer compute."""
    policy = tiny_policy(task, tiny_dir, "nvfp4_a16_kv_fp8")
    attention = policy.model.model.layers[1].self_attn
    scales = KVCacheScales("model.layers.1.self_attn", torch.device("cpu"))
    key_quantizer, value_quantizer = attention.k_bmm_quantizer, attention.v_bmm_quantizer
    assert key_quantizer.amax.numel() == 1 and key_quantizer.amax > 0  # calibrated with the weights
    scales.load_amax(key_quantizer.amax, value_quantizer.amax)
    generator = torch.Generator().manual_seed(1)
    key, value = (torch.randn(40, 2, 32, generator=generator) * 0.4 for _ in range(2))  # [tokens, heads, dim]
    rows = scales.encode(key, value)
    assert rows.dtype == torch.uint8 and rows.shape == (40, 2, 64)  # one byte an element
    got_key, got_value = scales.decode(rows, torch.float32)
    assert torch.equal(got_key, key_quantizer(key)) and torch.equal(got_value, value_quantizer(value))


@pytest.mark.parametrize("target", ["nvfp4_w4a16_modelopt", "nvfp4_w4a16_compressed_tensors"])
def test_export_writes_the_trained_kv_scales_where_each_target_expects_them(task, tiny_dir, tmp_path, target):
    import json

    from safetensors.torch import load_file

    from qarl.export import export_policy, verify_export

    policy = tiny_policy(task, tiny_dir, "nvfp4_a16_kv_fp8")
    summary = export_policy(policy, target, tmp_path / "out")
    assert summary["kv_cache"] == {"dtype": "fp8", "attention_layers": 2}
    tensors = load_file(str(tmp_path / "out" / "model.safetensors"))
    config = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    attention = policy.model.model.layers[0].self_attn
    amax = attention.k_bmm_quantizer.amax
    expected = torch.reciprocal(torch.reciprocal(amax.float()) * 448.0)  # 1 / (448 / amax), as the CPU kernel rounds
    if target.endswith("modelopt"):
        hf_quant = json.loads((tmp_path / "out" / "hf_quant_config.json").read_text())["quantization"]
        assert hf_quant["kv_cache_quant_algo"] == "FP8"
        key_scale = tensors["model.layers.0.self_attn.k_proj.k_scale"]
        assert key_scale.shape == () and "model.layers.1.self_attn.v_proj.v_scale" in tensors
    else:
        scheme = config["kv_cache_scheme"]
        assert (scheme["type"], scheme["num_bits"], scheme["strategy"], scheme["symmetric"], scheme["dynamic"]) == \
            ("float", 8, "tensor", True, False)
        key_scale = tensors["model.layers.0.self_attn.k_scale"]
        assert key_scale.shape == (1,) and "model.layers.1.self_attn.v_scale" in tensors
    assert key_scale.dtype == torch.float32 and torch.equal(key_scale.reshape(()), expected.reshape(()))
    assert float(key_scale) < 1.0  # the trained scale, not ModelOpt's exporter's clamp to >= 1
    report = verify_export(tmp_path / "out", policy=policy)
    assert report["kv_cache"]["equal"] and report["kv_cache"]["scales"] == 4 and report["ok"], report["kv_cache"]
