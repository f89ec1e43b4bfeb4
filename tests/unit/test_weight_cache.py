"""The fake-quant weight cache (qarl/quant/fastpath/weight_cache.py) on real ModelOpt quantizers: the same bits
and the same gradients as ModelOpt's uncached path, one quantization per change of the weights, and
every way the weights or amax change invalidates it."""

from __future__ import annotations

import copy

import pytest
import torch
from modelopt.torch.quantization.nn import TensorQuantizer

from qarl.optim import PolicyOptimizer
from qarl.quant import folded_weights, load_quantizer_state, quantizer_state
from qarl.quant.quantize import quantized_linears, share_fused_amax
from qarl.quant.fastpath.lean_forward import FastInputMixin, LeanAttention, lean_forward, plan_linear, quantized_linear
from qarl.quant.fastpath.weight_cache import WeightCacheMixin, cache_bytes, invalidate

from tests.conftest import FORMATS, answer_loss, tiny_policy


def _policy(task, tiny_dir, fmt: str, cache: bool = True, **overrides):
    return tiny_policy(task, tiny_dir, fmt, quant_weight_cache=cache, trainable=True, **overrides)


def _uncached(quantizer, weight):
    """ModelOpt's own output for this weight now, bypassing the cache."""
    with torch.no_grad():
        return super(WeightCacheMixin, quantizer).forward(weight)


def _layer(policy):
    return policy.model.model.layers[0].self_attn.q_proj


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_cached_policy_equals_uncached_in_outputs_gradients_and_updates(task, tiny_dir, fmt, dtype):
    """fp32: the model's parameters are the masters and the cache quantizes them; bf16 with fp32 masters:
    each compute weight holds its own quantized value after every step (`hold`). Both are ModelOpt's bits."""
    cached, plain = _policy(task, tiny_dir, fmt, dtype=dtype), _policy(task, tiny_dir, fmt, cache=False, dtype=dtype)
    assert isinstance(_layer(cached).weight_quantizer, WeightCacheMixin)
    assert not isinstance(_layer(plain).weight_quantizer, WeightCacheMixin)
    assert type(_layer(cached)).forward is lean_forward and type(_layer(plain)).forward is not lean_forward
    assert isinstance(_layer(cached).input_quantizer, FastInputMixin)
    assert isinstance(cached.model.model.layers[0].self_attn, LeanAttention)
    assert not isinstance(_layer(plain).input_quantizer, FastInputMixin)
    optimizers = [PolicyOptimizer(p, 1e-3, 0.0, 1.0) for p in (cached, plain)]
    for step in range(3):  # a forward after each optimizer step sees the new weights
        losses = [answer_loss(p, task) for p in (cached, plain)]
        assert torch.equal(losses[0], losses[1]), f"step {step}"
        for opt, loss in zip(optimizers, losses):
            opt.zero_grad()
            opt.backward(loss)
        for a, b in zip(optimizers[0].params, optimizers[1].params):
            assert torch.equal(a.grad, b.grad)
        for opt in optimizers:
            assert opt.step().applied
    for (name, a), (_, b) in zip(folded_weights(cached.model), folded_weights(plain.model)):
        assert torch.equal(a, b), name
    held = [m.weight_quantizer._qarl_held is not None for _, m in quantized_linears(cached.model)
            if m.weight_quantizer.is_enabled]
    assert all(held) if dtype == "bfloat16" else not any(held)


def test_one_quantization_per_change_of_the_weights(task, tiny_dir):
    policy = _policy(task, tiny_dir, "nvfp4_w4a4")
    quantizer = _layer(policy).weight_quantizer
    answer_loss(policy, task)
    first = quantizer._qarl_value
    with torch.no_grad():
        answer_loss(policy, task)
    dict(folded_weights(policy.model))  # the refit fold reads the same tensor
    assert quantizer._qarl_value is first
    optimizer = PolicyOptimizer(policy, 1e-3, 0.0, 1.0)
    optimizer.backward(answer_loss(policy, task))
    optimizer.step()
    answer_loss(policy, task)
    assert quantizer._qarl_value is not first
    assert torch.equal(quantizer._qarl_value, _uncached(quantizer, _layer(policy).weight))
    quantized = [m.weight for _, m in quantized_linears(policy.model) if m.weight_quantizer.is_enabled]
    assert cache_bytes(policy.model) == sum(w.numel() * w.element_size() for w in quantized)


