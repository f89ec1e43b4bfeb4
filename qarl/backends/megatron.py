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

A Mixture-of-Experts model (Qwen3-MoE, Qwen2-MoE) gets Megatron's MoE layer with its local experts (a SequentialMLP
of plain linear layers, expert parallel size 1), each expert sharded across TP as the dense MLP is. Its tokens are on
every TP rank (no sequence parallelism), so they are not gathered across TP, as Megatron's dispatchers would: every
rank runs its shard of every expert on all of them, and the partial outputs are summed across TP
(`_replicate_moe_tokens`). Its router computes its logits with torch on any device (`_torch_router`: Megatron's needs
Transformer Engine); Qwen2-MoE's shared expert gate is a linear layer, quantized as the HF backend quantizes it
(`_linear_shared_expert_gates`). These three swap the class of megatron-core's own modules after checking it is the
one they replace: checked on megatron-core 0.16.1 (CPU, the tests); 0.19.2 (the GPU kit) has the same methods with the
same signatures, not yet run with experts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from qarl.backends.convert import FAMILIES, GPTShape, check_parallel, gpt_shape, hf_quantizers, hf_sources, \
    megatron_shards, read_hf_config, unshard
from qarl.config import ConfigError
from qarl.distributed import local_device
from qarl.quant.formats import QuantFormat

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def init_parallel(tensor_parallel_size: int) -> None:
    """torch.distributed (NCCL on GPUs, gloo on CPU) and Megatron's parallel state with `tensor_parallel_size`;
    the rest of the world is data parallel. Without torchrun's environment: a world of one process."""
    from megatron.core import parallel_state

    if not dist.is_initialized():
        device = local_device()
        if device.type == "cuda":
            torch.cuda.set_device(device)
        backend = "nccl" if device.type == "cuda" else "gloo"
        if "RANK" in os.environ:
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    world = dist.get_world_size()
    if world % tensor_parallel_size:
        raise ConfigError(f"tensor_parallel_size={tensor_parallel_size} does not divide the "
                          f"{world} processes torchrun started")
    if parallel_state.model_parallel_is_initialized():
        if parallel_state.get_tensor_model_parallel_world_size() == tensor_parallel_size:
            return
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel_size)
    _announce_world()


def world_layout() -> dict[str, int]:
    """The processes and nodes torchrun brought together and Megatron's split of them into tensor and data parallel
    ranks (step 0's metrics row): what a launch on several nodes actually formed, beside what its command meant."""
    from megatron.core import parallel_state

    return {"world/processes": dist.get_world_size(), "world/nodes": int(os.environ.get("GROUP_WORLD_SIZE", 1)),
            "world/tensor_parallel": parallel_state.get_tensor_model_parallel_world_size(),
            "world/data_parallel": parallel_state.get_data_parallel_world_size()}


def _announce_world() -> None:
    """Print from rank 0 the world layout and each node's host (collective: every rank names its node and host), so
    a node that joined as another one than meant, or a rendezvous that formed a smaller world, shows at start-up."""
    hosts: list[tuple[int, str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, (int(os.environ.get("GROUP_RANK", 0)), socket.gethostname()))
    if dist.get_rank() == 0:
        layout, nodes = world_layout(), dict(sorted(hosts))
        processes, count = layout["world/processes"], layout["world/nodes"]
        print(f"world: {processes} process{'es' * (processes > 1)} on {count} node{'s' * (count > 1)} "
              f"(host{'s' * (len(nodes) > 1)} {', '.join(nodes.values())}), tensor parallel "
              f"{layout['world/tensor_parallel']}, data parallel {layout['world/data_parallel']}", flush=True)


def tp_group() -> dist.ProcessGroup:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def data_parallel_rank_and_size() -> tuple[int, int]:
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()


def all_data_parallel_values(values: list[float]) -> list[float]:
    """`values` of every data-parallel rank, concatenated in rank order (the same list on every rank)."""
    from megatron.core import parallel_state

    _, size = data_parallel_rank_and_size()
    if size == 1:
        return values
    gathered: list[list[float] | None] = [None] * size
    dist.all_gather_object(gathered, values, group=parallel_state.get_data_parallel_group())
    return [v for part in gathered for v in part]


def tp_rank_and_size() -> tuple[int, int]:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()


def _sdpa_core_attention() -> type:
    """Megatron's core-attention slot filled by torch's SDPA: causal, grouped-query, no dropout. A mask, when
    `MegatronModel.gpt_inputs` passes one for padded rows, is SDPA's boolean "may attend" mask."""
    from megatron.core.transformer.module import MegatronModule

    class SDPACoreAttention(MegatronModule):
        def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                     softmax_scale=None, **_: object) -> None:
            super().__init__(config=config)
            self.softmax_scale = softmax_scale

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            if attention_bias is not None or packed_seq_params is not None:
                raise ValueError("qarl's Megatron attention takes no attention bias and no packed sequences")
            # Megatron's [seq, batch, heads, dim] -> SDPA's [batch, heads, seq, dim] and back to [seq, batch, hidden]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            if attention_mask is None:
                out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True,
                                                                       scale=self.softmax_scale)
            else:  # padded rows, as transformers' SDPA attention runs them: key/value heads repeated, explicit mask
                groups = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
                out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask,
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


