"""One copy of the rollout weights (qarl/generation/shared_weights.py): real vLLM (CPU build) in bf16 and a
bf16 policy with fp32 master weights, whose compute weights become views into the engine's tensors.

What must hold: the engine generates exactly what a plain copy refit gives it, after optimizer steps that
write the engine's weights directly, after an amax change that takes a weight out of its held value, and a
refit from another model or a shutdown leaves the first policy's weights intact in their own memory."""

from __future__ import annotations

import pytest
import torch

from qarl.config import GenerationConfig
from qarl.optim import PolicyOptimizer

from tests.conftest import answer_loss, tiny_policy

W4A16 = "quant_configs/nvfp4_a16.yaml"
W4A4 = "quant_configs/nvfp4_w4a4.yaml"


@pytest.fixture(scope="module")
def bf16_engine(tiny_dir):
    from qarl.generation import VLLMEngine

    engine = VLLMEngine(tiny_dir, GenerationConfig(max_new_tokens=8, kv_cache_gib=1), dtype="bfloat16", seed=0)
    yield engine
    engine.close()


def _trainable(task, tiny_dir, quant_cfg: str, **overrides):
    """A bf16 policy with fp32 masters (the GPU default's precision) and its optimizer, which writes the
    compute weights from the masters (each quantized weight holding its quantized value)."""
    policy = tiny_policy(task, tiny_dir, quant_cfg, trainable=True, dtype="bfloat16", **overrides)
    return policy, PolicyOptimizer(policy, lr=3e-2, weight_decay=0.0, max_grad_norm=1.0)


def _greedy(engine, policy, task) -> list[tuple[list[int], list[float]]]:
    prompts = [policy.tokenizer(p.prompt).input_ids for p in task.eval[:8]]
    return [(c.token_ids, c.logprobs) for c in engine.generate(prompts, greedy=True, max_new_tokens=8)]


def _in_engine(engine, tensor: torch.Tensor) -> bool:
    """`tensor`'s memory lies inside one of the engine's parameters."""
    start = tensor.data_ptr()
    return any(p.data_ptr() <= start < p.data_ptr() + p.numel() * p.element_size() for p in engine.model.parameters())


def _copied_refit(engine, policy) -> list[tuple[list[int], list[float]]]:
    """What the engine generates after vLLM's own loader copied every weight in (nothing shared)."""
    engine._shared.unlink()
    refit = engine.refit(policy.model)
    assert refit.shared_bytes == 0 and refit.bytes > 0
    return refit


@pytest.mark.parametrize("fmt", [W4A16, W4A4])
def test_compute_weights_are_the_engines_and_a_step_reaches_it_without_a_copy(bf16_engine, task, tiny_dir, fmt):
    policy, optimizer = _trainable(task, tiny_dir, fmt)
    bf16_engine.set_quant_format(policy.format)
    first = bf16_engine.refit(policy.model)
    names = {n for n, _ in policy.model.named_parameters()}
    assert set(bf16_engine._shared.linked) == names, "every weight of this model has a place in the engine"
    assert all(_in_engine(bf16_engine, p) for p in policy.model.parameters())
    before = _greedy(bf16_engine, policy, task)

    for _ in range(2):
        optimizer.backward(answer_loss(policy, task))
        optimizer.step()
    second = bf16_engine.refit(policy.model)
    weight_bytes = sum(p.numel() * p.element_size() for p in policy.model.parameters())
    assert second.shared_bytes == weight_bytes and first.bytes >= weight_bytes
    assert second.bytes == first.bytes - weight_bytes, "only the input amax is copied"
    after = _greedy(bf16_engine, policy, task)
    assert after != before, "the steps changed what the engine generates"

    _copied_refit(bf16_engine, policy)
    assert _greedy(bf16_engine, policy, task) == after, "bit for bit what a plain copy refit gives"


