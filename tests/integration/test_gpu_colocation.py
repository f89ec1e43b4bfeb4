"""Colocation on one GPU: the engine sleeps while the policy trains and wakes for the rollout. A stale or
lost weight after a wake-up is a silent bug, so this checks what the engine samples. Needs CUDA (vLLM's
sleep mode); skipped without it."""

from __future__ import annotations

import pytest
import torch

from qarl.config import GenerationConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_sleep_frees_memory_and_wake_restores_the_engine(tiny_dir, task, make_policy):
    from qarl.generation import VLLMEngine
    from qarl.parity import measure
    from qarl.scoring import score_completions

    policy = make_policy("nvfp4_a16")
    engine = VLLMEngine(tiny_dir, GenerationConfig(max_new_tokens=8, gpu_memory_utilization=0.2), "float32", 0,
                        quant_format=policy.format)
    assert engine.sleeps and not engine.eager  # "auto" on a GPU: colocated, with CUDA graphs
    engine.refit(policy.model)
    prompts = [policy.tokenizer(p.prompt).input_ids for p in task.eval[:16]]
    before = [c.token_ids for c in engine.generate(prompts, greedy=True)]

    free_awake = torch.cuda.mem_get_info()[0]
    engine.sleep()
    assert torch.cuda.mem_get_info()[0] - free_awake > 2**30  # the KV cache (and weights) went away
    engine.wake()
    assert [c.token_ids for c in engine.generate(prompts, greedy=True)] == before  # weights came back intact

    optimizer = torch.optim.SGD(policy.model.parameters(), lr=5.0)  # a large step: greedy outputs change
    scores = score_completions(policy.model, prompts, before, policy.tokenizer.pad_token_id)
    (scores.logprobs.sum()).backward()
    optimizer.step()
    engine.sleep()  # as in a training step: asleep during the update, refit after the wake
    engine.refit(policy.model)
    assert [c.token_ids for c in engine.generate(prompts, greedy=True)] != before
    # the refitted engine is the updated policy (the GPU's fp32 floor is ~1e-3: TF32)
    assert measure(engine, policy, prompts, max_new_tokens=8, seed=0).max_abs < 1e-2
    engine.close()


@pytest.mark.parametrize("fmt", ["quant_configs/nvfp4_a16.yaml", "quant_configs/nvfp4_w4a4.yaml"])
def test_shared_weights_stay_through_sleep_and_a_step_reaches_the_graphs(tiny_dir, task, fmt):
    """bf16 with fp32 masters (the GPU default): the policy trains with the engine's weights while the engine
    sleeps, so the sleep releases only the KV cache; the steps reach the captured graphs without a copy, and
    the engine then samples exactly what a plain copy refit gives it."""
    from qarl.generation import VLLMEngine
    from qarl.parity import measure

    from tests.conftest import answer_loss
    from tests.integration.test_shared_weights import _copied_refit, _greedy, _in_engine, _trainable

    policy, optimizer = _trainable(task, tiny_dir, fmt)
    engine = VLLMEngine(tiny_dir, GenerationConfig(max_new_tokens=8, gpu_memory_utilization=0.2), "bfloat16", 0,
                        quant_format=policy.format)
    assert engine.sleeps and not engine.eager
    first = engine.refit(policy.model)
    assert all(_in_engine(engine, p) for p in policy.model.parameters())
    before = _greedy(engine, policy, task)
    engine.sleep()
    engine.wake()
    assert _greedy(engine, policy, task) == before  # the KV cache came back in working order

    free_awake = torch.cuda.mem_get_info()[0]
    engine.sleep()
    assert engine._asleep == "kv_cache"
    assert torch.cuda.mem_get_info()[0] - free_awake > 2**30  # the KV cache went away
    for _ in range(2):  # the update, on the engine's weights
        optimizer.backward(answer_loss(policy, task))
        optimizer.step()
    engine.wake()
    second = engine.refit(policy.model)
    assert second.shared_bytes == sum(p.numel() * p.element_size() for p in policy.model.parameters())
    assert second.bytes == first.bytes - second.shared_bytes  # the input amax alone
    after = _greedy(engine, policy, task)
    assert after != before
    prompts = [policy.tokenizer(p.prompt).input_ids for p in task.eval[:8]]
    assert measure(engine, policy, prompts, max_new_tokens=8, seed=0).mean_abs < 5e-2  # the engine is the policy
    _copied_refit(engine, policy)
    assert _greedy(engine, policy, task) == after
    engine.close()
    answer_loss(policy, task).backward()  # the policy's weights outlive the engine
