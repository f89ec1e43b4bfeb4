"""The Megatron backend's HF <-> Megatron converter, no Megatron processes needed: the round trip of every tensor
through its TP shards, the shapes it reads from Qwen2 / Llama / Qwen3 configs, and its refusals. Real megatron-core
models in torch.distributed processes: tests/integration/test_megatron.py."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from qarl.backends.convert import GPTShape, check_parallel, gpt_shape, hf_modules, megatron_names, \
    megatron_shards, read_hf_config, unshard
from qarl.config import ConfigError
from qarl.quant import resolve_format
from tests.conftest import FORMATS


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3"])
@pytest.mark.parametrize("tp", [1, 2])
def test_converter_round_trip(families, family, tp):
    """Shard every tensor for every TP rank, gather back: the Hugging Face checkpoint, bit for bit."""
    model_dir = families[family]
    shape = gpt_shape(read_hf_config(model_dir))
    hf = {k: v for k, v in AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict().items()}
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


def test_converter_shapes(families):
    llama, qwen3, qwen2 = (gpt_shape(read_hf_config(families[f])) for f in ("llama", "qwen3", "qwen2"))
    assert (llama.qkv_bias, llama.qk_norm, llama.tied) == (False, False, False)
    assert (qwen2.qkv_bias, qwen2.qk_norm, qwen2.tied) == (True, False, True)
    assert (qwen3.qkv_bias, qwen3.qk_norm, qwen3.head_dim) == (False, True, 32)
    assert hf_modules("decoder.layers.1.self_attention.linear_qkv") == [
        f"model.layers.1.self_attn.{p}_proj" for p in "qkv"]
    assert hf_modules("decoder.layers.0.mlp.linear_fc1") == ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"]
    assert hf_modules("output_layer") == ["lm_head"]


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
