"""The Megatron-core policy model: a GPTModel built from a Hugging Face Llama-family checkpoint, tensor
and data parallel through Megatron's parallel state, fake-quantized by ModelOpt's Megatron plugin.

Launched by `torchrun` (one process per GPU; `RANK`/`WORLD_SIZE` in the environment), or in a single
process without it. What it gives the rest of qarl is in Hugging Face terms: logits for token ids,
folded weights and quantizer state by Hugging Face name (gathered from the TP shards one tensor at a
time, `qarl/backends/convert.py`), so refit, checkpoints and export are the HF backend's.

Two pieces of Megatron's local layer spec are replaced so the model runs on CPU too (gloo), which is
how CI tests it: the core attention is torch's scaled_dot_product_attention (causal, grouped query;
Megatron's unfused DotProductAttention allocates its buffers with `torch.cuda.current_device()`), and,
on CPU only, the rotary table stays on the model's device (Megatron's moves it to the current GPU).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn

from qarl.backends.convert import FAMILIES, GPTShape, check_parallel, gpt_shape, hf_modules, hf_sources, megatron_shards, \
    read_hf_config, unshard
from qarl.config import ConfigError
from qarl.quant.formats import QuantFormat


def init_parallel(tensor_parallel_size: int) -> None:
    """torch.distributed (NCCL on GPUs, gloo on CPU) and Megatron's parallel state with `tensor_parallel_size`;
    the rest of the world is data parallel. Without torchrun's environment: a world of one process."""
    from megatron.core import parallel_state

    if not dist.is_initialized():
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        if "RANK" in os.environ:
            dist.init_process_group("nccl" if cuda else "gloo")
        else:
            store = dist.HashStore()
            dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=0, world_size=1)
    world = dist.get_world_size()
    if world % tensor_parallel_size:
        raise ConfigError(f"tensor_parallel_size={tensor_parallel_size} does not divide the "
                          f"{world} processes torchrun started")
    if parallel_state.model_parallel_is_initialized():
        if parallel_state.get_tensor_model_parallel_world_size() == tensor_parallel_size:
            return
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel_size)


def tp_group() -> dist.ProcessGroup:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def tp_rank_and_size() -> tuple[int, int]:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()


def _sdpa_core_attention() -> type:
    """Megatron's core-attention slot filled by torch's SDPA: causal, grouped-query, no dropout."""
    from megatron.core.transformer.module import MegatronModule

    class SDPACoreAttention(MegatronModule):
        def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                     softmax_scale=None, **_: object) -> None:
            super().__init__(config=config)
            self.softmax_scale = softmax_scale

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            if attention_mask is not None or attention_bias is not None or packed_seq_params is not None:
                raise ValueError("qarl's Megatron attention is causal over right-padded rows: no mask, bias or packing")
            # Megatron's [seq, batch, heads, dim] -> SDPA's [batch, heads, seq, dim] and back to [seq, batch, hidden]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True,
                                                                   scale=self.softmax_scale)
            return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)

    return SDPACoreAttention


def _keep_rotary_on_device(model: nn.Module) -> None:
    """Megatron's RotaryEmbedding moves its table to `torch.cuda.current_device()` at the first forward;
    on CPU it computes the same table where the model is."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    class DeviceRotaryEmbedding(RotaryEmbedding):
        def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
            freqs = self.get_freqs_non_repeated(max_seq_len, offset)
            return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]  # non-interleaved, as Llama's rotate_half

    rotary = model.rotary_pos_emb
    if type(rotary) is not RotaryEmbedding or rotary.rotary_interleaved:
        raise RuntimeError(f"unexpected rotary embedding {type(rotary).__name__} in megatron-core")
    rotary.__class__ = DeviceRotaryEmbedding


def build_gpt_model(shape: GPTShape, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """A megatron-core GPTModel of `shape` for this process's TP rank, weights uninitialized."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    _, tp = tp_rank_and_size()
    config = TransformerConfig(
        num_layers=shape.layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
        num_query_groups=shape.groups, kv_channels=shape.head_dim, ffn_hidden_size=shape.ffn,
        normalization="RMSNorm", layernorm_epsilon=shape.norm_eps, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=shape.qkv_bias,
        qk_layernorm=shape.qk_norm, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        use_cpu_initialization=True, perform_initialization=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, masked_softmax_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )
    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=shape.qk_norm)
    spec.submodules.self_attention.submodules.core_attention = _sdpa_core_attention()
    model = GPTModel(config, spec, vocab_size=shape.vocab, max_sequence_length=shape.max_positions,
                     parallel_output=True, share_embeddings_and_output_weights=shape.tied,
                     position_embedding_type="rope", rotary_base=shape.rope_theta)
    if device.type != "cuda":
        _keep_rotary_on_device(model)
    return model.to(device)


