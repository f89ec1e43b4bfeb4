"""Mixture-of-Experts rollouts on a GPU: vLLM computes the experts with its fused MoE kernel (Triton) from
`w13_weight` / `w2_weight`, under CUDA graphs; a refit must write the policy's quantized experts into those very
tensors, in place. Needs CUDA; skipped without it."""

from __future__ import annotations

import pytest
import torch

from qarl.config import GenerationConfig
from qarl.models.resolve import resolve_model_dir

from tests.conftest import tiny_policy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("family", ["qwen3moe", "qwen2moe"])
def test_a_refit_reaches_the_fused_experts_under_cuda_graphs(task, family):
    from qarl.generation import VLLMEngine
    from qarl.generation import vllm_compat
    from qarl.parity import measure
    from qarl.scoring import score_completions

    model_dir = resolve_model_dir(f"embedded:tiny-{family}")
    policy = tiny_policy(task, model_dir, "nvfp4_a16")
    settings = GenerationConfig(max_new_tokens=8, gpu_memory_utilization=0.2, sleep_between_rollouts="off")
    engine = VLLMEngine(model_dir, settings, "float32", 0, quant_format=policy.format)
    assert not engine.eager and not vllm_compat.experts_in_changed_layout(engine.model)
    experts = {name: (m.w13_weight, m.w2_weight) for name, m in vllm_compat.expert_layers(engine.model).items()}
    pointers = {name: (a.data_ptr(), b.data_ptr()) for name, (a, b) in experts.items()}
    assert len(experts) == 2
    engine.refit(policy.model)
    prompts = [policy.tokenizer(p.prompt).input_ids for p in task.eval[:16]]
    before = [c.token_ids for c in engine.generate(prompts, greedy=True)]
    synced = measure(engine, policy, prompts, max_new_tokens=8, seed=0)
    assert synced.mean_abs < 5e-2  # Triton's experts are other kernels than transformers' (the floor: `qarl parity`)

    optimizer = torch.optim.SGD(policy.model.parameters(), lr=5.0)  # a large step: greedy outputs change
    scores = score_completions(policy.model, prompts, before, policy.tokenizer.pad_token_id)
    scores.logprobs.sum().backward()
    optimizer.step()
    stale = measure(engine, policy, prompts, max_new_tokens=8, seed=0)
    engine.refit(policy.model)
    assert [c.token_ids for c in engine.generate(prompts, greedy=True)] != before
    assert measure(engine, policy, prompts, max_new_tokens=8, seed=0).mean_abs < stale.mean_abs / 5
    # written in place: the captured graphs read these tensors
    assert {name: (a.data_ptr(), b.data_ptr()) for name, (a, b) in experts.items()} == pointers
    engine.close()
