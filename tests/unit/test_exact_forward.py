"""The exact forward off the GPU: what cannot run is refused before anything expensive; the torch
references whose gradients the exact forward's backward pass uses compute the math of vLLM's kernels
(its rotary embedding, causal attention per sequence); the gradients written out equal autograd's
gradients of those references; `EngineOp`'s plumbing. Bit equality with the engine is a GPU matter:
tests/integration/test_gpu_exact.py."""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from qarl.backends.exact_forward import (EngineOp, _add_norm_gradient, _norm_gradient, _reference_attention,
                                         _reference_fp8_attention, _reference_norm, _reference_rotary,
                                         _reference_silu_and_mul, _silu_and_mul_gradient, autograd_of,
                                         kv_cache_quantizers, kv_cache_scale)
from qarl.config import ConfigError, PolicyConfig, load_recipe


@pytest.mark.parametrize("override, named", [
    ("policy.dtype=float32", "policy.dtype=float32"),
    ("policy.backend=megatron", "policy.backend=megatron"),
    ("policy.lora.mode=qlora", "policy.lora.mode=qlora"),
    ("policy.generation.allow_quant_mismatch=true", "allow_quant_mismatch"),
    ("policy.generation.top_p=0.9", "top_p=0.9"),
    ("policy.quant_weight_cache=false", "quant_weight_cache=false"),
    ("policy.gradient_checkpointing=on", "gradient_checkpointing=on"),  # its own layer loop does not checkpoint
])
def test_the_recipe_refuses_what_the_exact_forward_cannot_serve(override, named):
    overrides = ["policy.exact_forward=true", "policy.dtype=bfloat16", override]
    with pytest.raises(ConfigError, match="exact_forward") as refused:
        load_recipe("recipes/qa_grpo_tiny.yaml", overrides)
    assert named in str(refused.value)
    assert load_recipe("recipes/qa_grpo_tiny.yaml", overrides[:2]).policy.exact_forward


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal")
def test_a_cpu_machine_is_refused_before_the_model_loads(task, tiny_dir):
    from qarl.policy import build_policy

    with pytest.raises(ConfigError, match="no CUDA GPU"):
        build_policy(PolicyConfig(exact_forward=True, dtype="bfloat16", quant_cfg="none"), [], model_dir=tiny_dir)


@pytest.mark.parametrize("family, served", [("qwen2", True), ("qwen3", True), ("llama3", True), ("mistral", False),
                                             ("gemma3", False), ("phi3", False)])
def test_the_families_the_exact_forward_serves_and_the_rest_are_named(family, served):
    """Qwen3's q/k norms and Llama 3's scaled rotary embedding are served; another architecture, a rotary
    embedding vLLM scales another way (YaRN) or applies to part of each head is refused by name."""
    from transformers import AutoConfig

    from qarl.backends.exact_forward import ARCHITECTURES
    from qarl.generation.exact import rope_parameters
    from qarl.models.resolve import resolve_model_dir

    config = AutoConfig.from_pretrained(resolve_model_dir(f"embedded:tiny-{family}"))
    assert (config.model_type in ARCHITECTURES) == served
    if family in ("qwen3", "llama3"):
        assert rope_parameters(config) is not None
        config.rope_parameters = {**config.rope_parameters, "rope_type": "yarn", "factor": 4.0}
        assert rope_parameters(config) is None
        config.rope_parameters = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}
        assert rope_parameters(config) is None


@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_the_rotary_table_is_the_one_vllm_builds_for_the_model(family):
    """The policy's table (`rope_cache`) is the one vLLM's `get_rope` builds for the model's own rotary settings:
    Llama 3's scaled frequencies included (they differ from the plain table)."""
    from transformers import AutoConfig
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from qarl.generation.exact import head_size, rope_cache
    from qarl.models.resolve import resolve_model_dir

    config = AutoConfig.from_pretrained(resolve_model_dir(f"embedded:tiny-{family}"))
    with set_current_vllm_config(VllmConfig()):
        vllms = get_rope(head_size(config), config.max_position_embeddings, True, dict(config.rope_parameters),
                         torch.float32).cos_sin_cache
    ours = rope_cache(config, torch.float32, torch.device("cpu"))
    assert torch.equal(ours, vllms)
    plain = rope_cache(SimpleNamespace(head_dim=head_size(config), max_position_embeddings=config.max_position_embeddings,
                                       rope_parameters={"rope_theta": config.rope_parameters["rope_theta"]}),
                       torch.float32, torch.device("cpu"))
    assert torch.equal(plain, ours) == (family == "qwen3")


