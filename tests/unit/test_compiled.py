"""Compiled elementwise layers (`policy.compile_norms`, `policy.compile_mlp`, qarl/models/compiled.py): the policy's
logits and gradients within rounding of the eager ones, one graph for every sequence length, through gradient
checkpointing, a deep copy and a qlora base; refused where the layers must be others (the exact forward, Megatron) or
where the model has no MLP the fusion knows."""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo

from qarl.config import ConfigError, LoraConfig, PolicyConfig
from qarl.models.compiled import gated_mlps, rms_norms
from qarl.models.resolve import resolve_model_dir
from tests.conftest import W4A16, answer_loss, eval_logits, tiny_policy


def test_compiled_layers_give_the_eager_numbers_within_rounding_in_one_graph(task, tiny_dir):
    knobs = {"compile_norms": True, "compile_mlp": True}
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eager = tiny_policy(task, tiny_dir, W4A16, trainable=True)
    fused = tiny_policy(task, tiny_dir, W4A16, trainable=True, gradient_checkpointing="on", **knobs)
    assert len(rms_norms(fused.model)) == 2 * 2 + 1  # two a layer and the final one
    assert len(gated_mlps(fused.model)) == 2
    assert torch.allclose(eval_logits(fused, task), eval_logits(eager, task), rtol=0, atol=1e-5)
    answer_loss(eager, task).backward()
    answer_loss(fused, task).backward()
    for (name, a), b in zip(eager.model.named_parameters(), fused.model.parameters(), strict=True):
        if a.grad is not None:
            assert (a.grad - b.grad).abs().max() <= 1e-5 * a.grad.abs().max(), name  # fp32 rounding
    ids = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10, 11]], device=fused.device)  # another length: no new graph
    with torch.no_grad():
        fused.model(input_ids=ids[:, :4])  # the inference graphs, once
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with torch.no_grad():
        fused.model(input_ids=ids)
        reference = copy.deepcopy(fused.model)  # a KL reference is a copy of the policy
        for mlp in gated_mlps(reference):  # each copied MLP runs its own projections
            assert mlp.forward.__self__ is mlp
        reference(input_ids=ids)
    assert not torch._dynamo.utils.counters["graph_break"]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs

    qlora, plain = (tiny_policy(task, tiny_dir, W4A16, trainable=True, lora=LoraConfig(mode="qlora"),
                                **(knobs if compiled else {})) for compiled in (True, False))  # with a packed base
    assert torch.allclose(eval_logits(qlora, task), eval_logits(plain, task), rtol=0, atol=1e-5)


@pytest.mark.parametrize("knob", ["compile_norms", "compile_mlp"])
def test_compiled_layers_are_refused_where_the_layers_must_be_others(knob):
    with pytest.raises(ConfigError, match=knob):
        PolicyConfig(exact_forward=True, dtype="bfloat16", **{knob: True})
    from qarl.backends.megatron_policy import check

    with pytest.raises(ConfigError, match=knob):
        check(PolicyConfig(backend="megatron", **{knob: True}))


def test_a_model_without_a_known_gated_mlp_is_refused_by_name_before_it_loads(task, monkeypatch):
    phi3 = resolve_model_dir("embedded:tiny-phi3")  # gate and up fused in one projection: not a known gated MLP

    def load_model(*args, **kwargs):
        raise AssertionError("the weights loaded before the refusal")

    monkeypatch.setattr("qarl.backends.hf.load_model", load_model)
    with pytest.raises(ConfigError, match="Phi3MLP.*compile_mlp=false"):
        tiny_policy(task, phi3, W4A16, trainable=True, compile_mlp=True)
