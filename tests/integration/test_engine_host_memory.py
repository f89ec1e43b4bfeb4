"""Host memory a rollout holds per generated token (issue 59, item 5): what grows with the batch must be a few bytes
a token, not per-token Python objects (vLLM's Logprob dicts, per-step lists kept for the whole rollout).

tracemalloc counts every Python allocation (vLLM's bookkeeping, qarl's Completions, the sampler's records); the
engine's tensors are fixed-size. Two rollouts on the session engine (tests/conftest.py), of N and 4N completions of
the same length: the extra Python memory per extra token, at the rollout's peak and in what it hands back, stays small."""

from __future__ import annotations

import gc
import tracemalloc

import torch

TOKENS = 48  # every completion runs to this length (ignore_eos)


def _rollout_bytes(engine, prompts: list[list[int]], samples: int) -> tuple[int, int, int]:
    """(Python bytes at the rollout's peak, bytes its completions hold, tokens generated), above what was live before."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        completions = engine.generate(prompts, num_samples=samples, max_new_tokens=TOKENS, seed=0, ignore_eos=True)
        gc.collect()
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    tokens = sum(len(c.token_ids) for c in completions)
    assert tokens == len(prompts) * samples * TOKENS
    return peak - before, held - before, tokens


def test_rollout_host_memory_per_token_is_a_few_bytes(engine, make_policy):
    policy = make_policy("none")
    engine.set_quant_format(None)
    engine.refit(policy.model)
    prompts = torch.randint(3, len(policy.tokenizer), (4, 12), generator=torch.Generator().manual_seed(0)).tolist()
    _rollout_bytes(engine, prompts, 2)  # warm: first-call caches are not the rollout's
    small_peak, small_held, small_tokens = _rollout_bytes(engine, prompts, 4)
    large_peak, large_held, large_tokens = _rollout_bytes(engine, prompts, 16)
    extra = large_tokens - small_tokens
    peak_per_token, held_per_token = (large_peak - small_peak) / extra, (large_held - small_held) / extra
    print(f"rollout Python memory per extra token: {peak_per_token:.0f} B at the peak, {held_per_token:.0f} B held "
          f"by the completions ({small_tokens} -> {large_tokens} tokens)")
    # a completion's token id and log-prob as Python ints and floats in lists: ~70 B a token; vLLM's bookkeeping of
    # a token while it runs is of the same order. Asking vLLM for the log-probs (its FlatLogprobs, not the sampler's
    # records) costs ~90 B a token more at the peak; a Logprob object in a dict per token far more.
    assert held_per_token < 120, held_per_token
    assert peak_per_token < 300, peak_per_token  # measured 233 B; vLLM returning FlatLogprobs instead: 324 B