def test_the_rotary_reference_is_vllms_rotary_embedding():
    from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding

    from qarl.generation.exact import rope_cache

    config = SimpleNamespace(head_dim=64, max_position_embeddings=512, rope_parameters={"rope_theta": 10000.0})
    cache = rope_cache(config, torch.float32, torch.device("cpu"))
    positions = torch.cat([torch.arange(30), torch.arange(7)])
    q, k = torch.randn(37, 4 * 64), torch.randn(37, 2 * 64)
    want = RotaryEmbedding.forward_static(positions, q.clone(), k.clone(), 64, 64, cache, True)
    for got, expected in zip(_reference_rotary(positions, cache, q, k), want):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_the_attention_reference_is_causal_attention_within_each_sequence():
    lengths, scale = [5, 12, 1], 0.125
    q, k, v = torch.randn(18, 4, 16), torch.randn(18, 2, 16), torch.randn(18, 2, 16)
    rows, start = [], 0
    for n in lengths:  # softmax(q k^T) v, keys 0..t for query t, each query head reading its KV head
        qs, ks, vs = q[start : start + n], k[start : start + n].repeat_interleave(2, 1), v[start : start + n].repeat_interleave(2, 1)
        scores = torch.einsum("thd,shd->hts", qs, ks) * scale
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        rows.append(torch.einsum("hts,shd->thd", scores.softmax(-1), vs))
        start += n
    width = 13  # wider than the longest sequence, as a padded batch may be
    index = (torch.arange(width) < torch.tensor(lengths)[:, None]).flatten().nonzero().squeeze(1)
    torch.testing.assert_close(_reference_attention(q, k, v, index, (len(lengths), width), scale), torch.cat(rows),
                               rtol=1e-5, atol=1e-5)


def test_the_fp8_cache_reference_attends_with_the_engines_fp8_values_and_passes_gradients_straight_through():
    """The FP8-cache attention's gradient reference (`_reference_fp8_attention`): its forward is attention of the
    values the engine's cache holds (keys and values as E4M3 at their scales, queries at scale 1), and its gradient is
    attention's gradient at those values, handed to the unrounded inputs unchanged (the straight-through estimator)."""
    lengths, scale, kv_scale = [5, 12], 0.125, torch.tensor([0.02, 0.005])
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(17, heads, 16, generator=generator) for heads in (4, 2, 2))
    index = (torch.arange(12) < torch.tensor(lengths)[:, None]).flatten().nonzero().squeeze(1)
    reference = partial(_reference_attention, index=index, grid=(2, 12), scale=scale)
    as_cached = [(t / s).to(torch.float8_e4m3fn).float() * s for t, s in zip((q, k, v), (1.0, *kv_scale.tolist()))]
    assert all(not torch.equal(a, t) for a, t in zip(as_cached, (q, k, v)))  # the rounding is there to see
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    out = _reference_fp8_attention(reference, *inputs, kv_scale=kv_scale)
    rounded = [t.clone().requires_grad_() for t in as_cached]
    want = reference(*rounded)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    grad = torch.randn(out.shape, generator=generator)
    out.backward(grad)
    want.backward(grad)
    for got, expected in zip(inputs, rounded):
        torch.testing.assert_close(got.grad, expected.grad, rtol=1e-6, atol=1e-6)


def test_the_exact_forwards_kv_scales_are_the_ones_a_refit_writes(task, tiny_dir):
    """The exact forward attends with the very scales the engine's refit writes into k_scale and v_scale (one rule,
    `fp8_kv_cache_multipliers`); keys quantized without values are refused."""
    from qarl.generation.engine_quant import KVCacheScales

    from tests.conftest import tiny_policy

    policy = tiny_policy(task, tiny_dir, "nvfp4_a16_kv_fp8")
    attention = policy.model.model.layers[1].self_attn
    attention.__dict__["_qarl_kv_quantizers"] = kv_cache_quantizers("model.layers.1.self_attn", attention)
    engine = KVCacheScales("model.layers.1.self_attn", torch.device("cpu"))
    engine.load_amax(attention.k_bmm_quantizer.amax, attention.v_bmm_quantizer.amax)
    assert torch.equal(kv_cache_scale(attention), engine.scale)
    assert kv_cache_scale(tiny_policy(task, tiny_dir, "nvfp4_a16").model.model.layers[1].self_attn) is None
    attention.v_bmm_quantizer.disable()
    with pytest.raises(ConfigError, match="model.layers.1.self_attn quantizes its keys and values otherwise"):
        kv_cache_quantizers("model.layers.1.self_attn", attention)


