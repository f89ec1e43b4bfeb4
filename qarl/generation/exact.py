"""Exact forward, the engine's half: vLLM configured so that every token's computation is independent of
the batch it runs in, and the kernels it then runs, exposed so that the policy runs the very same ones
(`qarl/backends/exact_forward.py`). With both halves, the log-prob the engine samples a token with equals
the policy's teacher-forced log-prob of it bit for bit, quantized or not (`policy.exact_forward`).

What the engine runs in this mode (vLLM 0.26, Hopper):
  * `VLLM_BATCH_INVARIANT=1`: every linear layer and the LM head multiply with vLLM's persistent Triton
    matmul (`linear_batch_invariant`: a fixed tiling, the bias added after); aten's log_softmax, softmax,
    mean and bmm become vLLM's row-wise Triton kernels, process-wide (so the policy gets them too);
    cuBLAS runs without split-K and TF32 is off; FlashAttention runs with one KV split.
  * RMSNorm: vLLM's batch-invariant Triton kernel (one program per row). With a residual, vLLM calls a
    CUDA kernel whose thread count depends on how many tokens the batch has, which changes the order
    of its sum of squares; here the residual add is a separate elementwise add and the norm is the
    Triton kernel (`add_rms_norm`), on both sides.
  * rotary embedding and SiLU x mul: vLLM's CUDA kernels (elementwise, whatever the batch).
  * attention: FlashAttention 3 over the paged KV cache (blocks of `BLOCK_SIZE` tokens); the policy
    lays its keys and values out the same way and calls the same function (`attention`), so each
    query row runs the same kernel instance, decode or prefill.
  * the sampled token's log-prob: the v2 model runner's sampler, a fused Triton log-softmax-and-gather on
    the logits in the compute dtype (`token_logprobs`); aten's log_softmax on fp32 logits differs from it
    in the last bit for a few % of tokens (its loads, and so its sum's order, are laid out by dtype).
  * no torch.compile (Inductor would fuse these ops into kernels of its own choosing); with graphs on,
    decode steps replay CUDA graphs of the same kernels (`cudagraph_mode` FULL_DECODE_ONLY).
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

BLOCK_SIZE = 16  # tokens per KV-cache block, the engine's and the policy's attention layout
EXACT_KEY = "qarl_exact_forward"  # vLLM additional_config key: the engine runs the exact kernels


def enable_batch_invariance() -> None:
    """Put this process in vLLM's batch-invariant mode (aten's log_softmax, softmax, mean and bmm become its
    Triton kernels; cuBLAS settings without split-K, which cuBLAS reads once: call it early), with vLLM's v2
    model runner, whose sampler returns the log-probs `token_logprobs` computes. Before the engine starts
    (vLLM reads both variables then); idempotent, and checked: an engine started earlier in this process
    has frozen vLLM's view of the environment, which is thawed first."""
    import vllm.envs as envs

    envs.disable_envs_cache()
    os.environ["VLLM_BATCH_INVARIANT"] = "1"
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    from vllm.model_executor.layers.batch_invariant import init_batch_invariance

    init_batch_invariance()
    if not (envs.VLLM_BATCH_INVARIANT and envs.VLLM_USE_V2_MODEL_RUNNER):
        raise RuntimeError("policy.exact_forward: vLLM did not take VLLM_BATCH_INVARIANT=1 / VLLM_USE_V2_MODEL_RUNNER=1")


KERNELS = {  # what the exact forward calls in vLLM (present in vllm 0.26)
    "vllm.envs": ("disable_envs_cache",),
    "vllm.model_executor.layers.batch_invariant": ("init_batch_invariance", "linear_batch_invariant",
                                                   "rms_norm_batch_invariant"),
    "vllm.vllm_flash_attn": ("flash_attn_varlen_func",),
    "vllm.v1.worker.gpu.sample.logprob": ("compute_token_logprobs",),
    "vllm.v1.worker.gpu.sample.gumbel": ("apply_temperature",),
    "vllm.model_executor.layers.rotary_embedding": ("RotaryEmbedding",),
    "vllm._custom_ops": ("rotary_embedding",),
}