def _checkpoint_reader(model_dir: str | Path):
    """name -> tensor from a Hugging Face checkpoint's safetensors files, read one tensor at a time."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{model_dir} has no .safetensors weights (the Megatron backend reads safetensors only)")
    where = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            where.update(dict.fromkeys(f.keys(), file))

    def read(name: str) -> torch.Tensor:
        if name not in where:
            raise ConfigError(f"{model_dir} has no tensor {name!r} (is it a checkpoint of one of {FAMILIES}?)")
        with safe_open(str(where[name]), framework="pt") as f:
            return f.get_tensor(name)

    return read


@torch.no_grad()
def load_hf_weights(model: nn.Module, shape: GPTShape, model_dir: str | Path) -> None:
    """Copy this TP rank's shard of the Hugging Face checkpoint into the model; every Megatron parameter
    must be written exactly once (a converter gap is an error, not a silently random weight)."""
    rank, tp = tp_rank_and_size()
    params = dict(model.named_parameters())
    written = set()
    for name, tensor in megatron_shards(shape, tp, rank, _checkpoint_reader(model_dir)):
        if name not in params or params[name].shape != tensor.shape:
            raise RuntimeError(f"converter and megatron-core disagree about {name}: "
                               f"{tuple(tensor.shape)} vs {tuple(params[name].shape) if name in params else 'absent'}")
        params[name].copy_(tensor)
        written.add(name)
    if written != set(params):
        raise RuntimeError(f"Megatron parameters the converter did not fill: {sorted(set(params) - written)[:5]}")


class _GatherVocab(torch.autograd.Function):
    """Logits gathered over the vocabulary shards of the TP ranks. Every rank then computes the same loss from
    the whole logits, so each already holds the whole gradient: backward keeps this rank's slice (a summing
    backward, as torch.distributed.nn's all_gather has, would scale every gradient by the TP size)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor) -> torch.Tensor:
        rank, tp = tp_rank_and_size()
        parts = [torch.empty_like(local) for _ in range(tp)]
        dist.all_gather(parts, local.contiguous(), group=tp_group())
        ctx.rank, ctx.width = rank, local.shape[-1]
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.narrow(-1, ctx.rank * ctx.width, ctx.width).contiguous()