def test_a_weight_that_no_longer_holds_its_quantized_value_is_copied(bf16_engine, task, tiny_dir):
    """A new amax gives the weight its unquantized value back until the next step: the engine needs Q(w), so
    the weight gets its own memory, and (all or nothing) so does every other; the next step links them again."""
    policy, optimizer = _trainable(task, tiny_dir, W4A16)
    bf16_engine.set_quant_format(policy.format)
    bf16_engine.refit(policy.model)
    assert bf16_engine._shared.linked
    layer = policy.model.model.layers[0].mlp.down_proj
    layer.weight_quantizer.amax = layer.weight_quantizer.amax * 1.5  # the hold ends: the weight is unquantized again
    assert not layer.weight_quantizer.holds(layer.weight)
    refit = bf16_engine.refit(policy.model)
    moved = layer.weight.numel() * layer.weight.element_size()
    assert refit.bytes == moved, "the others were in the engine already"
    assert refit.shared_bytes == sum(p.numel() * p.element_size() for p in policy.model.parameters()) - moved
    assert not bf16_engine._shared.linked
    assert not any(_in_engine(bf16_engine, p) for p in policy.model.parameters())
    shared = _greedy(bf16_engine, policy, task)
    assert bf16_engine.refit(policy.model).shared_bytes == 0, "nothing links while one weight cannot"
    assert _greedy(bf16_engine, policy, task) == shared
    optimizer.backward(answer_loss(policy, task))
    optimizer.step()
    bf16_engine.refit(policy.model)
    assert all(_in_engine(bf16_engine, p) for p in policy.model.parameters()), "the step's hold links them again"


def test_another_models_refit_and_a_shutdown_leave_the_policy_its_weights(tiny_dir, task):
    from qarl.generation import VLLMEngine

    first, optimizer = _trainable(task, tiny_dir, W4A16)
    other, _ = _trainable(task, tiny_dir, W4A16, calib_size=16)
    engine = VLLMEngine(tiny_dir, GenerationConfig(max_new_tokens=8, kv_cache_gib=1), dtype="bfloat16", seed=0,
                        quant_format=first.format)
    try:
        engine.refit(first.model)
        optimizer.backward(answer_loss(first, task))
        optimizer.step()
        snapshot = {n: p.detach().clone() for n, p in first.model.named_parameters()}
        engine.refit(other.model)
        assert not any(_in_engine(engine, p) for p in first.model.parameters())
        assert all(torch.equal(p, snapshot[n]) for n, p in first.model.named_parameters())
        assert all(_in_engine(engine, p) for p in other.model.parameters())
        kept = {n: p.detach().clone() for n, p in other.model.named_parameters()}
    finally:
        engine.close()
    assert all(torch.equal(p, kept[n]) for n, p in other.model.named_parameters()), "intact after the shutdown"
    answer_loss(other, task).backward()  # and the policy still trains on its own memory


def test_nothing_is_shared_without_masters_or_when_switched_off(bf16_engine, task, tiny_dir):
    from qarl.generation import VLLMEngine

    plain, _ = _trainable(task, tiny_dir, W4A16, master_dtype="bfloat16")  # the parameters are the masters
    bf16_engine.set_quant_format(plain.format)
    refit = bf16_engine.refit(plain.model)
    assert not bf16_engine._shared.linked and refit.shared_bytes == 0
    off = VLLMEngine(tiny_dir, GenerationConfig(max_new_tokens=8, kv_cache_gib=1, share_weights=False),
                     dtype="bfloat16", seed=0)
    try:
        policy, _ = _trainable(task, tiny_dir, "none")
        assert off.refit(policy.model).shared_bytes == 0
        assert not any(_in_engine(off, p) for p in policy.model.parameters())
    finally:
        off.close()


def test_engine_views_place_every_engine_weight_or_none(bf16_engine, task, tiny_dir):
    """Names and rows come from vLLM's own fused layers: q/k/v stacked in qkv_proj (weights and biases), gate/up
    in gate_up_proj, a vocabulary's first rows; an engine weight with no place in the policy shares nothing."""
    from qarl.generation.shared_weights import engine_views

    policy = tiny_policy(task, tiny_dir, "none", dtype="bfloat16")
    shapes = {n: p.shape for n, p in policy.model.named_parameters()}
    views = engine_views(bf16_engine.model, shapes)
    assert set(views) == set(shapes)
    fused = dict(bf16_engine.model.named_parameters())["model.layers.1.self_attn.qkv_proj.bias"]
    step = fused.element_size()
    starts = [views[f"model.layers.1.self_attn.{p}_proj.bias"].data_ptr() for p in "qkv"]
    assert starts == [fused.data_ptr(), fused.data_ptr() + shapes["model.layers.1.self_attn.q_proj.bias"][0] * step,
                      fused.data_ptr() + (fused.numel() - shapes["model.layers.1.self_attn.v_proj.bias"][0]) * step]
    fewer = {n: s for n, s in shapes.items() if n != "model.layers.0.mlp.up_proj.weight"}
    assert engine_views(bf16_engine.model, fewer) is None
    vocab = shapes["model.embed_tokens.weight"]
    padded = engine_views(bf16_engine.model, {**shapes, "model.embed_tokens.weight": (vocab[0] - 28, *vocab[1:])})
    assert padded["model.embed_tokens.weight"].shape[0] == vocab[0] - 28
