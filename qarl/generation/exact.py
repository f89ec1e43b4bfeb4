"""Exact forward, the engine's half: vLLM configured so that every token's computation is independent of
the batch it runs in, and the kernels it then runs, exposed so that the policy runs the very same ones
(`qarl/backends/exact_forward.py`). With both halves, the log-prob the engine samples a token with equals
the policy's teacher-forced log-prob of it bit for bit, quantized or not (`policy.exact_forward`).

What the engine runs in this mode (vLLM 0.26, Hopper):
  * `VLLM_BATCH_INVARIANT=1`: aten's log_softmax, softmax, mean and bmm become vLLM's row-wise Triton kernels,
    process-wide (so the policy gets them too); cuBLAS runs without split-K (a 1 KiB cuBLASLt workspace) and TF32
    is off; FlashAttention runs with one KV split.
  * every linear layer and the LM head: `F.linear` (`linear`), pinned in place of vLLM's persistent Triton matmul,
    which its linear layers call in this mode. On Hopper and later that is cuBLAS without split-K, which gives a
    row the same bits at every batch size (checked per shape by `benchmarks/exact_matmul.py` and by the GPU tests);
    on Ampere vLLM's mode routes aten's linear to that Triton matmul itself.
  * RMSNorm: vLLM's batch-invariant Triton kernel (one program per row). With a residual, vLLM calls a
    CUDA kernel whose thread count depends on how many tokens the batch has, which changes the order
    of its sum of squares; here the residual add is a separate elementwise add and the norm is the
    Triton kernel (`add_rms_norm`), on both sides.
  * rotary embedding and SiLU x mul: vLLM's CUDA kernels (elementwise, whatever the batch).
  * attention: FlashAttention 3 over the paged KV cache (blocks of `BLOCK_SIZE` tokens); the policy
    lays its keys and values out the same way and calls the same function (`attention`): the prompt as
    a prefill and, where FlashAttention decodes with other tiles than it prefills (head size 64, not
    128: `decode_matches_prefill`), each completion token as a decode step, so each query row runs the
    kernel instance the engine ran it with. That holds where the engine prefills every prompt before its
    first decode step (a rollout's prompts fit one step's token budget); a step mixing the two runs
    decode rows with the prefill's tiles. With an FP8 KV cache (`kv_cache_dtype="fp8"`): keys and values
    stored by vLLM's cache-write kernel, queries quantized by its `QuantFP8` CUDA kernel (pinned), FlashAttention
    3 in FP8 with their scales (`fp8_cache_attention`; written against 0.26's source, not yet run on a GPU).
  * the sampled token's log-prob: the v2 model runner's sampler, a fused Triton log-softmax-and-gather on
    the logits in the compute dtype (`token_logprobs`); aten's log_softmax on fp32 logits differs from it
    in the last bit for a few % of tokens (its loads, and so its sum's order, are laid out by dtype).
  * no torch.compile (Inductor would fuse these ops into kernels of its own choosing); with graphs on,
    decode steps replay CUDA graphs of the same kernels (`cudagraph_mode` FULL_DECODE_ONLY).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from qarl.generation import vllm_compat
from qarl.generation.vllm_compat import ROTARY_TYPES
from qarl.transfer import to_device

BLOCK_SIZE = 16  # tokens per KV-cache block, the engine's and the policy's attention layout
EXACT_KEY = "qarl_exact_forward"  # vLLM additional_config key: the engine runs the exact kernels


def enable_batch_invariance() -> None:
    """Put this process in vLLM's batch-invariant mode (aten's log_softmax, softmax, mean and bmm become its
    Triton kernels; cuBLAS settings without split-K, which cuBLAS reads once: call it early), with vLLM's v2
    model runner, whose sampler returns the log-probs `token_logprobs` computes. Before the engine starts
    (vLLM reads both variables then); idempotent, and checked: an engine started earlier in this process
    has frozen vLLM's view of the environment, which is thawed first (`vllm_compat.enable_batch_invariance`)."""
    if not vllm_compat.enable_batch_invariance():
        raise RuntimeError("policy.exact_forward: vLLM did not take VLLM_BATCH_INVARIANT=1 / VLLM_USE_V2_MODEL_RUNNER=1")
    if torch.cuda.is_available():
        check_linear_invariance(torch.device("cuda"))


