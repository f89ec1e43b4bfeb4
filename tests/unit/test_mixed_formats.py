"""Mixed formats (issue 72, mixed precision): a quant config that keeps some linear layers' inputs unquantized
(`quant_configs/nvfp4_w4a4_down_a16.yaml`: W4A4 with down_proj at W4A16). The format is told apart from the uniform
ones it shares a layer with (export targets, the packed qlora base), its W4A4 share is counted from the model's own
layers, and an export, which writes one format for every quantized layer, refuses it by name (and takes a format
that leaves the other layers wholly unquantized)."""

from __future__ import annotations

import pytest

from qarl.config import ConfigError
from qarl.export.targets import check_target_matches, load_target
from qarl.quant import resolve_format, w4a4_share
from qarl.quant.formats import MIXED, quantizer_settings
from qarl.quant.packed import packed_bytes_per_weight

from tests.conftest import tiny_policy

MIXED_CFG = "quant_configs/nvfp4_w4a4_down_a16.yaml"


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
    assert w4a4_share(tiny_policy(task, tiny_dir, "nvfp4_w4a4").model) == 1.0
    assert w4a4_share(tiny_policy(task, tiny_dir, "nvfp4_a16").model) is None
