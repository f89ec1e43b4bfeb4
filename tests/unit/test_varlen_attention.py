"""Packed micro-batches through torch's varlen flash attention: on the GPU the kernel computes causal attention within
each sequence (grouped-query heads included) as SDPA does one sequence at a time, and packed scores equal padded ones
to bf16 rounding; everywhere, a call the kernel does not serve (CPU, padded rows) is SDPA's, bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from qarl.models import varlen_attention
from qarl.models.varlen_attention import (ATTENTION, enable_varlen_attention, mask_needed, serves,
                                          varlen_attention_forward, varlen_available, varlen_causal)
from qarl.scoring import score_completions
from tests.conftest import tiny_policy

GPU = pytest.mark.skipif(not (torch.cuda.is_available() and varlen_available()), reason="needs a CUDA GPU")


def _batch(policy, task, rows: int = 8) -> tuple[list[list[int]], list[list[int]]]:
    tok = policy.tokenizer
    prompts = [tok(p.prompt).input_ids for p in task.train[:rows]]
    return prompts, [tok(p.answer).input_ids * (1 + i % 3) for i, p in enumerate(task.train[:rows])]


def _grads(model) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _scores_and_grads(policy, prompts, completions, pack: bool):
    scores = score_completions(policy.model, prompts, completions, policy.tokenizer.pad_token_id, 0.7,
                               chunk_tokens=6, pack=pack)
    (scores.logprobs * scores.mask).sum().backward()
    return scores.logprobs.detach(), _grads(policy.model)


def test_calls_the_kernel_does_not_serve_are_sdpa_bit_for_bit(task, tiny_dir):
    """On the CPU (and for padded rows or fp32 anywhere) the registered function is SDPA: the same log-probs and
    gradients, packed and padded, as the model computes on SDPA."""
    if not varlen_available():
        pytest.skip("this torch has no varlen_attn")
    policy = tiny_policy(task, tiny_dir, "quant_configs/nvfp4_a16.yaml", calib_size=16, trainable=True)
    policy.model.set_attn_implementation("sdpa")  # on a GPU the load switched it already (qarl/backends/hf.py)
    prompts, completions = _batch(policy, task)
    before = {pack: _scores_and_grads(policy, prompts, completions, pack) for pack in (False, True)}
    assert enable_varlen_attention(policy.model)
    assert policy.model.config._attn_implementation == ATTENTION
    assert not enable_varlen_attention(policy.model)  # only a model on SDPA is switched
    for pack in (False, True):
        logprobs, grads = _scores_and_grads(policy, prompts, completions, pack)
        assert torch.equal(logprobs, before[pack][0])
        assert grads.keys() == before[pack][1].keys()
        assert all(torch.equal(g, before[pack][1][n]) for n, g in grads.items())


def test_no_mask_is_built_only_where_every_layer_attends_without_one(task, tiny_dir):
    """One unpadded row on CUDA in bf16/fp16 of a model without sliding windows, soft-capping or attention dropout
    needs no mask (packed: varlen; alone: SDPA's causal kernel); anything else gets SDPA's."""
    config = tiny_policy(task, tiny_dir).model.config
    assert not mask_needed(1, None, torch.bfloat16, "cuda", config)
    assert not mask_needed(1, None, torch.float16, torch.device("cuda", 0), config)
    assert mask_needed(2, None, torch.bfloat16, "cuda", config)  # rows of a batch
    assert mask_needed(1, torch.ones(1, 4), torch.bfloat16, "cuda", config)  # padding
    assert mask_needed(1, None, torch.float32, "cuda", config)
    assert mask_needed(1, None, torch.bfloat16, "cpu", config)
    for key, value in (("sliding_window", 64), ("attn_logit_softcapping", 50.0), ("attention_dropout", 0.1)):
        changed = copy.deepcopy(config)
        setattr(changed, key, value)
        assert mask_needed(1, None, torch.bfloat16, "cuda", changed), key


def test_packed_rows_without_a_mask_the_kernel_cannot_serve_are_refused():
    """Never SDPA over several packed sequences without their mask: that would attend across them."""
    q, k, v = (torch.randn(1, 2, 6, 8) for _ in range(3))  # CPU fp32: the kernel does not serve it
    boundaries = {"cu_seq_lens_q": torch.tensor([0, 2, 6]), "max_length_q": 4}
    with pytest.raises(RuntimeError, match="max_tokens_per_micro_batch=0"):
        varlen_attention_forward(torch.nn.Module(), q, k, v, None, **boundaries)
    lone = {"cu_seq_lens_q": torch.tensor([0, 6]), "max_length_q": 6}  # one sequence: SDPA's causal kernel is right
    out, _ = varlen_attention_forward(torch.nn.Module(), q, k, v, None, **lone)
    assert out.shape == (1, 6, 2, 8)


@GPU
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_kernel_is_causal_within_each_sequence_with_grouped_heads(dtype):
    torch.manual_seed(0)
    lengths, heads, kv_heads, dim = [5, 130, 1, 64], 8, 2, 64
    q, k, v = (torch.randn(sum(lengths), h, dim, device="cuda", dtype=dtype, requires_grad=True)
               for h in (heads, kv_heads, kv_heads))
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0)
    out = varlen_causal(q, k, v, cu, max(lengths), dim ** -0.5)
    grad_out = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad_out)
    expected = torch.cat([F.scaled_dot_product_attention(
        q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1), is_causal=True, enable_gqa=True
    ).transpose(0, 1) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())])
    want = torch.autograd.grad(expected, (q, k, v), grad_out)
    tol = {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(out, expected, **tol)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **tol)


@GPU
def test_sliding_window_layers_are_not_served():
    """A layer's window, passed in the call or only held by the layer (Qwen2-MoE puts it in the mask alone), keeps
    the call on SDPA with its mask."""
    query = torch.zeros(1, 2, 6, 8, device="cuda", dtype=torch.bfloat16)
    packed = {"cu_seq_lens_q": torch.tensor([0, 2, 6], device="cuda")}
    full, sliding = torch.nn.Module(), torch.nn.Module()
    sliding.sliding_window = 4
    assert serves(full, query, 0.0, packed)
    assert not serves(sliding, query, 0.0, packed)
    assert not serves(full, query, 0.0, {**packed, "sliding_window": 4})
    assert not serves(full, query, 0.1, packed) and not serves(full, query.float(), 0.0, packed)


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm().clamp(min=1e-12)).item()


@GPU
def test_packed_scores_through_varlen_are_as_close_to_fp32_as_padded_ones(task, tiny_dir, monkeypatch):
    """A bf16 policy on the GPU runs packed micro-batches through varlen (counted), and its packed log-probs and
    gradients are as close to the fp32 model's (SDPA, padded) as its padded bf16 ones: bf16 rounding, no more."""
    fp32 = tiny_policy(task, tiny_dir, trainable=True)
    prompts, completions = _batch(fp32, task)
    reference = _scores_and_grads(fp32, prompts, completions, pack=False)
    policy = tiny_policy(task, tiny_dir, trainable=True, dtype="bfloat16", gradient_checkpointing="off")
    assert policy.model.config._attn_implementation == ATTENTION  # switched on load (qarl/backends/hf.py)
    calls = []
    kernel = varlen_attention.varlen_causal
    monkeypatch.setattr(varlen_attention, "varlen_causal", lambda *a: calls.append(1) or kernel(*a))
    padded = _scores_and_grads(policy, prompts, completions, pack=False)
    assert not calls
    packed = _scores_and_grads(policy, prompts, completions, pack=True)
    assert len(calls) == policy.model.config.num_hidden_layers
    assert _relative_error(packed[0], reference[0]) <= 2 * _relative_error(padded[0], reference[0]) + 1e-3
    assert packed[1].keys() == reference[1].keys()
    for name, want in reference[1].items():
        assert _relative_error(packed[1][name], want) <= 2 * _relative_error(padded[1][name], want) + 1e-3, name