def check_linear_invariance(device: torch.device) -> None:
    """`linear` gives a row the same bits alone and in a batch, at a shape where cuBLAS would split K if it could (few
    outputs, a long sum). It cannot once vLLM's mode has set a 1 KiB cuBLASLt workspace, but cuBLAS reads that size
    once, at its first matmul in the process: one that ran earlier keeps split-K for good."""
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(64, 8192, device=device, generator=g).bfloat16()
    w = torch.randn(256, 8192, device=device, generator=g).bfloat16()
    b = torch.randn(256, device=device, generator=g).bfloat16()
    whole = linear(x, w, b)
    if not all(torch.equal(linear(x[:rows].clone(), w, b), whole[:rows]) for rows in (1, 2, 7)):
        raise RuntimeError("policy.exact_forward: a matmul row's bits depend on its batch in this process: cuBLAS ran a "
                           "matmul before vLLM's batch-invariant mode set its workspace (cuBLAS reads it once). Start "
                           "the exact forward before any GPU matmul of the process (qarl does, before a warm start)")


def missing_kernels() -> list[str]:
    """The vLLM functions the exact forward calls that this installation lacks (`vllm_compat.KERNELS`; an empty
    list: all there)."""
    return vllm_compat.missing_kernels()


def engine_options(eager: bool) -> dict:
    """vLLM settings of an exact engine: FlashAttention, KV blocks of BLOCK_SIZE, no torch.compile, and
    (unless eager) CUDA graphs of whole decode steps."""
    options = {"attention_config": {"backend": "FLASH_ATTN", "flash_attn_version": 3}, "block_size": BLOCK_SIZE}
    if not eager:
        options["compilation_config"] = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}
    return options


