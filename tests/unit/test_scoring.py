"""Chunked scoring from hidden states equals the full-vocabulary path: bit for bit on the CPU where one chunk holds
the micro-batch, within fp32 rounding where the chunks split it (the head's matmul then runs on other row counts);
gradients likewise; activation checkpointing leaves the STE gradients bit for bit unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qarl.backends.exact_forward import EngineOp, ExactCausalLM, autograd_of
from qarl.config import LoraConfig, TrainerConfig
from qarl.distill import score_pair
from qarl.generation import Completion
from qarl.grpo import grpo_loss, sequence_weights
from qarl.lora import AdapterDisabled
from qarl.quant import linear_weight
from qarl.scoring import LinearHeadScores, completion_logits, in_chunks, micro_batches, score_completions, token_scores
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
    if logprobs.device.type == "cpu":  # one chunk: the same bits (cuBLAS may pick another kernel for the gathered rows)
        assert torch.equal(one.logprobs, logprobs) and torch.equal(one.entropy, entropy)
    torch.testing.assert_close(one.logprobs, logprobs, rtol=0, atol=5e-6)
    torch.testing.assert_close(one.entropy, entropy, rtol=0, atol=5e-6)
    split = score_completions(policy.model, prompts, completions, pad, 0.7, chunk_tokens=5)
    torch.testing.assert_close(split.logprobs, logprobs, rtol=0, atol=5e-6)
    torch.testing.assert_close(split.entropy, entropy, rtol=0, atol=5e-6)
    assert torch.equal(split.mask, one.mask) and (split.logprobs[split.mask == 0] == 0).all()
    split.logprobs.sum().backward()
    for name, grad in _grads(policy.model).items():
        torch.testing.assert_close(grad, full_grads[name], rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("quant_cfg", FORMATS)
def test_the_linear_head_path_gives_the_generic_chunks_values_bit_for_bit(task, tiny_dir, quant_cfg):
    """LinearHeadScores (a plain or lean quantized head) against the head called chunk by chunk under checkpoint
    (the path of any other head): the same log-probs and entropy bit for bit, gradients within fp32 rounding."""
    policy = tiny_policy(task, tiny_dir, quant_cfg, calib_size=16, trainable=True)
    head = policy.model.get_output_embeddings()
    assert linear_weight(head) is head.weight  # the head's quantizers are disabled in every shipped format
    prompts, completions = _batch(policy, task)
    pad = policy.tokenizer.pad_token_id
    scores = {}
    for path in ("generic", "linear"):
        if path == "generic":  # a hook on the head: it is called as a module, chunk by chunk
            handle = head.register_forward_hook(lambda module, args, output: None)
            assert linear_weight(head) is None
        scores[path] = score_completions(policy.model, prompts, completions, pad, 0.7, chunk_tokens=5)
        scores[path].logprobs.sum().backward()
        scores[path].grads = _grads(policy.model)
        if path == "generic":
            handle.remove()
    generic, linear = scores["generic"], scores["linear"]
    assert torch.equal(linear.logprobs, generic.logprobs) and torch.equal(linear.entropy, generic.entropy)
    assert not linear.entropy.requires_grad
    assert linear.grads.keys() == generic.grads.keys() and len(linear.grads) > 10  # the head tied to the embedding
    for name, grad in linear.grads.items():  # fp32 rounding: the log-softmax's gradient formed in separate steps
        assert (grad - generic.grads[name]).abs().max() <= 1e-5 * grad.abs().max(), name
    with torch.no_grad():  # scoring without grad takes the same path
        assert torch.equal(score_completions(policy.model, prompts, completions, pad, 0.7, chunk_tokens=5).logprobs,
                           linear.logprobs)
    if quant_cfg != "none":  # ModelOpt's own forward (the weight cache off) takes the same path; a quantized head not
        uncached = tiny_policy(task, tiny_dir, quant_cfg, calib_size=16, quant_weight_cache=False)
        assert linear_weight(uncached.model.get_output_embeddings()) is uncached.model.get_output_embeddings().weight
        head.weight_quantizer.enable()
        assert linear_weight(head) is None


PICKS: list[int] = []  # the rows of each call of `_picked_in_logits_dtype`


def _picked_in_logits_dtype(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """A stand-in for the exact forward's sampler kernel (`qarl_token_logprobs`): its own bits (the log-softmax in
    the logits' dtype, as the engine's sampler computes it), the gradient of the fp32 reference (`EngineOp`)."""
    PICKS.append(logits.shape[0])

    def kernel(x: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(x / temperature, dim=-1).gather(-1, targets[:, None]).squeeze(-1).float()

    def reference(x: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(x.float() / temperature, dim=-1).gather(-1, targets[:, None]).squeeze(-1)

    return EngineOp.apply(kernel, autograd_of(reference), logits)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_picking_kernel_scored_by_the_linear_head_path_keeps_its_bits(fused, dtype):
    """The exact forward's scoring (`LinearHeadScores` with its sampler kernel as `pick`) against the path it had,
    autograd's checkpointed chunks of `token_scores`: the kernel's log-probs bit for bit; the entropy (sum p (lse - z)
    rather than -sum p log p) and the gradients of states and head (from the forward's lse) within rounding, eager
    and compiled (`fused`); the kernel runs once a chunk, not again in the backward."""
    g = torch.Generator().manual_seed(0)
    states = torch.randn(37, 16, generator=g).to(dtype)
    weight = (torch.randn(50, 16, generator=g) / 4).to(dtype)
    targets = torch.randint(0, 50, (37,), generator=g)
    grad_out = torch.randn(37, generator=g)
    found = {}
    for path in ("chunks", "linear"):
        PICKS.clear()
        s, w = states.clone().requires_grad_(), weight.clone().requires_grad_()
        if path == "chunks":
            picked, entropy = in_chunks(lambda x, t: token_scores(F.linear(x, w), t, 0.7, _picked_in_logits_dtype),
                                        8, s, targets)
        else:
            picked, entropy = LinearHeadScores.apply(s, w, targets, 0.7, 8, fused, _picked_in_logits_dtype)
        (picked * grad_out).sum().backward()
        found[path] = picked.detach(), entropy, s.grad, w.grad
        assert sorted(PICKS) == sorted([8, 8, 8, 8, 5] * (1 if path == "linear" else 2))  # checkpoints run again
    (picked, entropy, grad_s, grad_w), (want_picked, want_entropy, want_s, want_w) = found["linear"], found["chunks"]
    assert torch.equal(picked, want_picked) and not entropy.requires_grad
    torch.testing.assert_close(entropy, want_entropy, rtol=1e-5, atol=1e-5)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # the gradient cast to the logits' dtype before the matmuls
    for got, want in ((grad_s, want_s), (grad_w, want_w)):
        assert (got.float() - want.float()).abs().max() <= tolerance * want.float().abs().max()


def test_a_model_with_a_picking_kernel_is_scored_by_the_linear_head_path_where_its_head_is_plain(task, tiny_dir):
    """`score_completions` of a model with its own body, head and sampler kernel, as the exact forward's: through
    `LinearHeadScores` (the kernel called once a chunk) where `qarl_head_weight` names a weight, else through
    autograd's checkpointed chunks (twice); the same log-probs either way."""
    policy = tiny_policy(task, tiny_dir, "none", trainable=True)
    model, head = policy.model, policy.model.get_output_embeddings()
    decoder = model.get_decoder()
    model.qarl_body_and_head = lambda: (
        lambda input_ids, attention_mask=None, prompt_lengths=None, **unused: decoder(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=False), head)
    model.qarl_token_logprobs = _picked_in_logits_dtype
    prompts, completions = _batch(policy, task)
    found = {}
    for plain in (True, False):
        model.qarl_head_weight = lambda: head.weight if plain else None
        PICKS.clear()
        scores = score_completions(model, prompts, completions, policy.tokenizer.pad_token_id, 0.7, chunk_tokens=5)
        scores.logprobs.sum().backward()
        chunks = -(-int(scores.mask.sum()) // 5)
        assert len(PICKS) == chunks * (1 if plain else 2)
        found[plain] = scores.logprobs.detach(), head.weight.grad.clone()
        model.zero_grad()
    assert torch.equal(found[True][0], found[False][0])
    assert (found[True][1] - found[False][1]).abs().max() <= 1e-5 * found[False][1].abs().max()  # fp32 rounding


def test_the_exact_forward_names_its_head_weight_where_the_head_is_a_plain_matmul(task, tiny_dir):
    """`qarl_head_weight`: the head's weight where the exact head is exactly F.linear with it (every shipped format
    leaves the head unquantized), None where it quantizes (scored through autograd's chunks, as before)."""
    policy = tiny_policy(task, tiny_dir, "quant_configs/nvfp4_w4a4.yaml", calib_size=16)
    head = policy.model.get_output_embeddings()
    assert ExactCausalLM.qarl_head_weight(policy.model) is head.weight
    head.input_quantizer.enable()
    assert ExactCausalLM.qarl_head_weight(policy.model) is None


@pytest.mark.parametrize("mode", ["qlora", "merged"])
def test_a_head_with_adapters_is_called_as_a_module(task, tiny_dir, mode):
    lora = LoraConfig(mode=mode, target_modules=["q_proj", "lm_head"])
    head = tiny_policy(task, tiny_dir, "quant_configs/nvfp4_a16.yaml", calib_size=16, trainable=True,
                       lora=lora).model.get_output_embeddings()
    assert hasattr(head, "lora_A") and linear_weight(head) is None


def test_a_head_that_adds_a_bias_or_computes_its_own_way_is_called_as_a_module():
    biased = torch.nn.Linear(4, 6)
    assert linear_weight(biased) is None and linear_weight(torch.nn.Linear(4, 6, bias=False)) is not None
    compiled, patched = torch.nn.Linear(4, 6, bias=False), torch.nn.Linear(4, 6, bias=False)
    compiled.compile()
    patched.forward = lambda x: 2 * x
    assert linear_weight(compiled) is None and linear_weight(patched) is None
    assert linear_weight(lambda states: states) is None  # not a module (the exact forward's head)


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


@pytest.mark.parametrize("top_k,forward_weight", [(0, 0.0), (5, 0.0), (5, 0.5)])
def test_chunked_distillation_terms_equal_the_full_vocabulary_path(task, tiny_dir, top_k, forward_weight):
    student = tiny_policy(task, tiny_dir, "quant_configs/nvfp4_w4a4.yaml", calib_size=16, trainable=True)
    teacher = tiny_policy(task, tiny_dir)
    prompts, completions = _batch(student, task)
    batch = [Completion(p, c, [0.0] * len(c), "stop") for p, c in zip(prompts, completions)]
    pad = student.tokenizer.pad_token_id
    one = score_pair(student.model, teacher.model, batch, pad, 0.7, top_k, chunk_tokens=4096,
                     forward_weight=forward_weight)
    split = score_pair(student.model, teacher.model, batch, pad, 0.7, top_k, chunk_tokens=3,
                       forward_weight=forward_weight)
    if forward_weight:  # the loss is the mix; kl_full stays the reverse KL of the full vocabulary
        reverse = score_pair(student.model, teacher.model, batch, pad, 0.7, top_k, chunk_tokens=3)
        torch.testing.assert_close(split.kl_full, reverse.kl_full, rtol=0, atol=0)
        assert not torch.equal(split.kl, reverse.kl)  # the mix reached the loss (its value: test_distill_loss.py)
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


def test_micro_batches_by_tokens_fill_a_budget_in_order():
    comps = [Completion([1] * 3, [2] * n, [0.0] * n, "stop") for n in (5, 1, 9, 2, 20, 3)]  # 8, 4, 12, 5, 23, 6 tokens
    by_rows = micro_batches(comps, [0, 1, 2, 3, 4, 5], size=4)
    assert [mb.rows for mb in by_rows] == [[0, 1, 2, 3], [4, 5]]
    by_tokens = micro_batches(comps, [0, 1, 2, 3, 4, 5], size=4, max_tokens=16)
    assert [mb.rows for mb in by_tokens] == [[0, 1], [2], [3], [4], [5]]  # 8+4 fit 16; 12+5 do not; 23 alone
    assert [mb.rows for mb in micro_batches(comps, [1, 3, 5, 0], size=1, max_tokens=16)] == [[1, 3, 5], [0]]


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "bnpo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_packed_sequences_give_the_padded_loss_and_gradients(task, tiny_dir, loss_type, level):
    """Packed without padding (one row, positions restarting per sequence): the same log-probs within fp32 rounding,
    so every loss type (and GSPO's sequence-level ratio) and its gradients are the padded path's."""
    policy = tiny_policy(task, tiny_dir, "quant_configs/nvfp4_a16.yaml", calib_size=16, trainable=True)
    prompts, completions = _batch(policy, task)
    pad = policy.tokenizer.pad_token_id
    cfg = TrainerConfig(loss_type=loss_type, importance_sampling_level=level)
    advantages = torch.linspace(-1.0, 1.0, len(prompts), device=policy.model.device)
    losses, grads = {}, {}
    for pack in (False, True):
        scores = score_completions(policy.model, prompts, completions, pad, 0.7, chunk_tokens=6, pack=pack)
        old = scores.logprobs.detach() + 0.01  # a policy that moved since the rollout: ratios away from 1
        lengths = [len(c) for c in completions]
        weights = sequence_weights(scores.mask, loss_type, len(prompts), max(lengths), sum(lengths), 1, sum(lengths))
        terms = grpo_loss(scores.logprobs, old, old, None, advantages, scores.mask, weights, cfg)
        terms.loss.backward()
        losses[pack], grads[pack] = terms.loss.detach(), _grads(policy.model)
    torch.testing.assert_close(losses[True], losses[False], rtol=1e-5, atol=1e-7)
    for name, grad in grads[False].items():
        torch.testing.assert_close(grads[True][name], grad, rtol=1e-4, atol=1e-6, msg=name)