@pytest.mark.parametrize("optimizer_kwargs", [{"foreach": False}, {"foreach": True}, {"fused": True}])
def test_every_optimizer_implementation_invalidates(task, tiny_dir, optimizer_kwargs):
    policy = _policy(task, tiny_dir, "nvfp4_a16", cache=True)
    layer = _layer(policy)
    optimizer = torch.optim.AdamW(policy.model.parameters(), lr=1e-2, **optimizer_kwargs)
    answer_loss(policy, task).backward()
    before = layer.weight_quantizer(layer.weight).detach().clone()
    optimizer.step()
    after = layer.weight_quantizer(layer.weight)
    assert not torch.equal(before, after)
    assert torch.equal(after, _uncached(layer.weight_quantizer, layer.weight))


def test_weight_and_amax_writes_invalidate(task, tiny_dir):
    policy = _policy(task, tiny_dir, "fp8_w8a8")
    layer = _layer(policy)
    quantizer = layer.weight_quantizer

    def fresh() -> bool:
        return torch.equal(quantizer(layer.weight), _uncached(quantizer, layer.weight))

    assert fresh()
    state = copy.deepcopy(policy.model.state_dict())
    with torch.no_grad():
        layer.weight.mul_(1.5)  # in-place write
    assert fresh()
    policy.model.load_state_dict(state)  # checkpoint-style load
    assert fresh() and torch.equal(quantizer(layer.weight), _uncached(quantizer, state["model.layers.0.self_attn.q_proj.weight"]))
    amax = quantizer_state(policy.model)
    quantizer.amax = quantizer.amax * 0.5  # ModelOpt's setter (writes through .data)
    assert fresh()
    load_quantizer_state(policy.model, amax)  # restore a saved quantizer state
    assert fresh()
    quantizer.amax = quantizer.amax * 3.0
    share_fused_amax(policy.model)  # calibration's fused-amax step
    assert fresh()
    with torch.no_grad():
        layer.weight.data.copy_(layer.weight * 0.25)  # invisible to version counters: the documented escape hatch
    invalidate(policy.model)
    assert fresh()


def test_clipping_straight_through_gradient_matches_modelopt(task, tiny_dir, tmp_path):
    """With pass_through_bwd off, ModelOpt zeroes the gradient where |w| > amax; so does the cache."""
    cfg = tmp_path / "fp8_clip.yaml"
    cfg.write_text(open("quant_configs/fp8_w8a8.yaml").read().replace("axis: null", "axis: null\n      pass_through_bwd: false"))
    assert "pass_through_bwd: false" in cfg.read_text()
    grads = []
    for cache in (True, False):
        policy = _policy(task, tiny_dir, str(cfg), cache=cache)
        layer = _layer(policy)
        layer.weight_quantizer.amax = layer.weight_quantizer.amax * 0.5  # clip half the range
        answer_loss(policy, task).backward()
        grads.append(layer.weight.grad)
    assert torch.equal(grads[0], grads[1])
    assert (grads[0] == 0).float().mean() > 0.01  # some gradients really are clipped


