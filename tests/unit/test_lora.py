"""LoRA over a frozen fake-quantized base (qarl/lora.py), in process: the two modes' math, what trains, the KL
reference, and bad settings. The engine's adapters and the exports: tests/integration/test_lora_engine.py; training,
checkpoints, exact resume after SIGKILL: tests/e2e/test_lora_runs.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qarl.config import ConfigError, LoraConfig, PolicyConfig
from qarl.lora import AdapterDisabled, adapter_output, adapters_disabled, check_lora, lora_layers, merged_weight
from qarl.optim import PolicyOptimizer
from qarl.quant import folded_weights
from tests.conftest import W4A16, answer_loss, eval_logits, lora_policy, tiny_policy


@pytest.mark.parametrize("mode", ["qlora", "merged"])
def test_each_mode_computes_its_formula_and_starts_at_the_base(task, tiny_dir, mode):
    base = tiny_policy(task, tiny_dir, W4A16)
    fresh = lora_policy(task, tiny_dir, mode, random_b=False)
    assert torch.equal(eval_logits(fresh, task), eval_logits(base, task))  # B = 0: the adapted model is the base
    policy = lora_policy(task, tiny_dir, mode)
    name, layer = next(lora_layers(policy.model))
    x = torch.randn(3, layer.in_features)
    with torch.no_grad():
        got = layer(x)
        q_x = layer.input_quantizer(x) if layer.input_quantizer.is_enabled else x
        if mode == "qlora":  # Q(W) x + s B A x
            want = F.linear(q_x, layer.weight_quantizer(layer.weight), layer.bias) + adapter_output(
                x, layer.lora_A, layer.lora_B, layer.lora_scale)
        else:  # Q(W + s B A) x
            w = merged_weight(layer.weight, layer.lora_A, layer.lora_B, layer.lora_scale)
            want = F.linear(q_x, layer.weight_quantizer(w), layer.bias)
    assert torch.equal(got, want)
    assert not torch.equal(eval_logits(policy, task), eval_logits(base, task))
    with adapters_disabled(policy.model):  # the KL reference: the base, no copy
        assert torch.equal(eval_logits(policy, task), eval_logits(base, task))
    reference = policy.kl_reference(lambda: pytest.fail("a LoRA policy needs no second model"))
    assert isinstance(reference, AdapterDisabled) and reference.policy is policy.model
    # the fold the engine loads: Q(W) for qlora (the adapter travels separately), Q(W + s B A) merged
    folded = dict(folded_weights(policy.model))
    assert not any(k.endswith(("lora_A", "lora_B")) for k in folded)
    want_fold = layer.weight_quantizer(layer.served_weight())
    assert torch.equal(folded[f"{name}.weight"], want_fold)


@pytest.mark.parametrize("mode", ["qlora", "merged"])
def test_only_the_adapters_train(task, tiny_dir, mode):
    policy = lora_policy(task, tiny_dir, mode)
    assert policy.master is None  # a frozen base needs no master copy
    optimizer = PolicyOptimizer(policy, lr=1e-2, weight_decay=0.0, max_grad_norm=1.0)
    adapters = {id(p) for _, layer in lora_layers(policy.model) for p in (layer.lora_A, layer.lora_B)}
    assert {id(p) for p in optimizer.params} == adapters
    with adapters_disabled(policy.model):  # the weights the base computes with (a qlora base is packed)
        base = {n: w.clone() for n, w in folded_weights(policy.model)}
    before = {id(p): p.detach().clone() for p in optimizer.params}
    optimizer.backward(answer_loss(policy, task))
    assert optimizer.step().applied
    with adapters_disabled(policy.model):
        assert all(torch.equal(w, base[n]) for n, w in folded_weights(policy.model))
    assert all(not torch.equal(p, before[id(p)]) for p in optimizer.params)


def test_bad_lora_settings_are_refused_before_loading(tiny_dir):
    cases = [
        (LoraConfig(mode="qlora", target_modules=["nope_proj"]), "match no linear layer"),
        (LoraConfig(mode="qlora", rank=100), "exceeds the smaller side"),
        (LoraConfig(mode="merged", dropout=0.1), "needs mode=qlora"),
        (LoraConfig(mode="qlora", rank=0), "rank must be >= 1"),
        (LoraConfig(mode="lora"), "choose one of"),
    ]
    for lora, needle in cases:
        with pytest.raises(ConfigError, match=needle):
            check_lora(PolicyConfig(lora=lora), tiny_dir)
    cfg = PolicyConfig(lora=LoraConfig(mode="qlora"))
    cfg.generation.tensor_parallel_size = 2
    with pytest.raises(ConfigError, match="tensor_parallel_size=1"):
        check_lora(cfg, tiny_dir)
