"""The Megatron backend's HF <-> Megatron converter, no Megatron processes needed: the round trip of every tensor
through its TP shards, the shapes it reads from Qwen2 / Llama / Qwen3 / Qwen3-MoE / Qwen2-MoE configs, and its
refusals. Real megatron-core models in torch.distributed processes: tests/integration/test_megatron.py."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from qarl.backends.convert import GPTShape, check_parallel, gpt_shape, hf_modules, hf_quantizers, megatron_names, \
    megatron_shards, read_hf_config, unshard
from qarl.config import ConfigError
from qarl.models.experts import split_expert_weights
from qarl.models.resolve import resolve_model_dir
from qarl.quant import resolve_format
from tests.conftest import FORMATS


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3", "qwen3moe", "qwen2moe"])
@pytest.mark.parametrize("tp", [1, 2])
def test_converter_round_trip(families, family, tp):
    """Shard every tensor for every TP rank, gather back: the Hugging Face checkpoint, bit for bit (a MoE model's
    experts by their checkpoint names, each expert's layers sharded as the dense MLP's)."""
    model_dir = resolve_model_dir(f"embedded:tiny-{family}") if family.endswith("moe") else families[family]
    shape = gpt_shape(read_hf_config(model_dir))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf = split_expert_weights(model, model.state_dict())
    per_rank = [dict(megatron_shards(shape, tp, r, hf.__getitem__)) for r in range(tp)]
    assert list(per_rank[0]) == megatron_names(shape)
    back = dict(kv for name in megatron_names(shape) for kv in unshard(name, [s[name] for s in per_rank], shape))
    expected = {k: v for k, v in hf.items() if not (shape.tied and k == "lm_head.weight")}
    assert back.keys() == expected.keys()
    assert all(torch.equal(back[k], expected[k]) for k in expected)
    if tp == 2:  # a rank holds whole query groups: q heads of the group, then its k and v
        q_rows = shape.heads_per_group * shape.head_dim
        first = per_rank[1]["decoder.layers.0.self_attention.linear_qkv.weight"][: q_rows + 2 * shape.head_dim]
        g = shape.groups // 2  # the first group rank 1 holds
        assert torch.equal(first[:q_rows], hf["model.layers.0.self_attn.q_proj.weight"][g * q_rows:(g + 1) * q_rows])
        assert torch.equal(first[q_rows:q_rows + shape.head_dim],
                           hf["model.layers.0.self_attn.k_proj.weight"][g * shape.head_dim:(g + 1) * shape.head_dim])
    if tp == 2 and shape.experts:  # expert 3's fc1 on rank 1: the second halves of its gate rows, then of its up rows
        fc1 = per_rank[1]["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"]
        half = shape.expert_ffn // 2
        gate, up = (hf[f"model.layers.1.mlp.experts.3.{p}_proj.weight"] for p in ("gate", "up"))
        assert torch.equal(fc1, torch.cat([gate[half:], up[half:]]))


def test_converter_shapes(families):
    llama, qwen3, qwen2 = (gpt_shape(read_hf_config(families[f])) for f in ("llama", "qwen3", "qwen2"))
    assert (llama.qkv_bias, llama.qk_norm, llama.tied) == (False, False, False)
    assert (qwen2.qkv_bias, qwen2.qk_norm, qwen2.tied) == (True, False, True)
    assert (qwen3.qkv_bias, qwen3.qk_norm, qwen3.head_dim) == (False, True, 32)
    assert hf_modules("decoder.layers.1.self_attention.linear_qkv") == [
        f"model.layers.1.self_attn.{p}_proj" for p in "qkv"]
    assert hf_modules("decoder.layers.0.mlp.linear_fc1") == ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"]
    assert hf_modules("output_layer") == ["lm_head"]


def test_converter_moe_shape_and_quantizer_names():
    """Qwen3-MoE's and Qwen2-MoE's shapes, and the Hugging Face quantizers of a Megatron expert: those of the fused
    experts module that transformers and ModelOpt give the HF backend (one input quantizer all experts share, a weight
    quantizer each); Qwen2-MoE's shared expert gate is a linear layer of its own."""
    shape = gpt_shape(read_hf_config(resolve_model_dir("embedded:tiny-qwen3moe")))
    assert (shape.experts, shape.topk, shape.expert_ffn, shape.norm_topk, shape.qk_norm) == (8, 2, 96, True, True)
    fc1, fc2 = (f"decoder.layers.1.mlp.experts.local_experts.5.linear_fc{i}" for i in (1, 2))
    experts = "model.layers.1.mlp.experts"
    assert hf_quantizers(fc1, "weight_quantizer") == [f"{experts}.gate_up_proj_weight_quantizers.5"]
    assert hf_quantizers(fc1, "input_quantizer") == [f"{experts}.gate_up_proj_input_quantizer"]
    assert hf_quantizers(fc2, "weight_quantizer") == [f"{experts}.down_proj_weight_quantizers.5"]
    assert hf_quantizers("decoder.layers.0.mlp.linear_fc1", "input_quantizer") == [
        "model.layers.0.mlp.gate_proj.input_quantizer", "model.layers.0.mlp.up_proj.input_quantizer"]
    assert "decoder.layers.0.mlp.linear_fc1.weight" not in megatron_names(shape)
    assert "decoder.layers.0.mlp.router.weight" in megatron_names(shape)
    assert not any("shared_experts" in n for n in megatron_names(shape))
    qwen2moe_config = read_hf_config(resolve_model_dir("embedded:tiny-qwen2moe"))
    qwen2moe = gpt_shape(qwen2moe_config)
    assert (qwen2moe.experts, qwen2moe.shared_ffn, qwen2moe.qkv_bias, qwen2moe.qk_norm) == (8, 192, True, False)
    assert not gpt_shape({**qwen2moe_config, "norm_topk_prob": False}).norm_topk
    assert hf_quantizers("decoder.layers.0.mlp.shared_experts.gate", "weight_quantizer") == [
        "model.layers.0.mlp.shared_expert_gate.weight_quantizer"]