def test_bf16_compute_with_fp32_master_weights(task, tiny_dir):
    """Master weights stay fp32, the model computes in bf16 from their rounding, and an update far
    below a bf16 ulp accumulates in the master instead of vanishing."""
    policy = _policy(task, tiny_dir, "nvfp4_a16", dtype="bfloat16")
    layer = _layer(policy)
    master = policy.master["model.layers.0.self_attn.q_proj.weight"]
    assert master.dtype == torch.float32 and layer.weight.dtype == torch.bfloat16
    assert torch.equal(layer.weight, master.to(torch.bfloat16))
    optimizer = PolicyOptimizer(policy, 1e-6, 0.0, 1.0)
    start = master.clone()
    for _ in range(3):
        optimizer.backward(answer_loss(policy, task))
        assert optimizer.step().applied
    assert not torch.equal(master, start)
    # the compute weight holds the quantization of the master's rounding, which the forward reads as it is
    assert torch.equal(layer.weight, _uncached(layer.weight_quantizer, master.to(torch.bfloat16)))
    assert layer.weight_quantizer(layer.weight) is layer.weight and cache_bytes(policy.model) == 0
    norm = policy.model.model.layers[0].input_layernorm.weight  # not quantized: the master's rounding
    assert torch.equal(norm, policy.master["model.layers.0.input_layernorm.weight"].to(torch.bfloat16))
    saved = policy.master_state_dict()
    assert saved["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float32
    assert saved["lm_head.weight"].data_ptr() == saved["model.embed_tokens.weight"].data_ptr()  # tied: one master


def test_a_format_change_invalidates(task, tiny_dir):
    import modelopt.torch.quantization as mtq

    policy = _policy(task, tiny_dir, "nvfp4_a16")
    layer = _layer(policy)
    nvfp4 = layer.weight_quantizer(layer.weight).clone()
    mtq.set_quantizer_by_cfg(policy.model, [{"quantizer_name": "*weight_quantizer",
                                             "cfg": {"num_bits": (4, 3), "axis": None}}])  # FP8 now
    fp8 = layer.weight_quantizer(layer.weight)
    assert not torch.equal(fp8, nvfp4)
    assert torch.equal(fp8, _uncached(layer.weight_quantizer, layer.weight))
    mtq.set_quantizer_by_cfg(policy.model, [{"quantizer_name": "*weight_quantizer", "enable": False}])
    assert torch.equal(layer.weight_quantizer(layer.weight), layer.weight)


def test_a_held_weight_never_goes_stale(task, tiny_dir):
    """A bf16 weight that holds its quantized value (fp32 masters) gives it up whenever what it holds would
    be wrong: a new amax or a disabled quantizer writes the master back and the forward falls back to the
    cache; a state load ends the hold and keeps what was loaded; the next optimizer step holds again."""
    policy = _policy(task, tiny_dir, "fp8_w8a8", dtype="bfloat16")
    layer = _layer(policy)
    quantizer, master = layer.weight_quantizer, policy.master["model.layers.0.self_attn.q_proj.weight"]
    optimizer = PolicyOptimizer(policy, 1e-3, 0.0, 1.0)
    optimizer.backward(answer_loss(policy, task))
    optimizer.step()
    assert quantizer._qarl_held is not None
    assert torch.equal(quantizer(layer.weight.detach()), layer.weight)  # an alias of it is not quantized twice
    with pytest.raises(RuntimeError, match="master weights"):  # a copy would take Q(w) for the weight
        copy.deepcopy(policy.model)

    def served() -> torch.Tensor:
        with torch.no_grad():
            return dict(folded_weights(policy.model))["model.layers.0.self_attn.q_proj.weight"]

    quantizer.amax = quantizer.amax * 0.5  # ModelOpt's setter
    assert torch.equal(served(), _uncached(quantizer, master.to(torch.bfloat16)))
    assert quantizer._qarl_held is None and torch.equal(layer.weight, master.to(torch.bfloat16))
    optimizer.backward(answer_loss(policy, task))
    optimizer.step()
    assert quantizer._qarl_held is not None and torch.equal(served(), _uncached(quantizer, master.to(torch.bfloat16)))
    quantizer.disable()
    assert torch.equal(served(), master.to(torch.bfloat16))  # unquantized, not the held quantization
    quantizer.enable()
    optimizer.backward(answer_loss(policy, task))
    optimizer.step()
    quantizer._disabled = True  # ModelOpt also writes its switches directly (quant_embedding, calibration)
    assert quantizer._qarl_held is None and torch.equal(served(), master.to(torch.bfloat16))
    quantizer._disabled = False
    optimizer.backward(answer_loss(policy, task))
    optimizer.step()
    loaded = torch.randn_like(layer.weight)
    policy.model.load_state_dict({"model.layers.0.self_attn.q_proj.weight": loaded}, strict=False)
    assert torch.equal(served(), _uncached(quantizer, loaded))
    assert quantizer._qarl_held is None and torch.equal(layer.weight, loaded)


def test_lean_embedding_equals_modelopt_with_its_quantizers_enabled(task, tiny_dir):
    """The lean embedding skips ModelOpt's dynamic `weight` and context manager, not its quantizers: with the
    table and the lookup's output quantized (FP8, which no shipped format does), outputs and gradients are
    ModelOpt's."""
    import modelopt.torch.quantization as mtq

    from qarl.quant.fastpath.lean_forward import LeanEmbedding

    policies = [_policy(task, tiny_dir, "nvfp4_a16", cache=cache) for cache in (True, False)]
    assert isinstance(policies[0].model.model.embed_tokens, LeanEmbedding)
    assert not isinstance(policies[1].model.model.embed_tokens, LeanEmbedding)
    fp8 = {"num_bits": (4, 3), "axis": None}
    for p in policies:
        embedding = p.model.model.embed_tokens
        mtq.set_quantizer_by_cfg(p.model, [{"quantizer_name": "*embed_tokens.weight_quantizer", "cfg": fp8, "enable": True},
                                           {"quantizer_name": "*embed_tokens.output_quantizer", "cfg": fp8, "enable": True}])
        embedding.weight_quantizer.amax = embedding.weight.detach().abs().amax() * 0.5  # clips: a visible change
        embedding.output_quantizer.amax = torch.tensor(0.05)
    losses = [answer_loss(p, task) for p in policies]
    assert torch.equal(losses[0], losses[1])
    for loss in losses:
        loss.backward()
    grads = [p.model.model.embed_tokens.weight.grad for p in policies]
    assert torch.equal(grads[0], grads[1])
    for p in policies:
        mtq.set_quantizer_by_cfg(p.model, [{"quantizer_name": "*embed_tokens.*", "enable": False}])
    with torch.no_grad():
        assert not torch.equal(answer_loss(policies[0], task), losses[0])  # the quantizers did change the result


def test_fused_siblings_quantize_their_shared_input_once(task, tiny_dir, monkeypatch):
    """q/k/v (and gate/up) read one input with one amax: it is quantized once per forward, with ModelOpt's
    bits; siblings whose amax differ quantize apart again."""
    import qarl.quant.fastpath.lean_forward as lean
    from qarl.quant.kernels.gpu import BoundFakeQuant

    policy, plain = _policy(task, tiny_dir, "nvfp4_w4a4"), _policy(task, tiny_dir, "nvfp4_w4a4", cache=False)
    calls = []  # every quantization an input quantizer computes: the op's path, or on a GPU the bound kernel
    op, kernel = lean.fake_quant_eager, BoundFakeQuant.__call__
    monkeypatch.setattr(lean, "fake_quant_eager", lambda *args: calls.append(args[0].shape) or op(*args))
    monkeypatch.setattr(BoundFakeQuant, "__call__",
                        lambda self, x: (out := kernel(self, x)) is not None and calls.append(x.shape) or out)
    with torch.no_grad():
        assert torch.equal(answer_loss(policy, task), answer_loss(plain, task))
    layers = len(policy.model.model.layers)
    assert len(calls) == 4 * layers  # q/k/v, o_proj, gate/up, down_proj
    for p in (policy, plain):
        quantizer = p.model.model.layers[0].self_attn.k_proj.input_quantizer
        quantizer.amax = quantizer.amax * 2
    calls.clear()
    with torch.no_grad():
        assert torch.equal(answer_loss(policy, task), answer_loss(plain, task))
    assert len(calls) == 4 * layers + 2  # layer 0's k_proj and v_proj each alone now


def test_shared_input_needs_every_sibling_calibrated_alike(task, tiny_dir):
    """A sibling without an amax, or with another straight-through rule, shares nothing: each computes its own."""
    policy, plain = _policy(task, tiny_dir, "fp8_w8a8"), _policy(task, tiny_dir, "fp8_w8a8", cache=False)
    for p in (policy, plain):
        attention = p.model.model.layers[0].self_attn
        attention.k_proj.input_quantizer.disable()
        del attention.k_proj.input_quantizer._amax  # never calibrated
        attention.v_proj.input_quantizer._pass_through_bwd = False
    losses = [answer_loss(p, task) for p in (policy, plain)]
    assert torch.equal(losses[0], losses[1])
    for loss in losses:
        loss.backward()
    grads = [p.model.model.layers[0].input_layernorm.weight.grad for p in (policy, plain)]
    assert torch.equal(grads[0], grads[1])



def test_input_quantizer_hooks_still_run(task, tiny_dir):
    """The lean forward calls a fast input quantizer's forward directly only where `Module.__call__` would
    run nothing else: a forward hook on it, or a process-wide one, is called, and changes the result."""
    from torch.nn.modules.module import register_module_forward_hook

    policy = _policy(task, tiny_dir, "nvfp4_w4a4")
    quantizer = policy.model.model.layers[0].self_attn.o_proj.input_quantizer
    with torch.no_grad():
        plain = answer_loss(policy, task)
    seen = []
    handle = quantizer.register_forward_hook(lambda module, args, output: seen.append(module) or output * 2)
    with torch.no_grad():
        hooked = answer_loss(policy, task)
    handle.remove()
    assert seen == [quantizer] * len(seen) and seen and not torch.equal(hooked, plain)
    seen.clear()
    handle = register_module_forward_hook(lambda module, args, output: seen.append(module) if module is quantizer else None)
    with torch.no_grad():
        assert torch.equal(answer_loss(policy, task), plain)
    handle.remove()
    assert seen


@pytest.mark.parametrize("fmt", ["nvfp4_a16", "fp8_w8a8"])
def test_a_linear_layers_plan_follows_every_change(task, tiny_dir, fmt):
    """A lean linear layer decides what its quantizers do once (`LinearPlan`) and reuses the decision while
    nothing changed; after every kind of change it decides again, and it always computes what the per-call
    checks (`quantized_linear`) and ModelOpt's own QuantLinear forward compute."""
    from modelopt.torch.quantization.nn.modules.quant_linear import _QuantLinear

    policy = _policy(task, tiny_dir, fmt, dtype="bfloat16")
    layer = _layer(policy)
    optimizer = PolicyOptimizer(policy, 1e-3, 0.0, 1.0)
    x = torch.randn(3, layer.in_features, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    x = x.to(layer.weight.device)

    def step() -> None:
        optimizer.backward(answer_loss(policy, task))
        optimizer.step()

    def planned() -> object:
        """The layer's output equals the per-call checks' and ModelOpt's; returns the plan it ran with."""
        with torch.no_grad():
            out = layer(x)
            plan = layer.__dict__["_qarl_plan"]
            assert torch.equal(out, quantized_linear(layer, x, layer.weight))
            assert torch.equal(out, _QuantLinear.forward(layer, x))  # (it writes attributes: planned anew then)
        return plan

    step()
    planned()  # ModelOpt's forward records the input dtype on the disabled quantizers it calls: once, a change
    plan = planned()
    assert plan.lean and plan.weight_fn is None  # the held weight is taken as it is
    assert (plan.input_fn is None) == (fmt == "nvfp4_a16")  # W8A8's input quantizer is called directly
    assert planned() is plan  # nothing changed: the same decision
    policy.model.train()
    policy.model.eval()  # a mode switch writes `training` on every quantizer: no change of what they compute
    assert planned() is plan

    weight_quantizer, input_quantizer = layer.weight_quantizer, layer.input_quantizer

    def in_place(write):
        def change() -> None:
            with torch.no_grad():
                write()
        return change

    changes = [
        ("weight written in place", in_place(lambda: layer.weight.mul_(1.5))),
        ("optimizer step", step),
        ("amax written in place", in_place(lambda: weight_quantizer._amax.mul_(0.5))),
        ("step", step),
        ("calibration switch written directly", lambda: setattr(weight_quantizer, "_if_calib", True)),
        ("switch back", lambda: setattr(weight_quantizer, "_if_calib", False)),
        ("input quantizer switched", lambda: setattr(input_quantizer, "_disabled", not input_quantizer._disabled)),
        ("output quantizer enabled", layer.output_quantizer.enable),
        ("output quantizer disabled", layer.output_quantizer.disable),
        ("amax moved", lambda: weight_quantizer.to(torch.float64)),
        ("step", step),
        ("held amax replaced behind the attributes",
         lambda: weight_quantizer._buffers.__setitem__("_amax", weight_quantizer._amax * 2)),
        ("step", step),
        ("smoothing scale on the input quantizer",
         lambda: setattr(input_quantizer, "pre_quant_scale", torch.full_like(x[0], 2.0))),
        ("smoothing scale off", lambda: setattr(input_quantizer, "_enable_pre_quant_scale", False)),
    ]
    for what, change in changes:
        change()
        new = planned()
        assert new is not plan, what
        plan = new
    assert plan.lean

    seen = []
    handle = weight_quantizer.register_forward_hook(lambda module, args, output: seen.append(module))
    assert not planned().lean and seen and set(seen) == {weight_quantizer}  # the hook runs: the quantizer is called
    handle.remove()
    step()  # a removed hook is noticed at the next change, not looked for at every call
    assert planned().lean

    layer.output_quantizer._rotate = True  # ModelOpt rotates even when disabled (its GPU-only transform)
    assert not plan_linear(layer, layer.weight).lean
    layer.output_quantizer._rotate = False

    replacement = TensorQuantizer()
    replacement.disable()
    layer.add_module("input_quantizer", replacement)  # an untracked quantizer: the per-call checks decide
    assert not planned().lean