def missing_kernels() -> list[str]:
    """The vLLM functions of KERNELS this installation lacks (an empty list: all there)."""
    missing = []
    for module, names in KERNELS.items():
        try:
            found = importlib.import_module(module)
        except ImportError:
            missing.append(module)
            continue
        missing += [f"{module}.{name}" for name in names if not hasattr(found, name)]
    if "vllm._custom_ops" not in missing:
        importlib.import_module("vllm._custom_ops")  # registers torch.ops._C
        missing += [f"torch.ops._C.{op}" for op in ("rotary_embedding", "silu_and_mul") if not hasattr(torch.ops._C, op)]
    return missing


def engine_options(eager: bool) -> dict:
    """vLLM settings of an exact engine: FlashAttention, KV blocks of BLOCK_SIZE, no torch.compile, and
    (unless eager) CUDA graphs of whole decode steps."""
    options = {"attention_config": {"backend": "FLASH_ATTN", "flash_attn_version": 3}, "block_size": BLOCK_SIZE}
    if not eager:
        options["compilation_config"] = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}
    return options


# -- the kernels both sides run ------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    from vllm.model_executor.layers.batch_invariant import rms_norm_batch_invariant

    return rms_norm_batch_invariant(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual): the decoder's residual stream and the next layer's input."""
    total = x + residual
    return rms_norm(total, weight, eps), total


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    from vllm.model_executor.layers.batch_invariant import linear_batch_invariant

    return linear_batch_invariant(x, weight, bias)


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, head_size: int,
           cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary embedding of q and k ([tokens, heads * head_size]), on copies (vLLM's kernel
    writes in place)."""
    from vllm import _custom_ops as ops

    q, k = q.contiguous().clone(), k.contiguous().clone()
    ops.rotary_embedding(positions, q, k, head_size, cos_sin_cache, True)
    return q, k


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :d]) * x[..., d:], vLLM's kernel."""
    importlib.import_module("vllm._custom_ops")  # loads torch.ops._C

    out = torch.empty(x.shape[:-1] + (x.shape[-1] // 2,), dtype=x.dtype, device=x.device)
    torch.ops._C.silu_and_mul(out, x.contiguous())
    return out


@dataclass
class PagedLayout:
    """Where packed sequences' keys and values go in a paged cache of BLOCK_SIZE-token blocks, as the engine
    keeps them, and the index tensors FlashAttention reads (built once per forward, shared by the layers)."""

    query_lengths: list[int]
    key_lengths: list[int]
    cu_seqlens_q: torch.Tensor  # int32 [sequences + 1]
    seqused_k: torch.Tensor  # int32 [sequences]
    block_table: torch.Tensor  # int32 [sequences, most blocks]
    slots: torch.Tensor  # int64 [keys]: each packed key's row in the flattened cache
    blocks: int

    @classmethod
    def build(cls, query_lengths: list[int], key_lengths: list[int], device: torch.device) -> PagedLayout:
        per_sequence = [-(-n // BLOCK_SIZE) for n in key_lengths]
        first_block = torch.tensor([0] + per_sequence[:-1], device=device).cumsum(0)
        keys = torch.tensor(key_lengths, device=device)
        sequence = torch.repeat_interleave(torch.arange(len(key_lengths), device=device), keys)
        starts = F.pad(keys.cumsum(0), (1, 0))[:-1]
        position = torch.arange(int(sum(key_lengths)), device=device) - starts[sequence]
        table = first_block[:, None] + torch.arange(max(per_sequence), device=device)
        return cls(query_lengths, key_lengths,
                   F.pad(torch.tensor(query_lengths, device=device).cumsum(0), (1, 0)).to(torch.int32),
                   keys.to(torch.int32), table.clamp(max=sum(per_sequence) - 1).to(torch.int32),
                   first_block[sequence] * BLOCK_SIZE + position, sum(per_sequence))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: PagedLayout, scale: float) -> torch.Tensor:
    """Causal attention of packed sequences (q: [queries, heads, dim], k/v: [keys, kv heads, dim]; a
    sequence's queries are its last tokens) as the engine computes it: keys and values in a paged cache,
    FlashAttention 3 with one KV split."""
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    caches = []
    for t in (k, v):
        cache = t.new_zeros((layout.blocks * BLOCK_SIZE,) + t.shape[1:])
        cache[layout.slots] = t
        caches.append(cache.view(layout.blocks, BLOCK_SIZE, *t.shape[1:]))
    return flash_attn_varlen_func(
        q, caches[0], caches[1], max_seqlen_q=max(layout.query_lengths), cu_seqlens_q=layout.cu_seqlens_q,
        max_seqlen_k=max(layout.key_lengths), seqused_k=layout.seqused_k, softmax_scale=scale, causal=True,
        block_table=layout.block_table, fa_version=3, num_splits=1,
    )


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log_softmax(logits / temperature)[token] of each row of [rows, vocab] logits in the compute dtype, as
    vLLM's sampler computes the log-prob it returns: the logits divided in place and stored back in their
    dtype (temperature other than 0 and 1), then its fused log-softmax-and-gather kernel."""
    from vllm.v1.worker.gpu.sample.gumbel import apply_temperature
    from vllm.v1.worker.gpu.sample.logprob import compute_token_logprobs

    logits = logits.contiguous().clone()
    rows = logits.shape[0]
    if temperature not in (0.0, 1.0):
        apply_temperature(logits, torch.arange(rows, dtype=torch.int32, device=logits.device),
                          torch.full((rows,), temperature, dtype=torch.float32, device=logits.device))
    return compute_token_logprobs(logits, tokens[:, None])[:, 0]


def head_size(config) -> int:
    """A Hugging Face config's attention head size."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_theta(config) -> float | None:
    """A Hugging Face config's rotary base, or None when its rotary embedding is not the plain one (scaled,
    partial): the exact forward runs vLLM's plain `RotaryEmbedding` only."""
    rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    if rope.get("rope_type", rope.get("type", "default")) != "default" or rope.get("partial_rotary_factor", 1.0) != 1.0:
        return None
    return rope.get("rope_theta", getattr(config, "rope_theta", None))


def rope_cache(config, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The cos/sin table of the model's rotary embedding as vLLM builds it (its own class, made on `device`
    as the engine makes it on the GPU); the engine checks its own against it as it starts."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding

    size = head_size(config)
    with torch.device(device), set_current_vllm_config(VllmConfig()):  # a CustomOp reads vLLM's (default) settings
        rope = RotaryEmbedding(size, size, config.max_position_embeddings, rope_theta(config), True, dtype)
    return rope.cos_sin_cache


# -- the engine side ------------------------------------------------------------------------------------
def install(model: nn.Module) -> None:
    """Make a vLLM model run the kernels above: RMSNorm as `rms_norm` / `add_rms_norm`, rotary embedding
    and SiLU x mul as their CUDA kernels, whatever vLLM's custom-op settings would pick."""
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding

    for module in model.modules():
        if isinstance(module, RMSNorm):
            module._forward_method = partial(_engine_norm, module)
        elif isinstance(module, SiluAndMul):
            module._forward_method = module.forward_cuda
        elif type(module) is RotaryEmbedding:
            module._forward_method = module.forward_cuda


def _engine_norm(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor | None = None):
    """An engine RMSNorm's forward in exact mode (vLLM's signature: (x) or (x, residual))."""
    weight, eps = norm.weight.data, norm.variance_epsilon
    return rms_norm(x, weight, eps) if residual is None else add_rms_norm(x, residual, weight, eps)


def check_engine(model: nn.Module, config, dtype: torch.dtype) -> None:
    """The engine's rotary table is the one the policy computes (`rope_cache`)."""
    from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding

    engine_cache = next(m for m in model.modules() if type(m) is RotaryEmbedding).cos_sin_cache
    if not torch.equal(engine_cache, rope_cache(config, dtype, engine_cache.device)):
        raise RuntimeError("policy.exact_forward: the engine's rotary cos/sin table differs from the one the policy "
                           "computes; this vLLM builds it another way")
