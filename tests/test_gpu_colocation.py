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
    from qarl.policy import score_completions

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
