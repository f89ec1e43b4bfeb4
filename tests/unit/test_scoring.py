"""Chunked scoring from hidden states equals the full-vocabulary path: bit for bit where one chunk holds the
micro-batch, within fp32 rounding where the chunks split it (the head's matmul then runs on other row counts);
gradients likewise; activation checkpointing leaves the STE gradients bit for bit unchanged."""

from __future__ import annotations

import pytest
import torch

from qarl.config import LoraConfig
from qarl.distill import score_pair
from qarl.generation import Completion
from qarl.lora import AdapterDisabled
from qarl.scoring import completion_logits, score_completions, token_scores
from tests.conftest import tiny_policy

FORMATS = ["none", "quant_configs/nvfp4_w4a4.yaml"]


def _batch(policy, task, rows: int = 8) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts and completions of different lengths (padding inside the micro-batch)."""
    tok = policy.tokenizer
    prompts = [tok(p.prompt).input_ids for p in task.train[:rows]]
    return prompts, [tok(p.answer).input_ids * (1 + i % 3) for i, p in enumerate(task.train[:rows])]


def _full_vocabulary(model, prompts, completions, pad, temperature):
    logits, targets, mask = completion_logits(model, prompts, completions, pad)
    picked, entropy = token_scores(logits, targets, temperature)
    return picked * mask, entropy * mask


def _grads(model) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("quant_cfg", FORMATS)
def test_chunked_log_probs_equal_the_full_vocabulary_path(task, tiny_dir, quant_cfg):
    policy = tiny_policy(task, tiny_dir, quant_cfg, calib_size=16, trainable=True)
    prompts, completions = _batch(policy, task)
    pad = policy.tokenizer.pad_token_id
    logprobs, entropy = _full_vocabulary(policy.model, prompts, completions, pad, 0.7)
    logprobs.sum().backward()
    full_grads = _grads(policy.model)
    one = score_completions(policy.model, prompts, completions, pad, 0.7, chunk_tokens=4096)
    assert torch.equal(one.logprobs, logprobs) and torch.equal(one.entropy, entropy)  # one chunk: the same bits
    split = score_completions(policy.model, prompts, completions, pad, 0.7, chunk_tokens=5)
    torch.testing.assert_close(split.logprobs, logprobs, rtol=0, atol=5e-6)
    torch.testing.assert_close(split.entropy, entropy, rtol=0, atol=5e-6)
    assert torch.equal(split.mask, one.mask) and (split.logprobs[split.mask == 0] == 0).all()
    split.logprobs.sum().backward()
    for name, grad in _grads(policy.model).items():
        torch.testing.assert_close(grad, full_grads[name], rtol=1e-5, atol=1e-5, msg=name)


def test_activation_checkpointing_leaves_the_gradients_unchanged(task, tiny_dir):
    grads = {}
    for mode in ("off", "on"):
        policy = tiny_policy(task, tiny_dir, "quant_configs/nvfp4_w4a4.yaml", calib_size=16, trainable=True,
                             gradient_checkpointing=mode)
        assert policy.model.model.gradient_checkpointing == (mode == "on")
        prompts, completions = _batch(policy, task)
        policy.model.train()
        score_completions(policy.model, prompts, completions, policy.tokenizer.pad_token_id, 0.7,
                          chunk_tokens=7).logprobs.sum().backward()
        grads[mode] = _grads(policy.model)
    assert grads["on"].keys() == grads["off"].keys() and len(grads["on"]) > 10
    assert all(torch.equal(grads["on"][n], grads["off"][n]) for n in grads["off"])


@pytest.mark.parametrize("top_k", [0, 5])
def test_chunked_distillation_terms_equal_the_full_vocabulary_path(task, tiny_dir, top_k):
    student = tiny_policy(task, tiny_dir, "quant_configs/nvfp4_w4a4.yaml", calib_size=16, trainable=True)
    teacher = tiny_policy(task, tiny_dir)
    prompts, completions = _batch(student, task)
    batch = [Completion(p, c, [0.0] * len(c), "stop") for p, c in zip(prompts, completions)]
    pad = student.tokenizer.pad_token_id
    one = score_pair(student.model, teacher.model, batch, pad, 0.7, top_k, chunk_tokens=4096)
    split = score_pair(student.model, teacher.model, batch, pad, 0.7, top_k, chunk_tokens=3)
    for field in ("kl", "kl_full", "logprobs", "entropy"):
        torch.testing.assert_close(getattr(split, field), getattr(one, field), rtol=0, atol=5e-6, msg=field)
    one.kl.sum().backward()
    whole = _grads(student.model)
    split.kl.sum().backward()
    for name, grad in _grads(student.model).items():
        torch.testing.assert_close(grad, whole[name], rtol=1e-5, atol=1e-5, msg=name)


def test_a_lora_reference_is_scored_in_chunks_with_its_adapters_off(task, tiny_dir):
    policy = tiny_policy(task, tiny_dir, "quant_configs/nvfp4_a16.yaml", calib_size=16, trainable=True,
                         lora=LoraConfig(mode="qlora", rank=4))
    for _, param in policy.model.named_parameters():
        if param.requires_grad:  # adapters that change the output
            torch.nn.init.normal_(param, std=0.5)
    prompts, completions = _batch(policy, task)
    pad = policy.tokenizer.pad_token_id
    reference = AdapterDisabled(policy.model)
    chunked = score_completions(reference, prompts, completions, pad, 1.0, chunk_tokens=5).logprobs
    torch.testing.assert_close(chunked, _full_vocabulary(reference, prompts, completions, pad, 1.0)[0], rtol=0, atol=5e-6)
    adapted = score_completions(policy.model, prompts, completions, pad, 1.0, chunk_tokens=5).logprobs
    assert (adapted - chunked).abs().max() > 1e-3
