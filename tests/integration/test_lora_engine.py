"""LoRA against the real engine (vLLM, CPU build) and the real exports: the engine serves the adapted policy at the
floor (parity, adapter-only refits) through vLLM's own LoRA where it can (W4A16) and qarl's hooks where it cannot
(W4A4: quantized inputs), and the merged export and dequantized merge match the policy."""

from __future__ import annotations

import pytest
import torch

from qarl.config import GenerationConfig
from qarl.generation.adapters import EngineAdapters
from qarl.generation.vllm_lora import VLLMAdapters
from qarl.lora import lora_layers
from qarl.parity import measure
from tests.conftest import W4A16, eval_logits, lora_policy, tiny_policy


@pytest.fixture(scope="module")
def adapter_engine(tiny_dir):
    """An engine that serves rank-16 qlora adapters (the policies' default rank)."""
    from qarl.generation import VLLMEngine

    engine = VLLMEngine(tiny_dir, GenerationConfig(max_new_tokens=16, kv_cache_gib=1), dtype="float32", seed=0,
                        adapter_rank=16)
    yield engine
    engine.close()


def assert_at_floor(mismatch, quant_cfg: str) -> None:
    """The fp32 floor: same bits in, same rounding decisions. W4A16 holds it on every CPU. W4A4 holds it where the
    CPU's GEMM sums a row the same way whatever the number of rows; on an AMX CPU (Sapphire Rapids) 1-6 rows sum
    in another order than 7 or more, so the engine's decode steps and the policy's scoring of all tokens at once
    differ in last bits, and a few activations round to the neighbouring 4-bit value: a few tokens move by up to
    0.015, the mean stays 30x below the unsynced mismatch (3.1e-2)."""
    if quant_cfg == W4A16:
        assert mismatch.max_abs < 1e-4, mismatch
    else:
        assert mismatch.mean_abs < 1e-3 and mismatch.max_abs < 0.05, mismatch


@pytest.mark.parametrize("mode", ["qlora", "merged"])
@pytest.mark.parametrize("quant_cfg", [W4A16, "quant_configs/nvfp4_w4a4.yaml"])
def test_engine_reproduces_the_lora_policy_at_the_floor(adapter_engine, task, tiny_dir, mode, quant_cfg):
    from qarl.quant import resolve_format

    engine = adapter_engine
    policy = lora_policy(task, tiny_dir, mode, quant_cfg)
    prompts = [policy.tokenizer(p.prompt).input_ids for p in task.eval[:8]]
    engine.set_quant_format(resolve_format(quant_cfg))  # W4A4 restarts the engine with hooks, W4A16 with vLLM's LoRA
    assert isinstance(engine.adapters, VLLMAdapters if quant_cfg == W4A16 else EngineAdapters)
    layout = {name: module for name, module in engine.model.named_modules()}
    first = engine.refit(policy.model)
    assert {name: module for name, module in engine.model.named_modules()} == layout  # LoRA layers back in place
    mismatch = measure(engine, policy, prompts, max_new_tokens=16, seed=0)
    assert_at_floor(mismatch, quant_cfg)
    adapter_bytes = sum(p.numel() * 4 for _, layer in lora_layers(policy.model) for p in (layer.lora_A, layer.lora_B))
    with torch.no_grad():  # a training step changes only the adapters
        for _, layer in lora_layers(policy.model):
            layer.lora_B.mul_(1.5)
    second = engine.refit(policy.model)
    if mode == "qlora":  # the base went once; now only the adapters (and the few amax values)
        assert adapter_bytes <= second.bytes < adapter_bytes * 1.05 and first.bytes > 3 * second.bytes
    else:  # merged: every adapted weight is folded again
        assert second.bytes > 3 * adapter_bytes
    assert_at_floor(measure(engine, policy, prompts, max_new_tokens=16, seed=0), quant_cfg)
    plain = tiny_policy(task, tiny_dir, quant_cfg)  # a refit from a policy without adapters removes them
    engine.refit(plain.model)
    assert_at_floor(measure(engine, plain, prompts, max_new_tokens=16, seed=0), quant_cfg)