def test_converter_moe_refusals():
    """What the Megatron MoE path does not build is refused up front, by name, with the way out."""
    config = read_hf_config(resolve_model_dir("embedded:tiny-qwen3moe"))
    with pytest.raises(ConfigError, match="model families.*'mixtral'.*Hugging Face backend"):
        gpt_shape({**config, "model_type": "mixtral"})
    with pytest.raises(ConfigError, match="dense MLP layers among the MoE ones"):
        gpt_shape({**config, "mlp_only_layers": [1]})
    shape = gpt_shape(config)  # experts 96 wide: at TP=4, 24 columns of down_proj a rank, not a multiple of 16
    with pytest.raises(ConfigError, match="block size 16 does not divide the sharded input width of down_proj"):
        check_parallel(GPTShape(**{**shape.__dict__, "groups": 4}), 4, block_size=16)
    with pytest.raises(ConfigError, match="expert MLP width \\(moe_intermediate_size\\) 96"):
        check_parallel(GPTShape(**{**shape.__dict__, "heads": 64, "groups": 64, "vocab": 640}), 64)
    check_parallel(shape, 2, block_size=16)


def test_converter_refusals(tiny_dir):
    config = read_hf_config(tiny_dir)
    with pytest.raises(ConfigError, match="model families.*'gpt2'"):
        gpt_shape({**config, "model_type": "gpt2"})
    with pytest.raises(ConfigError, match="rope_scaling"):
        gpt_shape({**config, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ConfigError, match="rope_parameters"):
        gpt_shape({**config, "rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5}})
    with pytest.raises(ConfigError, match="hidden_act=gelu"):
        gpt_shape({**config, "hidden_act": "gelu"})
    shape = gpt_shape(config)  # 4 heads, 2 query groups, vocab 128, MLP 384
    with pytest.raises(ConfigError, match="does not divide the model's query groups"):
        check_parallel(shape, 4)
    with pytest.raises(ConfigError, match="vocabulary size 129"):
        check_parallel(GPTShape(**{**shape.__dict__, "vocab": 129}), 2)
    with pytest.raises(ConfigError, match="block size 16 does not divide the sharded input width of down_proj"):
        check_parallel(GPTShape(**{**shape.__dict__, "ffn": 96, "groups": 4}), 4, block_size=16)
    check_parallel(shape, 2, block_size=16)
    # the model builder checks before torch.distributed or Megatron start
    from qarl.backends.megatron import build_megatron_model

    with pytest.raises(ConfigError, match="tensor_parallel_size=4 does not divide"):
        build_megatron_model(tiny_dir, 4, torch.float32, torch.device("cpu"), fmt=resolve_format(FORMATS[0]))
    assert not torch.distributed.is_initialized()
