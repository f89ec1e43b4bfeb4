"""The engine's packed qlora base (`policy.generation.packed_base`, qarl/generation/packed_base.py): when it is used
and refused, the checkpoint it is written as, and refits that never send a packed weight. vLLM's CPU platform has no
NVFP4 kernel, so the CPU engine here starts from the plain model directory told which weights it holds packed: what
is tested is the refit's side (tests/integration/test_gpu_packed_base.py runs vLLM's FP4 Marlin kernel on a GPU)."""

from __future__ import annotations

import json
import shutil
import weakref
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from qarl.config import ConfigError, GenerationConfig, LoraConfig, PolicyConfig
from qarl.generation import PackedBase, VLLMEngine, serves_packed_base
from qarl.quant import resolve_format
from qarl.run import write_packed_base
from tests.conftest import W4A16, lora_policy

QLORA = PolicyConfig(lora=LoraConfig(mode="qlora"))


def decided(mode: str, fmt: str = "nvfp4_a16", **policy) -> bool:
    cfg = replace(QLORA, generation=replace(QLORA.generation, packed_base=mode), **policy)
    return serves_packed_base(cfg, resolve_format(fmt), "embedded:tiny")


def engine_weight(engine: VLLMEngine, name: str) -> torch.Tensor:
    """An engine weight by its name in vLLM's model, whether or not a LoRA layer wraps its layer."""
    return next(p for n, p in engine.model.named_parameters() if n.replace(".base_layer", "") == name)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's answers")
def test_auto_keeps_the_folded_base_where_it_cannot_pack_and_on_refuses_naming_why(tmp_path):
    assert decided("auto") is False and decided("off") is False
    with pytest.raises(ConfigError, match="CPU platform has no weight-only NVFP4 kernel"):
        decided("on")
    with pytest.raises(ConfigError, match="not NVFP4 W4A16"):
        decided("on", "fp8_w8a8")
    mse = tmp_path / "nvfp4_a16_mse.yaml"  # static block scales: the policy keeps such a base unpacked
    mse.write_text(Path("quant_configs/nvfp4_a16.yaml").read_text().replace("algorithm: max", "algorithm: mse"))
    with pytest.raises(ConfigError, match="calibrates with mse"):
        decided("on", str(mse))
    with pytest.raises(ConfigError, match="only a qlora base is frozen"):
        decided("on", lora=LoraConfig(mode="merged"))
    with pytest.raises(ConfigError, match="pack_base=false"):
        decided("on", lora=LoraConfig(mode="qlora", pack_base=False))
    with pytest.raises(ConfigError, match="choose one of"):
        decided("sometimes")


def test_refits_never_send_a_packed_weight_and_the_engine_serves_one_policy(task, tiny_dir, tmp_path):
    policy = lora_policy(task, tiny_dir, "qlora", W4A16)
    base = write_packed_base(policy, tmp_path / "engine_base")
    quantized = {n for n, m in policy.model.named_modules() if getattr(getattr(m, "weight_quantizer", None),
                                                                       "is_enabled", False)}
    # each packed layer's weight and bias (Qwen2's q/k/v have one: vLLM reorders it for its kernel), no adapter
    held = {n for n, _ in policy.model.named_parameters() if n.rpartition(".")[0] in quantized and "lora_" not in n}
    assert base.packed == held and {n.rpartition(".")[2] for n in held} == {"weight", "bias"}
    assert base.source() is policy.model
    config = json.loads((base.model_dir / "config.json").read_text())
    assert config["quantization_config"]["quant_algo"] == "W4A16_NVFP4"

    # the CPU engine starts from the plain weights, told they are the packed ones
    plain = tmp_path / "plain"
    shutil.copytree(tiny_dir, plain)
    packed = PackedBase(plain, base.packed, weakref.ref(policy.model))
    engine = VLLMEngine(tiny_dir, GenerationConfig(max_new_tokens=8, kv_cache_gib=1), "float32", 0,
                        quant_format=policy.format, adapter_rank=16, packed_base=packed)
    qkv = engine_weight(engine, "model.layers.0.self_attn.qkv_proj.weight")
    as_loaded = qkv.detach().clone()
    timing = engine.refit(policy.model)
    assert torch.equal(qkv, as_loaded)  # the packed weights are the engine's own: no refit writes them
    sent = {n: p for n, p in policy.model.named_parameters() if n not in base.packed}
    assert 0 < timing.bytes <= sum(p.numel() * 4 for p in sent.values())  # the rest of the model and the adapters
    norm = engine_weight(engine, "model.layers.0.input_layernorm.weight")
    with torch.no_grad():  # a frozen weight that changes (QeRL's noise on the norms) is still sent
        policy.model.model.layers[0].input_layernorm.weight.mul_(1.5)
    engine.refit(policy.model)
    assert torch.equal(norm, policy.model.model.layers[0].input_layernorm.weight)

    other = lora_policy(task, tiny_dir, "qlora", W4A16)
    with pytest.raises(ConfigError, match="packed base of another policy model"):
        engine.refit(other.model)
    with pytest.raises(ConfigError, match="cannot change to unquantized"):
        engine.set_quant_format(None)
    assert not plain.exists()  # the engine's checkpoint is deleted once vLLM has loaded it
    engine.close()


def test_a_moe_base_is_written_expert_by_expert_and_its_fused_experts_are_held(task, tmp_path):
    """The engine's packed MoE base: each expert's gate, up and down in the checkpoint; the engine holds the policy's
    fused expert parameters as loaded (the MoE engine itself: tests/integration/test_gpu_packed_base.py)."""
    from qarl.models.resolve import resolve_model_dir

    policy = lora_policy(task, resolve_model_dir("embedded:tiny-qwen3moe"), "qlora", W4A16)
    base = write_packed_base(policy, tmp_path / "engine_base")
    layers = json.loads((base.model_dir / "qarl_export.json").read_text())["layers"]
    assert {"model.layers.1.mlp.experts.7.gate_proj", "model.layers.1.mlp.experts.7.up_proj"} <= set(layers)
    experts = {f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("gate_up_proj", "down_proj")}
    attention = {f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(2) for p in "qkvo"}
    assert base.packed == experts | attention
