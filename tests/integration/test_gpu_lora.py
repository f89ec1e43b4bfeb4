"""qlora adapters in the GPU engine: served by vLLM's own LoRA with CUDA graphs, refit in place (a stale adapter in a
captured graph would be a silent bug, so this checks what the engine samples), at the parity of the same engine
serving the base alone. Needs CUDA; skipped without it."""

from __future__ import annotations

import pytest
import torch

from qarl.config import GenerationConfig, LoraConfig
from qarl.lora import lora_layers

from tests.conftest import W4A16, tiny_policy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_qlora_adapters_run_in_cuda_graphs_and_refits_reach_them(tiny_dir, task):
    from qarl.generation import VLLMEngine
    from qarl.generation.vllm_lora import VLLMAdapters
    from qarl.parity import measure

    policy = tiny_policy(task, tiny_dir, W4A16, trainable=True, dtype="bfloat16", lora=LoraConfig(mode="qlora"))
    base = tiny_policy(task, tiny_dir, W4A16, dtype="bfloat16")  # the same quantized base, no adapters
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, layer in lora_layers(policy.model):
            layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=generator) * 0.05)
    settings = GenerationConfig(max_new_tokens=8, gpu_memory_utilization=0.2, sleep_between_rollouts="off")
    engine = VLLMEngine(tiny_dir, settings, "bfloat16", 0, quant_format=policy.format, adapter_rank=16)
    assert not engine.eager and isinstance(engine.adapters, VLLMAdapters)  # graphs, vLLM's LoRA
    prompts = [policy.tokenizer(p.prompt).input_ids for p in task.eval[:16]]
    engine.refit(base.model)
    floor = measure(engine, base, prompts, max_new_tokens=8, seed=0)  # bf16, synced, no adapters
    engine.refit(policy.model)
    synced = measure(engine, policy, prompts, max_new_tokens=8, seed=0)
    assert synced.mean_abs < 2 * floor.mean_abs + 1e-3, (synced, floor)
    before = [c.token_ids for c in engine.generate(prompts, greedy=True)]

    with torch.no_grad():  # a new adapter (a large change: greedy outputs move)
        for _, layer in lora_layers(policy.model):
            layer.lora_B.mul_(-4.0)
    stale = measure(engine, policy, prompts, max_new_tokens=8, seed=0)
    timing = engine.refit(policy.model)
    adapter_bytes = sum(p.numel() * p.element_size() for _, l in lora_layers(policy.model) for p in (l.lora_A, l.lora_B))
    assert timing.bytes < 1.05 * adapter_bytes  # the base stays; only the adapter moves
    assert [c.token_ids for c in engine.generate(prompts, greedy=True)] != before
    refitted = measure(engine, policy, prompts, max_new_tokens=8, seed=0)
    assert refitted.mean_abs < stale.mean_abs / 5 and refitted.mean_abs < 2 * floor.mean_abs + 1e-3
    print(f"mean |Δ log-prob|: floor {floor.mean_abs:.3g}, qlora {synced.mean_abs:.3g}, after refit "
          f"{refitted.mean_abs:.3g}, stale {stale.mean_abs:.3g}")
    engine.close()


def test_the_adapter_survives_sleep_and_wake_and_a_refit_after_wake_reaches_it(tiny_dir, task):
    """Colocated (vLLM's level-1 sleep during each update, as training runs it): the adapter in vLLM's LoRA slot and
    the base come back from a sleep intact, and an adapter refitted after the wake is the one the graphs run."""
    from qarl.generation import VLLMEngine
    from qarl.parity import measure

    policy = tiny_policy(task, tiny_dir, W4A16, trainable=True, dtype="bfloat16", lora=LoraConfig(mode="qlora"))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, layer in lora_layers(policy.model):
            layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=generator) * 0.05)
    engine = VLLMEngine(tiny_dir, GenerationConfig(max_new_tokens=8, gpu_memory_utilization=0.2), "bfloat16", 0,
                        quant_format=policy.format, adapter_rank=16)
    assert engine.sleeps and not engine.eager
    engine.refit(policy.model)
    prompts = [policy.tokenizer(p.prompt).input_ids for p in task.eval[:16]]
    before = [c.token_ids for c in engine.generate(prompts, greedy=True)]
    synced = measure(engine, policy, prompts, max_new_tokens=8, seed=0)
    engine.sleep()
    engine.wake()
    assert [c.token_ids for c in engine.generate(prompts, greedy=True)] == before  # adapter and base came back

    with torch.no_grad():
        for _, layer in lora_layers(policy.model):
            layer.lora_B.mul_(-4.0)
    engine.sleep()  # as in a training step: asleep during the update, refit after the wake
    engine.refit(policy.model)
    assert [c.token_ids for c in engine.generate(prompts, greedy=True)] != before
    after = measure(engine, policy, prompts, max_new_tokens=8, seed=0)
    assert after.mean_abs < 2 * synced.mean_abs + 1e-3, (after, synced)
    engine.close()
