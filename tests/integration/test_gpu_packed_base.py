"""The packed qlora base in the GPU engine (qarl/generation/packed_base.py): vLLM serves the policy's NVFP4 W4A16
base from its 4-bit codes with its FP4 Marlin kernel, under CUDA graphs, with the adapters in vLLM's LoRA; its
log-probs sit at the bf16 floor of the engine that holds the base folded. Needs CUDA; skipped without it."""

from __future__ import annotations

import pytest
import torch

from qarl.config import GenerationConfig, LoraConfig
from qarl.lora import lora_layers
from qarl.metrics import storage_bytes

from tests.conftest import W4A16, tiny_policy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_the_engine_serves_the_packed_base_at_the_folded_engines_parity(task, tmp_path):
    """A dense model (`packed_base_blocker` keeps MoE models folded)."""
    from qarl.generation import VLLMEngine
    from qarl.generation.vllm_lora import VLLMAdapters
    from qarl.models.resolve import resolve_model_dir
    from qarl.parity import measure
    from qarl.run import write_packed_base

    tiny_dir = resolve_model_dir("embedded:tiny")
    policy = tiny_policy(task, tiny_dir, W4A16, trainable=True, dtype="bfloat16", lora=LoraConfig(mode="qlora"))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, layer in lora_layers(policy.model):
            layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=generator) * 0.05)
    prompts = [policy.tokenizer(p.prompt).input_ids for p in task.eval[:16]]
    settings = GenerationConfig(max_new_tokens=8, gpu_memory_utilization=0.2, sleep_between_rollouts="off")

    folded = VLLMEngine(tiny_dir, settings, "bfloat16", 0, quant_format=policy.format, adapter_rank=16)
    folded.refit(policy.model)
    floor = measure(folded, policy, prompts, max_new_tokens=8, seed=0)  # the base folded in bf16
    folded_bytes = storage_bytes([*folded.model.parameters(), *folded.model.buffers()])
    folded.close()

    base = write_packed_base(policy, tmp_path / "engine_base")
    engine = VLLMEngine(tiny_dir, settings, "bfloat16", 0, quant_format=policy.format, adapter_rank=16,
                        packed_base=base)
    assert not engine.eager and isinstance(engine.adapters, VLLMAdapters)  # graphs, vLLM's LoRA
    quantized = sum(p.numel() for n, p in policy.model.named_parameters() if n in base.packed)
    engine_bytes = storage_bytes([*engine.model.parameters(), *engine.model.buffers()])
    # the quantized weights at <= 0.6 bytes each instead of 2 (the rest, embeddings and norms, as folded)
    assert engine_bytes <= folded_bytes - quantized * (2 - 0.6), (engine_bytes, folded_bytes, quantized)
    timing = engine.refit(policy.model)
    adapter_bytes = sum(p.numel() * p.element_size() for _, l in lora_layers(policy.model) for p in (l.lora_A, l.lora_B))
    packed = measure(engine, policy, prompts, max_new_tokens=8, seed=0)
    print(f"mean |dlogp| folded {floor.mean_abs:.3e} packed {packed.mean_abs:.3e}; engine weights "
          f"{engine_bytes / 2**20:.1f} MiB (folded {folded_bytes / 2**20:.1f}); first refit {timing.bytes} bytes")
    assert packed.mean_abs < 2 * floor.mean_abs + 1e-3, (packed, floor)

    with torch.no_grad():  # a training step changes the adapters only; the refit sends just them
        for _, layer in lora_layers(policy.model):
            layer.lora_B.mul_(-4.0)
    stale = measure(engine, policy, prompts, max_new_tokens=8, seed=0)
    timing = engine.refit(policy.model)
    assert timing.bytes == adapter_bytes
    assert measure(engine, policy, prompts, max_new_tokens=8, seed=0).mean_abs < stale.mean_abs / 5
    engine.close()
    assert not base.model_dir.exists()