def _torch_router(model: nn.Module) -> None:
    """Megatron's MoE router computes its logits with Transformer Engine's GEMM (megatron-core 0.16 without Transformer
    Engine: a NameError) and moves a weight it finds on the CPU to `torch.cuda.current_device()` at every forward; here
    they are torch's linear where the model is, in the input's dtype (`_moe_config` leaves moe_router_dtype unset), as
    Hugging Face's router computes them."""
    from megatron.core.transformer.moe.router import TopKRouter

    class TorchTopKRouter(TopKRouter):
        def gating(self, input: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.linear(input, self.weight, self.bias)

    for module in model.modules():
        if isinstance(module, TopKRouter):
            if type(module) is not TopKRouter or module.config.moe_router_dtype is not None:
                raise RuntimeError(f"unexpected MoE router {type(module).__name__} in megatron-core")
            module.__class__ = TorchTopKRouter


def _replicate_moe_tokens(model: nn.Module) -> None:
    """Megatron's MoE layers for tokens every TP rank holds whole: the gradients of the router's and the routed
    experts' inputs summed across TP as a column-parallel layer's are, the partial expert outputs summed across TP as
    a row-parallel layer's are (Megatron's allgather dispatcher instead gathers sequence-parallel shards of the tokens
    over TP, which would run each token TP times here, and allocates on the current GPU). The router sees every token
    on every rank, but its routing weights scale this rank's partial expert outputs only: its weight's gradient is a
    sum of TP partial ones (`MegatronModel.finish_gradients`). The routing weights scale each expert's
    output, as Hugging Face's experts and vLLM's FusedMoE apply them, not its down projection's input, as Megatron's
    experts do: a quantized input would otherwise be another one. A layer's config says sequence parallel, as its
    tokens are this rank's own: Megatron's MoE layer refuses to train at TP > 1 without."""
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region, \
        reduce_from_tensor_model_parallel_region
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

    class ReplicatedTokensDispatcher(MoEAllGatherTokenDispatcher):
        def token_dispatch(self, hidden_states, probs):
            return copy_to_tensor_model_parallel_region(hidden_states, group=self.tp_group), probs

        def dispatch_postprocess(self, hidden_states, probs):
            hidden_states, tokens_per_expert, probs = super().dispatch_postprocess(hidden_states, probs)
            return hidden_states, tokens_per_expert, torch.ones_like(probs)  # applied in combine_preprocess

        def combine_preprocess(self, hidden_states):
            return super().combine_preprocess(hidden_states * self.local_probs.unsqueeze(-1))

        def token_combine(self, hidden_states):
            return reduce_from_tensor_model_parallel_region(hidden_states, group=self.tp_group)

    class ReplicatedTokensMoELayer(MoELayer):
        def route(self, hidden_states, padding_mask=None):
            hidden_states = copy_to_tensor_model_parallel_region(hidden_states, group=self.token_dispatcher.tp_group)
            return super().route(hidden_states, padding_mask)

    for module in model.modules():
        if isinstance(module, MoELayer):
            if type(module) is not MoELayer or type(module.token_dispatcher) is not MoEAllGatherTokenDispatcher:
                raise RuntimeError(f"unexpected MoE layer {type(module).__name__} / token dispatcher "
                                   f"{type(module.token_dispatcher).__name__} in megatron-core")
            module.__class__, module.token_dispatcher.__class__ = ReplicatedTokensMoELayer, ReplicatedTokensDispatcher
            module.config = dataclasses.replace(module.config,
                                                sequence_parallel=module.config.tensor_model_parallel_size > 1)


def _linear_shared_expert_gates(model: nn.Module) -> None:
    """Megatron's shared expert gate is a bare parameter (`gate_weight`), which ModelOpt does not quantize; Hugging
    Face's (`shared_expert_gate`) is a linear layer, which the HF backend quantizes as any other: here it is a linear
    layer too (`gate`), the shared expert's output scaled by sigmoid(gate(x)) as in both."""
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

    class LinearGateSharedExpertMLP(SharedExpertMLP):
        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            output, _ = MLP.forward(self, hidden_states)
            return output * torch.sigmoid(self.gate(hidden_states))

    for module in model.modules():
        if isinstance(module, SharedExpertMLP):
            if type(module) is not SharedExpertMLP or not module.use_shared_expert_gate \
                    or module.config.moe_shared_expert_overlap:
                raise RuntimeError(f"unexpected shared expert {type(module).__name__} in megatron-core")
            weight = module.gate_weight
            del module.gate_weight
            module.gate = nn.Linear(weight.shape[1], 1, bias=False, dtype=weight.dtype, device=weight.device)
            module.__class__ = LinearGateSharedExpertMLP


def _moe_config(shape: GPTShape) -> dict:
    """TransformerConfig's MoE fields for `shape`: Qwen's router (the softmax over all experts' logits, of which the
    top k; renormalized over them, norm_topk_prob, that is the softmax over the top-k logits: Megatron's default), no
    load-balancing loss, no token dropping, local experts, Qwen2-MoE's gated shared expert."""
    if not shape.experts:
        return {}
    return dict(num_moe_experts=shape.experts, moe_router_topk=shape.topk, moe_ffn_hidden_size=shape.expert_ffn,
                moe_router_pre_softmax=not shape.norm_topk, moe_router_score_function="softmax",
                moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_expert_capacity_factor=None,
                moe_token_dispatcher_type="allgather", moe_grouped_gemm=False,
                moe_shared_expert_intermediate_size=shape.shared_ffn or None,
                moe_shared_expert_gate=bool(shape.shared_ffn))


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
        persist_layer_norm=False, **_moe_config(shape),
    )
    spec = get_gpt_layer_local_spec(num_experts=shape.experts or None, moe_grouped_gemm=False, normalization="RMSNorm",
                                    qk_layernorm=shape.qk_norm)
    spec.submodules.self_attention.submodules.core_attention = _sdpa_core_attention()
    model = GPTModel(config, spec, vocab_size=shape.vocab, max_sequence_length=shape.max_positions,
                     parallel_output=True, share_embeddings_and_output_weights=shape.tied,
                     position_embedding_type="rope", rotary_base=shape.rope_theta)
    _replicate_moe_tokens(model)
    _torch_router(model)
    _linear_shared_expert_gates(model)
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