# -- the kernels both sides run ------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return vllm_compat.invariant_rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual): the decoder's residual stream and the next layer's input."""
    total = x + residual
    return rms_norm(total, weight, eps), total


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b, x made contiguous: cuBLAS picks its kernel by the operands' layout too, and the engine's inputs
    are contiguous."""
    return F.linear(x.contiguous(), weight, bias)


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, head_size: int,
           cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary embedding of q and k ([tokens, heads * head_size]), on copies (vLLM's kernel
    writes in place)."""
    q, k = q.contiguous().clone(), k.contiguous().clone()
    vllm_compat.rotary_embedding_(positions, q, k, head_size, cos_sin_cache, True)
    return q, k


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :d]) * x[..., d:], vLLM's kernel."""
    out = torch.empty(x.shape[:-1] + (x.shape[-1] // 2,), dtype=x.dtype, device=x.device)
    vllm_compat.silu_and_mul_(out, x.contiguous())
    return out


@dataclass
class Queries:
    """One FlashAttention call's queries: which packed rows they are (None: all), and the index tensors it reads."""

    rows: torch.Tensor | None  # int64 [queries]
    cu_seqlens_q: torch.Tensor  # int32 [sequences + 1]
    seqused_k: torch.Tensor  # int32 [sequences]
    block_table: torch.Tensor  # int32 [sequences, most blocks]
    max_q: int
    max_k: int


@dataclass
class PagedLayout:
    """Where packed sequences' keys and values go in a paged cache of BLOCK_SIZE-token blocks, as the engine keeps
    them, and the queries of the two ways the engine computes a token: in its sequence's prefill (the prompt, many
    queries at once, FlashAttention's causal kernel) or in a decode step (one query a sequence). For some head
    sizes FlashAttention runs a decode step with other tiles than the prefill, and the bits differ past the first
    tile of keys (`decode_matches_prefill`); the policy then computes the completion's tokens as decode steps.
    Built once per forward, shared by the layers."""

    prefill: Queries
    decode: Queries | None
    slots: torch.Tensor  # int64 [keys]: each packed key's row in the flattened cache
    blocks: int

    @classmethod
    def build(cls, lengths: list[int], prefill_lengths: list[int], device: torch.device) -> PagedLayout:
        """`lengths` tokens a sequence, the first `prefill_lengths` of each computed as its prefill, each one after
        them as a decode step. Laid out on the host and sent in one copy (`qarl.transfer.to_device`): nothing here
        waits for the GPU."""
        host, sizes = cls.host(lengths, prefill_lengths)
        return cls.from_parts(dict(zip(host, to_device(list(host.values()), device))), sizes)

    @staticmethod
    def host(lengths: list[int], prefill_lengths: list[int], static: tuple[int, int] | None = None
             ) -> tuple[dict[str, torch.Tensor], tuple[int, int, int]]:
        """`build`'s int64 tensors on the host, by name, and its sizes (cache blocks, longest prefill, longest
        sequence). `static` (cache blocks, longest sequence): sizes held fixed whatever the lengths, as a CUDA graph
        replays them (qarl/graphs.py); sequences may then be empty, and every one is a prefill."""
        per_sequence = [-(-n // BLOCK_SIZE) for n in lengths]
        blocks, longest = static or (sum(per_sequence), max(lengths))
        first_block = torch.tensor([0] + per_sequence[:-1]).cumsum(0)
        sequence = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])  # (a CPU repeat_interleave: slower)
        position = torch.cat([torch.arange(n) for n in lengths])
        table = (first_block[:, None] + torch.arange(-(-longest // BLOCK_SIZE))).clamp(max=blocks - 1)
        prefilled = torch.tensor(prefill_lengths)
        host = {"slots": first_block[sequence] * BLOCK_SIZE + position, "table": table,
                "prefill_cu": F.pad(prefilled.cumsum(0), (1, 0)), "prefilled": prefilled}
        if list(prefill_lengths) != list(lengths):
            if static:
                raise ValueError("a static paged layout computes every sequence as a prefill")
            rows = (position >= prefilled[sequence]).nonzero().squeeze(1)
            host.update(prefill_rows=(position < prefilled[sequence]).nonzero().squeeze(1), decode_rows=rows,
                        decode_cu=torch.arange(rows.numel() + 1), decode_used=position[rows] + 1,
                        decode_sequence=sequence[rows])
        return host, (blocks, longest if static else max(prefill_lengths), longest)

    @classmethod
    def from_parts(cls, moved: dict[str, torch.Tensor], sizes: tuple[int, int, int]) -> PagedLayout:
        """The layout from `host`'s tensors on the device (views: a CUDA graph's buffers) and its sizes."""
        blocks, longest_prefill, longest = sizes
        int32 = lambda name: moved[name].to(torch.int32)  # noqa: E731
        table = int32("table")
        prefill = Queries(moved.get("prefill_rows"), int32("prefill_cu"), int32("prefilled"), table,
                          longest_prefill, longest_prefill)
        decode = None if "decode_rows" not in moved else Queries(  # each decode step's block-table row, on the GPU
            moved["decode_rows"], int32("decode_cu"), int32("decode_used"), table[moved["decode_sequence"]], 1,
            longest)
        return cls(prefill, decode, moved["slots"], blocks)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: PagedLayout, scale: float,
              kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of packed sequences (q: [tokens, heads, dim], k/v: [tokens, kv heads, dim]) as the engine
    computes it: keys and values in a paged cache, FlashAttention 3 with one KV split, the prefill's queries in one
    call and the decode steps' in another (each query its own sequence, as a decode step batches them).

    `kv_scale` ([key's, value's] dequantization scales, fp32): the cache is FP8, as an engine with
    `kv_cache_dtype="fp8"` runs it: keys and values stored by vLLM's cache-write kernel as fp8(k / k_scale), the
    queries quantized to FP8 with the engine's query scale (`QUERY_SCALE`), FlashAttention 3 reading all three in
    FP8 with their scales (`fp8_cache_attention`)."""
    if kv_scale is not None:
        return fp8_cache_attention(q, k, v, layout, scale, kv_scale)
    caches = []
    for t in (k, v):
        cache = t.new_zeros((layout.blocks * BLOCK_SIZE,) + t.shape[1:])
        cache[layout.slots] = t
        caches.append(cache.view(layout.blocks, BLOCK_SIZE, *t.shape[1:]))
    return _paged(q, caches, layout, scale, out_dtype=q.dtype)


QUERY_SCALE = 1.0  # the query scale of an engine's FP8 cache: vLLM's `_q_scale` when the checkpoint has none


def fp8_cache_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: PagedLayout, scale: float,
                        kv_scale: torch.Tensor) -> torch.Tensor:
    """`attention` over an FP8 KV cache, each step as vLLM 0.26's FlashAttention backend takes it: the cache written
    by `vllm_compat.write_fp8_kv_cache` (uint8 blocks, read as E4M3), the queries by `vllm_compat.quantize_query_fp8`
    ([tokens, heads x dim], one static scale), the three descales expanded to [sequences, kv heads], the output in
    the compute dtype."""
    caches = [torch.zeros((layout.blocks, BLOCK_SIZE) + k.shape[1:], dtype=torch.uint8, device=k.device)
              for _ in range(2)]
    vllm_compat.write_fp8_kv_cache(k, v, caches[0], caches[1], layout.slots, kv_scale[0], kv_scale[1])
    query_scale = torch.full((), QUERY_SCALE, dtype=torch.float32, device=q.device)
    codes = vllm_compat.quantize_query_fp8(q.reshape(q.shape[0], -1), query_scale).view(q.shape)
    fp8 = [cache.view(torch.float8_e4m3fn) for cache in caches]
    return _paged(codes, fp8, layout, scale, out_dtype=q.dtype, descales=(query_scale, kv_scale[0], kv_scale[1]))


def _paged(q: torch.Tensor, caches: list[torch.Tensor], layout: PagedLayout, scale: float, out_dtype: torch.dtype,
           descales: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
    """FlashAttention 3 over the paged `caches` (keys, values), the prefill's queries in one call and the decode
    steps' in another; `descales`: the (query, key, value) scales of FP8 inputs, each expanded to [sequences, kv
    heads] as vLLM passes them."""

    def run(queries: Queries) -> torch.Tensor:
        rows = q if queries.rows is None else _pick_rows(q, queries.rows)
        fp8 = {}
        if descales is not None:
            shape = (queries.cu_seqlens_q.shape[0] - 1, caches[0].shape[2])
            fp8 = dict(zip(("q_descale", "k_descale", "v_descale"), (d.expand(shape) for d in descales)))
            fp8["out"] = torch.empty(rows.shape[:2] + caches[1].shape[3:], dtype=out_dtype, device=q.device)
        return vllm_compat.paged_flash_attention(
            rows, caches[0], caches[1], max_seqlen_q=queries.max_q, cu_seqlens_q=queries.cu_seqlens_q,
            max_seqlen_k=queries.max_k, seqused_k=queries.seqused_k, softmax_scale=scale, causal=True,
            block_table=queries.block_table, fa_version=3, num_splits=1, **fp8,
        )

    if layout.decode is None:
        return run(layout.prefill)
    out = q.new_empty(q.shape[:2] + caches[1].shape[3:], dtype=out_dtype)
    out[layout.prefill.rows] = run(layout.prefill)
    out[layout.decode.rows] = run(layout.decode)
    return out


def _pick_rows(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`t[rows]`; FP8 rows picked as their bytes (an indexing kernel need not take FP8 dtypes)."""
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8)[rows].view(t.dtype)
    return t[rows]


@functools.lru_cache(maxsize=None)
def decode_matches_prefill(heads: int, kv_heads: int, head_size: int, dtype: torch.dtype, device: torch.device,
                           fp8_cache: bool = False) -> bool:
    """Whether FlashAttention gives a token the same bits in a decode step as in a prefill, for this attention
    shape: tried on random data over many tiles of keys, once per shape for the policy and the engine. Where it
    does not, the policy computes the tokens the engine decoded as decode steps (dearer: each reads its keys
    alone)."""
    g = torch.Generator(device=device).manual_seed(0)
    n = 1000
    q = torch.randn(n, heads, head_size, device=device, generator=g).to(dtype)
    k, v = (torch.randn(n, kv_heads, head_size, device=device, generator=g).to(dtype) for _ in range(2))
    scale = head_size ** -0.5
    kv_scale = torch.full((2,), 0.02, device=device) if fp8_cache else None  # keys and values of |x| < ~9
    return torch.equal(attention(q, k, v, PagedLayout.build([n], [n], device), scale, kv_scale),
                       attention(q, k, v, PagedLayout.build([n], [1], device), scale, kv_scale))


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log_softmax(logits / temperature)[token] of each row of [rows, vocab] logits in the compute dtype, as
    vLLM's sampler computes the log-prob it returns: the logits divided in place and stored back in their
    dtype (temperature other than 0 and 1), then its fused log-softmax-and-gather kernel."""
    logits = logits.contiguous().clone()
    rows = logits.shape[0]
    if temperature not in (0.0, 1.0):
        vllm_compat.divide_by_temperature(logits, torch.arange(rows, dtype=torch.int32, device=logits.device),
                                          torch.full((rows,), temperature, dtype=torch.float32, device=logits.device))
    return vllm_compat.fused_token_logprobs(logits, tokens[:, None])[:, 0]


def head_size(config) -> int:
    """A Hugging Face config's attention head size."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_parameters(config) -> dict | None:
    """A Hugging Face config's rotary embedding as vLLM reads it (`rope_parameters`: rope_type, rope_theta, the
    scaling's factors), or None when vLLM computes it other than with its plain kernel and a table of its own
    (`vllm_compat.ROTARY_TYPES`: plain, and Llama 3's scaled frequencies) or rotates part of each head."""
    rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    rope.setdefault("rope_theta", getattr(config, "rope_theta", None))
    kind = rope.setdefault("rope_type", rope.pop("type", "default"))
    plain = kind in ROTARY_TYPES and rope.get("partial_rotary_factor", 1.0) == 1.0
    return rope if plain and rope["rope_theta"] is not None else None


def rope_cache(config, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The cos/sin table of the model's rotary embedding as vLLM builds it (its own class, made on `device`
    as the engine makes it on the GPU); the engine checks its own against it as it starts."""
    return vllm_compat.rotary_cos_sin_cache(head_size(config), config.max_position_embeddings, rope_parameters(config),
                                            dtype, device)


# -- the engine side ------------------------------------------------------------------------------------
def install(model: nn.Module) -> None:
    """Make a vLLM model run the kernels above: RMSNorm as `rms_norm` / `add_rms_norm`, rotary embedding
    and SiLU x mul as their CUDA kernels, whatever vLLM's custom-op settings would pick, linear layers and the
    head as `linear`."""
    vllm_compat.pin_exact_kernels(model, _engine_norm, linear)


def _engine_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """An engine RMSNorm's forward in exact mode: norm(x), or (norm(x + residual), x + residual)."""
    return rms_norm(x, weight, eps) if residual is None else add_rms_norm(x, residual, weight, eps)


def check_engine(model: nn.Module, config, dtype: torch.dtype, fp8_cache: bool) -> None:
    """The engine's rotary table is the one the policy computes (`rope_cache`), and its attention layers quantize
    queries as `fp8_cache_attention` does: with an FP8 cache, one static scale of QUERY_SCALE (`QuantFP8`); without,
    not at all."""
    engine_cache = vllm_compat.engine_rotary_cos_sin_cache(model)
    if not torch.equal(engine_cache, rope_cache(config, dtype, engine_cache.device)):
        raise RuntimeError("policy.exact_forward: the engine's rotary cos/sin table differs from the one the policy "
                           "computes; this vLLM builds it another way")
    for name, (quantizer, scale) in vllm_compat.query_quantizers(model).items():
        as_policy = (quantizer is not None and vllm_compat.static_per_tensor_fp8(quantizer)
                     and scale.item() == QUERY_SCALE) if fp8_cache else quantizer is None
        if not as_policy:
            raise RuntimeError(f"policy.exact_forward: the engine's attention {name} quantizes its queries otherwise "
                               f"than the policy ({quantizer}, scale {scale.item()}; the policy: "
                               f"{f'FP8 at scale {QUERY_SCALE}' if fp8_cache else 'not at all'}); this vLLM differs")
