"""Mixed formats (issue 72, mixed precision): a quant config that keeps some linear layers' inputs unquantized
(`quant_configs/nvfp4_w4a4_down_a16.yaml`: W4A4 with down_proj at W4A16) or in another format
(`nvfp4_w4a4_down_fp8.yaml`: down_proj in FP8 W8A8). The format is told apart from the uniform ones it shares a layer
with (export targets, the packed qlora base), its W4A4 share is counted from the model's own layers, and an export
refuses a mix no target writes by name (and takes a format that leaves the other layers wholly unquantized, or the
W4A4 + FP8 mix, which compressed-tensors writes as two schemes)."""

from __future__ import annotations

import pytest

from qarl.config import ConfigError
from qarl.export.core import target_scheme
from qarl.export.targets import check_target_matches, load_target
from qarl.quant import resolve_format, w4a4_share
from qarl.quant.formats import MIXED, quantizer_settings
from qarl.quant.packed import packed_bytes_per_weight

from tests.conftest import tiny_policy

MIXED_CFG = "quant_configs/nvfp4_w4a4_down_a16.yaml"
DOWN_FP8 = "quant_configs/nvfp4_w4a4_down_fp8.yaml"


def test_a_mixed_format_is_not_the_uniform_format_of_any_of_its_layers():
    mixed = quantizer_settings(resolve_format(MIXED_CFG))
    assert set(mixed) == {MIXED}
    layers = mixed[MIXED]
    assert layers["mlp.down_proj"] == quantizer_settings(resolve_format("nvfp4_a16"))  # down_proj alone is W4A16
    assert layers["self_attn.q_proj"] == quantizer_settings(resolve_format("nvfp4_w4a4"))
    for uniform in ("nvfp4_a16", "nvfp4_w4a4", "fp8_w8a8"):
        assert MIXED not in quantizer_settings(resolve_format(uniform))
    assert packed_bytes_per_weight(resolve_format(MIXED_CFG)) is None  # no packed form: counted unpacked


def test_an_export_refuses_a_mixed_format_by_name():
    for target in ("nvfp4_w4a4_modelopt", "nvfp4_w4a16_compressed_tensors"):
        with pytest.raises(ConfigError, match="mixed formats.*down_proj: weights NVFP4, inputs unquantized"):
            check_target_matches(resolve_format(MIXED_CFG), load_target(target))


def test_a_format_that_leaves_a_layer_unquantized_exports_as_its_quantized_layers_format():
    """nvfp4_w4a4_down_bf16: down_proj wholly unquantized (weights and inputs), the rest W4A4; the W4A4 targets take
    it (down_proj written in the model's dtype, as lm_head is), the W4A16 ones still refuse it."""
    down_bf16 = resolve_format("quant_configs/nvfp4_w4a4_down_bf16.yaml")
    assert quantizer_settings(down_bf16)[MIXED]["mlp.down_proj"] == {"weight": None, "input": None}
    for target in ("nvfp4_w4a4_modelopt", "nvfp4_w4a4_compressed_tensors"):
        check_target_matches(down_bf16, load_target(target))
    with pytest.raises(ConfigError, match="expects a model trained with"):
        check_target_matches(down_bf16, load_target("nvfp4_w4a16_compressed_tensors"))


def test_the_w4a4_share_counts_the_layers_whose_weights_and_inputs_are_nvfp4(task, tiny_dir):
    policy = tiny_policy(task, tiny_dir, MIXED_CFG)
    config = policy.model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head = config.hidden_size // heads
    attention = config.hidden_size * head * (2 * heads + 2 * kv_heads)  # q, o; k, v
    mlp = config.hidden_size * config.intermediate_size
    assert w4a4_share(policy.model) == pytest.approx((attention + 2 * mlp) / (attention + 3 * mlp))
    down_bf16 = tiny_policy(task, tiny_dir, "quant_configs/nvfp4_w4a4_down_bf16.yaml").model  # down_proj unquantized
    assert w4a4_share(down_bf16) == pytest.approx((attention + 2 * mlp) / (attention + 3 * mlp))
    down_fp8 = tiny_policy(task, tiny_dir, DOWN_FP8).model  # down_proj in FP8: quantized, not W4A4
    assert w4a4_share(down_fp8) == pytest.approx((attention + 2 * mlp) / (attention + 3 * mlp))
    assert w4a4_share(tiny_policy(task, tiny_dir, "nvfp4_w4a4").model) == 1.0
    assert w4a4_share(tiny_policy(task, tiny_dir, "nvfp4_a16").model) is None


def test_w4a4_with_down_proj_in_fp8_exports_to_its_own_target_only(tmp_path):
    """nvfp4_w4a4_down_fp8: down_proj in FP8 W8A8, the rest NVFP4 W4A4. Its compressed-tensors target writes both
    schemes; a uniform target names the one that fits; a ModelOpt target of the mix, and a mix with a weight-only layer,
    are refused from the target alone (before a checkpoint loads), each naming why."""
    down_fp8 = resolve_format(DOWN_FP8)
    layers = quantizer_settings(down_fp8)[MIXED]
    assert layers["mlp.down_proj"] == quantizer_settings(resolve_format("fp8_w8a8"))
    assert layers["self_attn.q_proj"] == quantizer_settings(resolve_format("nvfp4_w4a4"))
    mixed_target = load_target("nvfp4_w4a4_down_fp8_compressed_tensors")
    check_target_matches(down_fp8, mixed_target)
    assert target_scheme(mixed_target) == "nvfp4_w4a4+fp8_w8a8"
    with pytest.raises(ConfigError, match=r"fit this checkpoint: \['nvfp4_w4a4_down_fp8_compressed_tensors'\]"):
        check_target_matches(down_fp8, load_target("nvfp4_w4a4_compressed_tensors"))
    with pytest.raises(ConfigError, match="expects a model trained with"):
        check_target_matches(resolve_format("nvfp4_w4a4"), mixed_target)
    modelopt = tmp_path / "mixed_modelopt.yaml"
    modelopt.write_text(f"quant_format: {DOWN_FP8}\ndisk_format: modelopt_hf\n")
    with pytest.raises(ConfigError, match="only disk_format compressed_tensors writes"):
        target_scheme(load_target(modelopt))
    weight_only = tmp_path / "weight_only_mix.yaml"
    weight_only.write_text(f"quant_format: {MIXED_CFG}\ndisk_format: compressed_tensors\n")
    with pytest.raises(ConfigError, match="all quantize their inputs"):
        target_scheme(load_target(weight_only))