@dataclass(eq=False)
class MegatronModel:
    """A Megatron GPT model of this TP rank with its Hugging Face shape; what the rollout engine refits from
    (`qarl.generation.vllm_engine.ShardedPolicy`)."""

    model: nn.Module
    shape: GPTShape

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[batch, seq, vocab] logits of right-padded rows (causal attention: padding after a row's tokens
        never reaches them), the full vocabulary on every TP rank (gathered by torch.distributed: Megatron's
        own output gather allocates on the current GPU)."""
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        local = self.model(input_ids, positions, attention_mask=None)  # this rank's vocabulary rows
        return local if tp_rank_and_size()[1] == 1 else _GatherVocab.apply(local)

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.model.parameters()

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> SimpleNamespace:
        """Answers like a Hugging Face causal LM (`.logits`), so the code that scores completions and calibrates
        runs on this model unchanged. Rows must be right-padded: a mask with a gap or left padding is refused."""
        if attention_mask is not None:
            lengths = attention_mask.sum(-1, keepdim=True)
            positions = torch.arange(attention_mask.shape[-1], device=attention_mask.device)
            if not torch.equal(attention_mask.bool(), positions < lengths):
                raise ValueError("the Megatron backend's attention is causal over right-padded rows; this batch has "
                                 "left padding or gaps (tokenize with padding_side='right')")
        return SimpleNamespace(logits=self.logits(input_ids))

    def hf_tensors(self, fold: bool = True, grads: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """Every weight by Hugging Face name, the TP shards gathered one parameter at a time; `fold`:
        quantized weights come quantized-dequantized by their (TP-synced) weight quantizer, as the
        engine and the exporter take them; `grads`: the weights' gradients instead. Collective: every
        TP rank must iterate it."""
        _, tp = tp_rank_and_size()
        modules = dict(self.model.named_modules())
        for name, param in self.model.named_parameters():
            module_name, _, leaf = name.rpartition(".")
            quantizer = getattr(modules[module_name], "weight_quantizer", None)
            local = param.grad if grads else param.detach()
            if fold and not grads and leaf == "weight" and quantizer is not None and quantizer.is_enabled:
                local = quantizer(local)
            _, kind = hf_sources(name)
            if kind == "replicated" or tp == 1:
                shards = [local] * tp
            else:
                shards = [torch.empty_like(local) for _ in range(tp)]
                dist.all_gather(shards, local.contiguous(), group=tp_group())
            yield from unshard(name, shards, self.shape)

    def finish_gradients(self) -> None:
        """After backward, before the optimizer step: sum across TP ranks the gradients of the parameters every
        rank holds whole but feeds only its own heads through (Qwen3's q/k norms), as Megatron's own
        finalize_model_grads does for qk_layernorm. The other replicated parameters (RMSNorm weights, biases of
        replicated inputs) see the whole activations on every rank and have whole gradients already. With data
        parallelism (more processes than TP), every gradient is then summed across the data-parallel ranks:
        each computes its own rows' share of one loss, normalised by the whole batch."""
        from megatron.core import parallel_state

        _, tp = tp_rank_and_size()
        for name, param in self.model.named_parameters():
            if tp > 1 and param.grad is not None and ("q_layernorm" in name or "k_layernorm" in name):
                dist.all_reduce(param.grad, group=tp_group())
        if parallel_state.get_data_parallel_world_size() > 1:
            group = parallel_state.get_data_parallel_group()
            for param in self.model.parameters():
                if param.grad is not None:
                    dist.all_reduce(param.grad, group=group)

    def rollout_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The folded weights by Hugging Face name, gathered from the TP shards one at a time as vLLM loads them."""
        return self.hf_tensors(fold=True)

    def input_quantizers(self) -> dict[str, nn.Module]:
        """{Hugging Face linear layer: its input quantizer}: a fused Megatron layer's goes to each of its parts."""
        return {hf_name: module.input_quantizer for name, module in self.model.named_modules()
                if hasattr(module, "input_quantizer") for hf_name in hf_counterparts(name)}

    def save_policy(self, out_dir: str | Path, source_dir: str | Path, fmt: QuantFormat | None) -> None:
        """Write the model as the HF backend writes a checkpoint's policy (`qarl/checkpoint.py`): policy/ a
        Hugging Face directory (these weights by Hugging Face name, the source's config and tokenizer files),
        plus quantizer_state.safetensors and quant_format.yaml. TP-independent: any TP, or the HF backend,
        loads it, and `qarl export` exports it. Collective (the shards are gathered one tensor at a time);
        rank 0 keeps them, so it holds the whole model once, in host or device memory as the weights are, to
        write one safetensors file into a temporary directory renamed into place."""
        import shutil

        from safetensors.torch import save_file

        from qarl.quant.formats import format_to_yaml

        writer = dist.get_rank() == 0
        weights = {}
        for name, tensor in self.hf_tensors(fold=False):  # every rank gathers; only the writer keeps the tensors
            if writer:
                weights[name] = tensor.contiguous()
        state = self.quantizer_state() if fmt is not None else None
        if writer:
            out, source = Path(out_dir), Path(source_dir)
            tmp = out.with_name(out.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / "policy").mkdir(parents=True)
            save_file(weights, str(tmp / "policy" / "model.safetensors"), metadata={"format": "pt"})
            weight_files = (".safetensors", ".bin", ".pt", ".pth", ".index.json")
            for side_file in source.iterdir():  # config, generation config, tokenizer: everything but weights
                if side_file.is_file() and not side_file.name.endswith(weight_files):
                    shutil.copy2(side_file, tmp / "policy" / side_file.name)
            if fmt is not None:
                save_file(state, str(tmp / "quantizer_state.safetensors"))
                (tmp / "quant_format.yaml").write_text(format_to_yaml(fmt))
            shutil.rmtree(out, ignore_errors=True)
            tmp.rename(out)
        dist.barrier()

    def load_quantizer_state(self, state: dict[str, torch.Tensor]) -> None:
        """The inverse of `quantizer_state`: a fused layer takes the amax its Hugging Face parts share."""
        from qarl.quant.quantize import load_quantizer_state

        megatron_state, problems = {}, []
        for module_name, module in self.model.named_modules():
            parts = hf_counterparts(module_name)
            for quantizer in ("input_quantizer", "weight_quantizer", "output_quantizer"):
                values = [state.get(f"{p}.{quantizer}") for p in parts]
                if not parts or all(v is None for v in values):
                    continue
                if any(v is None or not torch.equal(v, values[0]) for v in values):
                    problems.append(f"{module_name}.{quantizer} ({parts})")
                    continue
                megatron_state[f"{module_name}.{quantizer}"] = values[0]
        if problems:
            raise ConfigError(f"quantizer state: the parts of a fused Megatron layer need one amax, they differ or miss "
                              f"for {problems[:3]}")
        load_quantizer_state(self.model, megatron_state)

    def quantizer_state(self) -> dict[str, torch.Tensor]:
        """{Hugging Face quantizer name: amax}, as the HF backend's `quantizer_state` names them: a fused
        Megatron layer's amax goes to each of its Hugging Face parts (they share one by construction)."""
        from qarl.quant.quantize import quantizer_state

        state = {}
        for name, amax in quantizer_state(self.model).items():
            module_name, _, quantizer = name.rpartition(".")
            if amax.numel() != 1:
                raise ConfigError(f"{name} has a per-channel amax; the Megatron backend handles per-tensor amax only")
            for hf_module in hf_modules(module_name):
                state[f"{hf_module}.{quantizer}"] = amax.clone()
        return state


def hf_counterparts(megatron_module: str) -> list[str]:
    """The Hugging Face modules a Megatron module stands for; [] for one that has none."""
    try:
        return hf_modules(megatron_module)
    except KeyError:
        return []


def _quantize(built: MegatronModel, reference: nn.Module, fmt: QuantFormat, calibration: list[torch.Tensor] | None,
              weight_cache: bool) -> None:
    """ModelOpt's Megatron plugin quantizes the model with `fmt`, whose quantizers are then made exactly those
    `fmt` gives the Hugging Face model (`reference`: its patterns name Hugging Face modules), and calibrated on
    right-padded token-id batches (None: amax to be loaded, `load_quantizer_state`); ModelOpt max-reduces
    per-tensor amax across TP ranks, so any TP quantizes as TP=1."""
    from qarl.quant.quantize import match_reference_quantizers, quantize_policy

    batches = None
    if calibration is not None:
        batches = lambda: [{"input_ids": ids.to(built.device), "attention_mask": None,  # noqa: E731
                            "position_ids": torch.arange(ids.shape[1], device=built.device).expand_as(ids)}
                           for ids in calibration]
    quantize_policy(built.model, fmt, batches, weight_cache=weight_cache,
                    align=lambda model: match_reference_quantizers(model, reference, hf_counterparts))


def build_megatron_model(model_dir: str, tensor_parallel_size: int, dtype: torch.dtype, device: torch.device,
                         fmt: QuantFormat | None = None, calibration: list[torch.Tensor] | None = None,
                         weight_cache: bool = True) -> MegatronModel:
    """Check the model family, the TP size and `fmt`'s blocks against the sharded widths (on the meta device),
    then build and load this rank's shard and, with `fmt`, quantize it and calibrate it on `calibration`."""
    from qarl.quant.quantize import block_size, quantized_linears, quantized_meta_model

    shape = gpt_shape(read_hf_config(model_dir))
    reference = quantized_meta_model(model_dir, fmt) if fmt is not None else None
    row_parallel = [m for name, m in (quantized_linears(reference) if reference is not None else ())
                    if name.endswith(("o_proj", "down_proj"))]  # the layers whose input columns TP splits
    blocks = {block_size(q) for m in row_parallel
              for q in (m.weight_quantizer, getattr(m, "input_quantizer", None)) if q is not None}
    for block in sorted(b for b in blocks if b) or [None]:
        check_parallel(shape, tensor_parallel_size, block)
    init_parallel(tensor_parallel_size)
    model = build_gpt_model(shape, dtype, device)
    load_hf_weights(model, shape, model_dir)
    built = MegatronModel(model=model, shape=shape)
    if fmt is not None:
        _quantize(built, reference, fmt, calibration, weight_cache)
    return built
