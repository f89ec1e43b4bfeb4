"""Compiled RMSNorm layers (`policy.compile_norms`, qarl/models/norms.py): the policy's logits and gradients within
fp32 rounding of the eager ones, one graph for every sequence length, through gradient checkpointing and a qlora
base; refused where the norms must be the engine's own (the exact forward) or are not transformers' (Megatron)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo

from qarl.config import ConfigError, LoraConfig, PolicyConfig
from qarl.models.norms import rms_norms
from tests.conftest import W4A16, answer_loss, eval_logits, tiny_policy


def test_compiled_norms_give_the_eager_numbers_within_rounding_in_one_graph(task, tiny_dir):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eager = tiny_policy(task, tiny_dir, W4A16, trainable=True)
    fused = tiny_policy(task, tiny_dir, W4A16, trainable=True, compile_norms=True, gradient_checkpointing="on")
    assert len(rms_norms(fused.model)) == 2 * 2 + 1  # two a layer and the final one
    assert torch.allclose(eval_logits(fused, task), eval_logits(eager, task), rtol=0, atol=1e-5)
    answer_loss(eager, task).backward()
    answer_loss(fused, task).backward()
    for (name, a), b in zip(eager.model.named_parameters(), fused.model.parameters(), strict=True):
        if a.grad is not None:
            assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-6), name
    ids = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10, 11]])  # another length: no new graph
    with torch.no_grad():
        fused.model(input_ids=ids)
        copy.deepcopy(fused.model)(input_ids=ids)  # a KL reference is a copy of the policy
    assert not torch._dynamo.utils.counters["graph_break"] and not torch._dynamo.utils.counters["recompiles"]

    qlora, reference = (tiny_policy(task, tiny_dir, W4A16, trainable=True, lora=LoraConfig(mode="qlora"),
                                    compile_norms=compiled) for compiled in (True, False))  # with a packed base
    assert torch.allclose(eval_logits(qlora, task), eval_logits(reference, task), rtol=0, atol=1e-5)


def test_compiled_norms_are_refused_where_the_norms_must_be_others():
    with pytest.raises(ConfigError, match="compile_norms"):
        PolicyConfig(exact_forward=True, dtype="bfloat16", compile_norms=True)
    from qarl.backends.megatron_policy import check

    with pytest.raises(ConfigError, match="compile_norms"):
        check(PolicyConfig(backend="megatron", compile_norms=True))