def test_merged_export_and_dequantized_merge_match_the_policy(task, tiny_dir, tmp_path):
    from qarl.export import export_policy, verify_export
    from qarl.export.dequantized import export_dequantized

    policy = lora_policy(task, tiny_dir, "merged")
    out = tmp_path / "merged"
    summary = export_policy(policy, "export/nvfp4_w4a16_compressed_tensors.yaml", out)
    assert summary["lora"]["adapter_dir"] is None and summary["weights_differing"] < 0.25 * summary["quantized_params"]
    report = verify_export(out, policy=policy)
    assert report["ok"] and report["loaders"]["qarl-decode"]["max_abs_logit_diff"] < 1e-4, report
    qlora = lora_policy(task, tiny_dir, "qlora")
    plain = tmp_path / "dequantized"
    export_dequantized(qlora, plain, dtype="float32")  # fp32 here so the comparison sits at the floor
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(plain)
    ids = qlora.tokenizer([p.prompt for p in task.eval[:4]], return_tensors="pt", padding=True)
    with torch.no_grad():
        assert (merged(**ids).logits - eval_logits(qlora, task)).abs().max() < 1e-4


def test_an_engine_that_merges_qlora_adapters_runs_no_lora_and_follows_each_step(task, tiny_dir):
    """`policy.generation.qlora_adapters=merged`: the engine holds Q(W) + s B A (no LoRA layer, no hook), at the fp32
    floor of the qlora policy; every refit sends the adapted layers' weights again, and the engine follows."""
    from dataclasses import replace

    from qarl.config import ConfigError, LoraConfig, PolicyConfig, load_recipe
    from qarl.generation import VLLMEngine, merges_adapters, serves_packed_base
    from qarl.quant import resolve_format

    policy = lora_policy(task, tiny_dir, "qlora", W4A16)
    prompts = [policy.tokenizer(p.prompt).input_ids for p in task.eval[:8]]
    engine = VLLMEngine(tiny_dir, GenerationConfig(max_new_tokens=16, kv_cache_gib=1), dtype="float32", seed=0,
                        quant_format=policy.format, merge_adapters=True)
    engine.refit(policy.model)
    assert not isinstance(engine.adapters, VLLMAdapters) and not engine.adapters.hooked  # no adapter computed apart
    assert_at_floor(measure(engine, policy, prompts, max_new_tokens=16, seed=0), W4A16)
    adapted = sum(layer.weight.numel() * 4 for _, layer in lora_layers(policy.model))
    with torch.no_grad():  # a training step changes the adapters: the merged weights go again
        for _, layer in lora_layers(policy.model):
            layer.lora_B.mul_(-2.0)
    assert engine.refit(policy.model).bytes >= adapted
    assert_at_floor(measure(engine, policy, prompts, max_new_tokens=16, seed=0), W4A16)
    engine.close()

    merged = PolicyConfig(lora=LoraConfig(mode="qlora"))
    merged = replace(merged, generation=replace(merged.generation, qlora_adapters="merged"))
    w4a16 = resolve_format("nvfp4_a16")
    assert merges_adapters(merged, tiny_dir, w4a16, False) and not serves_packed_base(merged, w4a16, tiny_dir)
    with pytest.raises(ConfigError, match="qlora_adapters=merged"):
        serves_packed_base(replace(merged, generation=replace(merged.generation, packed_base="on")),
                           resolve_format("nvfp4_a16"), tiny_dir)
    with pytest.raises(ConfigError, match="must be auto . lora . merged"):
        load_recipe("recipes/qlora_grpo_tiny.yaml", ["policy.generation.qlora_adapters=fused"])
    # the policy feeds its adapters the input itself: an activation format cannot merge them
    with pytest.raises(ConfigError, match="quantizes layer inputs"):
        VLLMEngine(tiny_dir, GenerationConfig(max_new_tokens=16, kv_cache_gib=1), dtype="float32", seed=0,
                   quant_format=resolve_format("nvfp4_w4a4"), merge_adapters=True)
