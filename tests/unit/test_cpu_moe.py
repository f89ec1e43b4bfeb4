"""The CPU policy's MoE block computes each token as the CPU rollout engine's does (qarl/models/cpu_moe.py), without
vLLM: routing in transformers' order, and a token's output the same bits whatever other rows share its call (the
engine computes a few rows a step, the policy a whole micro-batch), quantized or not. With vLLM (the synced parity
of the realistic MoE models exactly 0): tests/integration/test_realistic_parity.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from qarl.models.cpu_moe import CpuMoeBlock, enable_cpu_moe, route
from qarl.models.resolve import resolve_model_dir
from tests.conftest import tiny_policy

# calls of other shapes than the whole batch's (the engine's steps: it computes a step of fewer than CPU_TALL_ROWS rows
# as that many, `vllm_compat.tall_linear`, and so does the policy a micro-batch of that many tokens)
ROWS = (16, 17, 18, 19, 33, 50)


def moe_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(m, CpuMoeBlock)]


@pytest.mark.parametrize("renormalize", [True, False])
def test_routing_is_transformers_routers(renormalize):
    model = AutoModelForCausalLM.from_pretrained(resolve_model_dir("embedded:tiny-qwen2moe"), dtype=torch.float32)
    router = model.model.layers[0].mlp.gate
    router.norm_topk_prob = renormalize
    x = torch.randn(300, router.hidden_dim, generator=torch.Generator().manual_seed(0)) * 4
    _, weights, experts = router(x)
    ours = route(F.linear(x, router.weight), router.top_k, renormalize)
    assert torch.equal(ours[0], weights) and torch.equal(ours[1], experts)


@pytest.mark.parametrize("family", ["qwen2moe", "qwen3moe"])
def test_a_tokens_moe_output_is_the_same_whatever_rows_share_its_call(family):
    model = AutoModelForCausalLM.from_pretrained(resolve_model_dir(f"embedded:tiny-{family}"), dtype=torch.float32,
                                                 experts_implementation="eager")
    assert enable_cpu_moe(model) == model.config.num_hidden_layers
    block = moe_blocks(model)[0]
    # a router that sends nearly every token to one expert: the others see a few rows, even in the whole batch
    block.gate.weight.data[0] += 5 * block.gate.weight.data[0].sign()
    x = torch.randn(1, 203, model.config.hidden_size, generator=torch.Generator().manual_seed(1)) * 3
    with torch.no_grad():
        whole = block(x)[0]
        for rows in ROWS:
            for start in range(0, 203 - rows, 41):
                assert torch.equal(block(x[:, start:start + rows])[0], whole[start:start + rows]), (rows, start)


def test_a_quantized_policy_keeps_the_cpu_moe_block_and_its_gradients_are_finite(task):
    """ModelOpt wraps the block's class as it is (the CPU block's forward stays), W4A4 quantizes the padded rows too
    (copies of a real row: no zero block scale), and no gradient reaches them."""
    policy = tiny_policy(task, resolve_model_dir("embedded:tiny-qwen2moe"), "quant_configs/nvfp4_w4a4.yaml",
                         trainable=True)
    blocks = moe_blocks(policy.model)
    assert len(blocks) == policy.model.config.num_hidden_layers
    x = torch.randn(1, 37, policy.model.config.hidden_size, requires_grad=True)
    out = blocks[0](x)
    with torch.no_grad():
        for rows in ROWS:
            assert torch.equal(blocks[0](x[:, :rows])[0], out[0, :rows]), rows
    out.square().sum().backward()
    grads = [p.grad for p in blocks[0].parameters() if p.grad is not None] + [x.grad]
    assert len(grads) > 1 and all(torch.isfinite(g).all() for g in grads)