class MegatronModel(nn.Module):
    """A Megatron GPT model of this TP rank with its Hugging Face shape. To the code that scores completions,
    calibrates and optimizes it answers like a Hugging Face causal LM (`model(input_ids, attention_mask).logits`,
    `.dtype`); to the rollout engine it is a `qarl.generation.vllm_engine.ShardedPolicy`."""

    def __init__(self, model: nn.Module, shape: GPTShape, hf_config: dict, generation_config: dict | None):
        """`hf_config`, `generation_config`: the source's config.json and generation_config.json, read when the
        model is built (a checkpoint's source directory may be gone by the time a later checkpoint is written)."""
        super().__init__()
        self.model, self.shape = model, shape
        self.hf_config, self.generation_config = hf_config, generation_config

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @staticmethod
    def gpt_inputs(input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> dict[str, torch.Tensor | None]:
        """GPTModel's arguments for right-padded rows. Padding changes nothing a row's own tokens compute (the
        attention is causal), but the padded positions' activations reach calibration's amax: with padding, the
        attention gets the mask transformers gives SDPA (causal, padded keys masked), so they are the HF backend's."""
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        mask = None
        if attention_mask is not None:
            keep = attention_mask.bool()
            if not torch.equal(keep, positions < keep.sum(-1, keepdim=True)):
                raise ValueError("the Megatron backend's attention is causal over right-padded rows; this batch has "
                                 "left padding or gaps (tokenize with padding_side='right')")
            if not keep.all():
                causal = torch.ones(input_ids.shape[1], input_ids.shape[1], dtype=torch.bool, device=keep.device).tril()
                mask = causal[None, None] & keep[:, None, None, :]
        return {"input_ids": input_ids, "position_ids": positions, "attention_mask": mask}

    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """[batch, seq, vocab] logits of right-padded rows, the full vocabulary on every TP rank (gathered by
        torch.distributed: Megatron's own output gather allocates on the current GPU)."""
        local = self.model(**self.gpt_inputs(input_ids, attention_mask))  # this rank's vocabulary rows
        return local if tp_rank_and_size()[1] == 1 else _GatherVocab.apply(local)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> SimpleNamespace:
        return SimpleNamespace(logits=self.logits(input_ids, attention_mask))

    def hf_tensors(self, fold: bool = True, grads: bool = False,
                   masters: dict[str, torch.Tensor] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Every weight by Hugging Face name, the TP shards gathered one parameter at a time; `fold`:
        quantized weights come quantized-dequantized by their (TP-synced) weight quantizer, as the
        engine and the exporter take them; `grads`: the weights' gradients instead (zeros where a
        parameter has none); `masters`: these tensors (by this module's parameter names: the policy's
        master weights) instead of the parameters. Collective: every TP rank must iterate it."""
        _, tp = tp_rank_and_size()
        modules = dict(self.model.named_modules())
        for name, param in self.model.named_parameters():
            module_name, _, leaf = name.rpartition(".")
            quantizer = getattr(modules[module_name], "weight_quantizer", None)
            if grads:
                local = param.grad if param.grad is not None else torch.zeros_like(param)
            else:
                local = masters[f"model.{name}"] if masters is not None else param.detach()
            if fold and not grads and masters is None and leaf == "weight" and quantizer is not None and quantizer.is_enabled:
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
        finalize_model_grads does for qk_layernorm, or whose outputs weight only its own shards of the experts (a MoE
        router: `_replicate_moe_tokens`). The other replicated parameters (RMSNorm weights, biases of
        replicated inputs) see the whole activations on every rank and have whole gradients already. With data
        parallelism (more processes than TP), every gradient is then summed across the data-parallel ranks:
        each computes its own rows' share of one loss, normalised by the whole batch."""
        from megatron.core import parallel_state

        _, tp = tp_rank_and_size()
        for name, param in self.model.named_parameters():
            if tp > 1 and param.grad is not None and ("q_layernorm" in name or "k_layernorm" in name
                                                      or name.endswith("mlp.router.weight")):
                dist.all_reduce(param.grad, group=tp_group())
        if parallel_state.get_data_parallel_world_size() > 1:
            group = parallel_state.get_data_parallel_group()
            for param in self.model.parameters():
                if param.grad is None:  # a rank with no micro-batch this step still takes part in the sum
                    param.grad = torch.zeros_like(param)
                dist.all_reduce(param.grad, group=group)

    def clip_gradients(self, named: list[tuple[str, torch.Tensor]], max_norm: float) -> torch.Tensor:
        """Clip the gradients of (parameter name, tensor) pairs, the tensors this rank's parameters or their
        masters, to a total norm of `max_norm` over the whole model; returns that norm before clipping (the same
        on every rank). A TP-sharded parameter's squares are summed across the TP ranks; a parameter every rank
        holds whole (norms, replicated biases) has the same gradient on each and counts once. At TP=1: torch's
        clip_grad_norm_, as the HF backend."""
        if tp_rank_and_size()[1] == 1:
            return torch.nn.utils.clip_grad_norm_([t for _, t in named], max_norm)
        sharded, whole = torch.zeros((), device=self.device), torch.zeros((), device=self.device)
        for name, tensor in named:
            if tensor.grad is not None:
                squares = tensor.grad.detach().float().pow(2).sum()
                if hf_sources(name.removeprefix("model."))[1] == "replicated":
                    whole += squares
                else:
                    sharded += squares
        dist.all_reduce(sharded, group=tp_group())
        norm = (sharded + whole).sqrt()
        torch.nn.utils.clip_grads_with_norm_([t for _, t in named], max_norm, norm)
        return norm

    def rollout_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The folded weights by Hugging Face name, gathered from the TP shards one at a time as vLLM loads them."""
        return self.hf_tensors(fold=True)

    def input_quantizers(self) -> dict[str, nn.Module]:
        """{Hugging Face linear layer (a MoE layer's experts: `expert_input_key`): its input quantizer}: a fused
        Megatron layer's goes to each of its parts; the experts' (they share one amax) to their experts module's."""
        from qarl.quant.ops import expert_input_key

        quantizers = {}
        for name, module in self.model.named_modules():
            if hasattr(module, "input_quantizer"):
                for hf_name in hf_counterparts(name, "input_quantizer"):
                    layer, _, kind = hf_name.rpartition(".")
                    key = layer if kind == "input_quantizer" else expert_input_key(layer, kind)
                    quantizers[key] = module.input_quantizer
        return quantizers

    def save_policy(self, out_dir: str | Path, fmt: QuantFormat | None, tokenizer: PreTrainedTokenizerBase,
                    masters: dict[str, torch.Tensor] | None = None) -> None:
        """Write into `out_dir` what the HF backend writes for a checkpoint's policy (`qarl/checkpoint.py`): policy/
        a Hugging Face directory (these weights, or `masters`, by Hugging Face name; the source's config, with the
        dtype this model computes in, and generation config; the tokenizer), plus quantizer_state.safetensors
        and quant_format.yaml. TP-independent: any TP, or the HF backend, loads it, and `qarl export` exports it.
        Collective (the shards are gathered one tensor at a time); rank 0 keeps them, so it holds the whole model
        once, in host or device memory as the weights are, and writes. Not atomic by itself: the caller writes
        into a temporary directory, as checkpoints do."""
        from safetensors.torch import save_file

        from qarl.quant.state_file import write_quant_state

        writer = dist.get_rank() == 0
        weights = {}
        for name, tensor in self.hf_tensors(fold=False, masters=masters):  # every rank gathers; the writer keeps
            if writer:
                weights[name] = tensor.contiguous()
        state = self.quantizer_state() if fmt is not None else None
        if writer:
            out = Path(out_dir) / "policy"
            out.mkdir(parents=True, exist_ok=True)
            save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
            config = {k: v for k, v in self.hf_config.items() if k != "torch_dtype"}
            config["dtype"] = str(self.dtype).removeprefix("torch.")  # the dtype it computed in, as HF's save writes
            (out / "config.json").write_text(json.dumps(config, indent=2))
            if self.generation_config is not None:
                (out / "generation_config.json").write_text(json.dumps(self.generation_config, indent=2))
            tokenizer.save_pretrained(out)
            if fmt is not None:
                write_quant_state(Path(out_dir), state, fmt, self.device)
        dist.barrier()

    def load_quantizer_state(self, state: dict[str, torch.Tensor]) -> None:
        """The inverse of `quantizer_state`: a fused layer takes the amax its Hugging Face parts share."""
        from qarl.quant.quantize import QUANTIZER_ROLES, load_quantizer_state

        megatron_state, problems = {}, []
        for module_name, module in self.model.named_modules():
            for quantizer in QUANTIZER_ROLES:
                parts = hf_counterparts(module_name, quantizer)
                values = [state.get(p) for p in parts]
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
        Megatron layer's amax goes to each of its Hugging Face parts (they share one by construction), the experts'
        input amax (one they all share, as ModelOpt max-reduces it) to their experts module's input quantizer."""
        from qarl.quant.quantize import quantizer_state

        state = {}
        for name, amax in quantizer_state(self.model).items():
            module_name, _, quantizer = name.rpartition(".")
            if amax.numel() != 1:
                raise ConfigError(f"{name} has a per-channel amax; the Megatron backend handles per-tensor amax only")
            for hf_quantizer in hf_quantizers(module_name, quantizer):
                state[hf_quantizer] = amax.clone()
        return state


def hf_counterparts(megatron_module: str, role: str) -> list[str]:
    """The Hugging Face quantizers that quantizer `role` of a Megatron module stands for (`hf_quantizers`); [] for a
    module that has none."""
    try:
        return hf_quantizers(megatron_module, role)
    except KeyError:
        return []


def _quantize(built: MegatronModel, reference: nn.Module, fmt: QuantFormat,
              calibration: Callable[[], Iterable[dict[str, torch.Tensor]]] | None, weight_cache: bool) -> None:
    """ModelOpt's Megatron plugin quantizes the model with `fmt`, whose quantizers are then made exactly those
    `fmt` gives the Hugging Face model (`reference`: its patterns name Hugging Face modules), and calibrated on
    `calibration()`'s batches, the HF backend's (input_ids and an optional right-padded attention_mask; None:
    amax to be loaded, `load_quantizer_state`); ModelOpt max-reduces per-tensor amax across TP ranks, so any
    TP quantizes as TP=1."""
    from qarl.quant.quantize import match_reference_quantizers, quantize_policy

    batches = None
    if calibration is not None:
        batches = lambda: [built.gpt_inputs(b["input_ids"].to(built.device),  # noqa: E731
                                            b["attention_mask"].to(built.device) if "attention_mask" in b else None)
                           for b in calibration()]
    quantize_policy(built.model, fmt, batches, weight_cache=weight_cache,
                    align=lambda model: match_reference_quantizers(model, reference, hf_counterparts))


def check_megatron_model(model_dir: str, tensor_parallel_size: int, fmt: QuantFormat | None) -> nn.Module | None:
    """The model family, the TP size and `fmt`'s blocks against the sharded widths, on the meta device (before
    torch.distributed or any weights); returns the meta-device Hugging Face model quantized with `fmt`."""
    from qarl.quant.formats import block_size, quantized_meta_model
    from qarl.quant.quantize import quantized_linears

    shape = gpt_shape(read_hf_config(model_dir))
    reference = quantized_meta_model(model_dir, fmt) if fmt is not None else None
    row_parallel = [m for name, m in (quantized_linears(reference) if reference is not None else ())
                    if name.endswith(("o_proj", "down_proj"))]  # the layers whose input columns TP splits
    blocks = {block_size(q) for m in row_parallel
              for q in (m.weight_quantizer, getattr(m, "input_quantizer", None)) if q is not None}
    for block in sorted(b for b in blocks if b) or [None]:
        check_parallel(shape, tensor_parallel_size, block)
    return reference


def build_megatron_model(model_dir: str, tensor_parallel_size: int, dtype: torch.dtype, device: torch.device,
                         fmt: QuantFormat | None = None,
                         calibration: Callable[[], Iterable[dict[str, torch.Tensor]]] | None = None,
                         weight_cache: bool = True) -> MegatronModel:
    """Check the model (`check_megatron_model`), then build and load this rank's shard and, with `fmt`, quantize
    it and calibrate it on `calibration()`'s batches (None: uncalibrated, the amax to be loaded)."""
    reference = check_megatron_model(model_dir, tensor_parallel_size, fmt)
    hf_config = read_hf_config(model_dir)
    shape = gpt_shape(hf_config)
    init_parallel(tensor_parallel_size)
    model = build_gpt_model(shape, dtype, device)
    load_hf_weights(model, shape, model_dir)
    generation = Path(model_dir) / "generation_config.json"
    built = MegatronModel(model, shape, hf_config, json.loads(generation.read_text()) if generation.is_file() else None)
    if fmt is not None:
        _quantize(built, reference, fmt, calibration, weight_cache)
    return built


def read_master_weights(built: MegatronModel, model_dir: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """This rank's shard of the checkpoint again, in `dtype`, by `built`'s parameter names: the master weights of
    a model that computes in a narrower dtype (what a Hugging Face model loaded in `dtype` would hold)."""
    rank, tp = tp_rank_and_size()
    return {f"model.{name}": tensor.to(device=built.device, dtype=dtype)
            for name, tensor in megatron_shards(built.shape, tp, rank, _checkpoint_reader(model_dir))}