def test_engine_op_backward_is_the_gradient_of_its_reference():
    """With the reference as its kernel too, EngineOp must give exactly autograd's gradients: every output's
    gradient reaches the right input, and an input that needs none gets none."""

    def reference(x, residual, weight):
        total = x + residual
        return _reference_norm(total, weight, 1e-6), total

    def kernel(*inputs):
        with torch.no_grad():
            return tuple(t.clone() for t in reference(*inputs))

    x, residual, weight = torch.randn(6, 32, requires_grad=True), torch.randn(6, 32, requires_grad=True), torch.randn(32)
    normed, total = EngineOp.apply(kernel, autograd_of(reference), x, residual, weight)
    (normed.square().sum() + (total * 3).sum()).backward()
    got = (x.grad.clone(), residual.grad.clone())
    x.grad = residual.grad = None
    normed, total = reference(x, residual, weight)
    (normed.square().sum() + (total * 3).sum()).backward()
    assert torch.equal(got[0], x.grad) and torch.equal(got[1], residual.grad)
    assert weight.grad is None

    y = torch.randn(4, 8, requires_grad=True)  # one output only, its gradient not needed by the other path
    EngineOp.apply(lambda t: F.silu(t).detach(), autograd_of(F.silu), y).sum().backward()
    torch.testing.assert_close(y.grad, torch.sigmoid(y) * (1 + y * (1 - torch.sigmoid(y))))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_written_gradients_are_autograds_gradients_of_the_references(dtype):
    """RMSNorm (with and without the residual), SiLU x mul and the rotary embedding (the inverse rotation)
    have their backward written out; each must equal autograd's gradient of its reference."""
    from qarl.generation.exact import rope_cache

    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: (torch.randn(*shape, generator=g) * 2).to(dtype)  # noqa: E731
    x, residual, weight = rand(2, 9, 64), rand(2, 9, 64), rand(64)
    config = SimpleNamespace(head_dim=32, max_position_embeddings=64, rope_parameters={"rope_theta": 10000.0})
    cache = rope_cache(config, dtype, torch.device("cpu"))
    cos, sin = cache.chunk(2, dim=-1)
    positions = torch.cat([torch.arange(11), torch.arange(7)])
    q, k = rand(18, 4 * 32), rand(18, 2 * 32)
    cases = [  # reference, written gradient, inputs, output gradients
        (partial(_reference_norm, eps=1e-6), partial(_norm_gradient, eps=1e-6), (x, weight), (rand(2, 9, 64),)),
        (lambda x, r, w: (_reference_norm(x + r, w, 1e-6), x + r), partial(_add_norm_gradient, eps=1e-6),
         (x, residual, weight), (rand(2, 9, 64), rand(2, 9, 64))),
        (_reference_silu_and_mul, _silu_and_mul_gradient, (rand(5, 96),), (rand(5, 48),)),
        (partial(_reference_rotary, positions, cache),
         lambda grads, q, k: _reference_rotary(positions, torch.cat((cos, -sin), -1), *grads), (q, k),
         (rand(18, 128), rand(18, 64))),
    ]
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for reference, gradient, inputs, grads in cases:
        want = autograd_of(reference)(grads, *inputs)
        got = gradient(grads, *inputs)
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and a.shape == b.shape
            torch.testing.assert_close(a.float(), b.float(), **tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gradients_a_gpu_compiles_compile_and_agree_with_their_written_form(dtype):
    """On a GPU the norm and SiLU x mul gradients run compiled (`fused_on_gpu`), called from EngineOp's backward
    (no autograd graph). Here the same functions go through torch.compile on the CPU as that backward calls them, at
    two row counts (one graph, dynamic shapes), the q/k norms' 3-D head views among them, and give what they give as
    written, within rounding."""
    from qarl.scoring import compiled_once

    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(dtype)  # noqa: E731
    weight, head_weight = rand(64), rand(16)
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for rows in (9, 13):
        x, residual, up = rand(rows, 64), rand(rows, 64), rand(rows, 96)
        heads = rand(rows, 128)[:, :64].view(rows, 4, 16)  # a strided view, as q's heads before their norm
        cases = [(_norm_gradient, (x, weight), (rand(rows, 64),), {"eps": 1e-6}),
                 (_norm_gradient, (heads, head_weight), (rand(rows, 4, 16),), {"eps": 1e-6}),
                 (_add_norm_gradient, (x, residual, weight), (rand(rows, 64), rand(rows, 64)), {"eps": 1e-6}),
                 (_silu_and_mul_gradient, (up,), (rand(rows, 48),), {})]
        with torch.no_grad():
            for gradient, inputs, grads, options in cases:
                compiled = compiled_once(gradient)(grads, *inputs, **options)
                for a, b in zip(compiled, gradient(grads, *inputs, **options)):
                    assert a.dtype == b.dtype and a.shape == b.shape
                    torch.testing.assert_close(a, b, **tolerance)


def test_fused_weights_are_kept_until_a_part_changes():
    """EngineLinear.fused: the concatenation of parameters is computed once and reused while each is the same
    tensor at the same version; an in-place write (checkpoint load), another tensor, an optimizer step (which
    also frees it: fused optimizers bump no version) or `invalidate` makes it anew; non-parameters (quantized
    copies of this forward) are concatenated every time."""
    from torch import nn

    from qarl.backends.exact_forward import EngineLinear
    from qarl.quant.fastpath.weight_cache import DERIVED, invalidate

    owner = nn.Module()
    parts = [nn.Parameter(torch.randn(3, 4)), nn.Parameter(torch.randn(2, 4))]
    first = EngineLinear.fused(owner, "w", parts)
    assert torch.equal(first, torch.cat(parts)) and first.grad_fn is None
    assert EngineLinear.fused(owner, "w", parts) is first
    with torch.no_grad():
        parts[1].add_(1.0)  # a write in place
    second = EngineLinear.fused(owner, "w", parts)
    assert second is not first and torch.equal(second, torch.cat(parts))
    parts[0] = nn.Parameter(parts[0].detach().clone())  # another tensor with the same values
    third = EngineLinear.fused(owner, "w", parts)
    assert third is not second
    optimizer = torch.optim.SGD(parts, lr=0.1)
    sum(p.sum() for p in parts).backward()
    optimizer.step()
    assert DERIVED not in owner.__dict__  # freed at the step
    assert torch.equal(EngineLinear.fused(owner, "w", parts), torch.cat(parts).detach())
    invalidate(owner)
    assert DERIVED not in owner.__dict__
    copies = [p * 1.0 for p in parts]
    assert EngineLinear.fused(owner, "w", copies) is not EngineLinear.fused(owner, "w", copies)
    assert EngineLinear.fused(owner, "w", parts[:1]).data_ptr() == parts[0].data_ptr()  # one layer: no copy
    with torch.inference_mode():
        kept = EngineLinear.fused(owner, "w", parts)
    assert not kept.is_inference()  # a later training pass may save it for its backward


def test_an_exact_rollout_runs_in_waves_the_scheduler_prefills_in_one_step(monkeypatch, capsys):
    """Where the policy computes completion tokens as decode steps, no scheduler step may mix prefills with decode
    steps: the requests go in consecutive waves within the scheduler's per-step request and token limits (here 3
    requests, 100 tokens); a prompt longer than the budget goes alone. Other engines generate in one go."""
    from qarl.generation import vllm_compat
    from qarl.generation.vllm_engine import VLLMEngine

    monkeypatch.setattr(vllm_compat, "scheduler_limits", lambda llm: (3, 100))
    engine = VLLMEngine.__new__(VLLMEngine)  # (no vLLM: only the wave split is under test)
    engine.llm, engine.exact, engine._decode_steps, engine._told_waves = None, True, True, False
    requests = [{"prompt_token_ids": [0] * n} for n in (40, 40, 30, 10, 5, 120, 1)]
    assert [(w.start, w.stop) for w in engine._waves(requests)] == [(0, 2), (2, 5), (5, 6), (6, 7)]
    assert "4 waves" in capsys.readouterr().out
    engine._decode_steps = False
    assert engine._waves(requests) == [slice(None)]
