"""Packed micro-batches attend through torch's variable-length flash attention.

Packed rows (`trainer.max_tokens_per_micro_batch`, qarl/scoring.py) put a micro-batch's sequences back to back in one
row with positions restarting at each. Under transformers' SDPA attention that row needs a dense block-diagonal mask,
and a masked SDPA call runs the memory-efficient kernel over every (query, key) pair of the whole row, the
other sequences' included: the attention's work grows with the square of the micro-batch's tokens, not of each
sequence's. `torch.nn.attention.varlen.varlen_attn` takes the sequences' boundaries (`cu_seqlens`) instead and runs
FlashAttention within each, causal, with its own backward.

`enable_varlen_attention` registers one transformers attention function, "qarl_varlen", on a model that used SDPA:
a call that carries the boundaries (the packed rows' `cu_seq_lens_q`, transformers' own name for them) and that the
kernel serves (CUDA, bf16 or fp16, no dropout, no sliding window or soft-capping) runs varlen, and no mask is built
for it; every other call (padded rows, CPU, fp32) is transformers' SDPA with the mask SDPA builds, as before. The two
kernels round differently: packed and padded scores of the same tokens agree to bf16 rounding, not bit for bit (the
exact forward, which must match the engine's bits, never packs).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTENTION = "qarl_varlen"  # the name registered with transformers
HALF = (torch.bfloat16, torch.float16)  # the dtypes FlashAttention computes in


def varlen_available() -> bool:
    """Whether this torch has `torch.nn.attention.varlen.varlen_attn` (every tested torch does; an older one run
    with QARL_ALLOW_UNTESTED_VERSIONS=1 keeps SDPA)."""
    return importlib.util.find_spec("torch.nn.attention.varlen") is not None


@functools.cache
def varlen_parameters() -> frozenset[str]:
    """The names `varlen_attn` takes in this torch."""
    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


def varlen_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_length: int,
                  scale: float) -> torch.Tensor:
    """Causal attention within each sequence of packed [tokens, heads, head dim] q, k, v (k and v may have fewer
    heads: grouped-query attention). torch 2.11 (checked on the H100) takes `scale` and `window_size=(-1, 0)` for
    causal but no `enable_gqa` (the key/value heads are repeated); 2.13 (CPU) adds `enable_gqa`."""
    from torch.nn.attention.varlen import varlen_attn

    options: dict = {"scale": scale, "window_size": (-1, 0)}
    if k.shape[1] != q.shape[1]:  # each key/value head serves a group of query heads
        if "enable_gqa" in varlen_parameters():
            options["enable_gqa"] = True
        else:
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    cu_seqlens = cu_seqlens.to(torch.int32)
    return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_length, max_length, **options)


def serves(module: torch.nn.Module, query: torch.Tensor, dropout: float, kwargs: dict) -> bool:
    """Whether the varlen kernel computes this attention call as the model defines it: not a sliding-window layer
    (its window passed in the call, or only held by the layer and put in the mask, as Qwen2-MoE does)."""
    return (kwargs.get("cu_seq_lens_q") is not None and query.is_cuda and query.shape[0] == 1
            and query.dtype in HALF and not dropout
            and kwargs.get("sliding_window") is None and getattr(module, "sliding_window", None) is None
            and kwargs.get("softcap") is None and kwargs.get("s_aux") is None)


def mask_needed(batch_size: int, attention_mask: torch.Tensor | None, dtype: torch.dtype | None,
                device: torch.device | str, config: object) -> bool:
    """Whether the layers need SDPA's mask. Not for one row without padding on CUDA in bf16/fp16 of a model without
    sliding windows, soft-capping or attention dropout: packed, its sequences attend through varlen (`serves`);
    alone, through SDPA's causal kernel. A packed row's block-diagonal mask would hold tokens^2 booleans."""
    return not (attention_mask is None and batch_size == 1 and dtype in HALF and torch.device(device).type == "cuda"
                and not getattr(config, "sliding_window", None) and not getattr(config, "attn_logit_softcapping", None)
                and not getattr(config, "attention_dropout", 0.0))


def varlen_mask(*args, **kwargs) -> torch.Tensor | None:
    """transformers' mask-function contract: SDPA's mask where `mask_needed`, else none."""
    if mask_needed(kwargs.get("batch_size", 0), kwargs.get("attention_mask"), kwargs.get("dtype"),
                   kwargs.get("device", "cpu"), kwargs.get("config")):
        return sdpa_mask(*args, **kwargs)
    return None


@torch.compiler.disable
def varlen_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0,
                             scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: [batch, heads, tokens, head dim] in, [batch, tokens, heads,
    head dim] out. Varlen where `serves`, else SDPA with `attention_mask` (which SDPA's mask function built).
    Never traced into a compiled decoder layer (`policy.compile_layers`): the kernel is one op either way, and the
    longest sequence, a Python int that changes with every packed micro-batch, would be guarded on."""
    if not serves(module, query, dropout, kwargs):
        boundaries = kwargs.get("cu_seq_lens_q")
        if attention_mask is None and boundaries is not None and len(boundaries) > 2:
            raise RuntimeError(f"{len(boundaries) - 1} sequences packed in one row reached {type(module).__name__} "
                               "without a mask, and the varlen kernel cannot serve this call (its dtype, device, "
                               "dropout, sliding window, soft-capping or sinks): "
                               "set trainer.max_tokens_per_micro_batch=0")
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    out = varlen_causal(q, k, v, kwargs["cu_seq_lens_q"], int(kwargs["max_length_q"]), scale)
    return out[None], None


def packed_attention_kwargs(cu_seqlens: torch.Tensor, longest: int) -> dict:
    """The boundaries of sequences packed back to back (their cumulative lengths from 0, int32, on the model's
    device) and the longest one's length, as the attention function reads them."""
    return {"cu_seq_lens_q": cu_seqlens, "cu_seq_lens_k": cu_seqlens, "max_length_q": longest, "max_length_k": longest}


def enable_varlen_attention(model: PreTrainedModel) -> bool:
    """Switch `model` from SDPA to "qarl_varlen" (a no-op where varlen is unavailable or the model does not use
    SDPA); returns whether it did."""
    if not varlen_available() or getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    AttentionInterface.register(ATTENTION, varlen_attention_forward)
    AttentionMaskInterface.register(ATTENTION, varlen_mask)
    model.set_attn_implementation(ATTENTION)
    return True
