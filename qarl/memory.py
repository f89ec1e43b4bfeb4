"""The memory plan: what a training run needs on its device, from the model's shape, the dtypes and the budgets,
made before anything loads. A run that cannot fit is refused, naming the setting to change and the largest value
that fits; `policy.gradient_checkpointing: auto` is decided here.

The update's peak is the larger of two moments (the HF backend, one device):
  * forward + backward of one micro-batch: compute weights, masters, AdamW's moments, the gradients accumulating in
    the compute dtype, the activations autograd keeps, and one chunk of the vocabulary (qarl/scoring.py);
  * the optimizer step: the gradients in the master dtype and AdamW's temporaries for one group of masters
    (qarl/optim.py steps them in groups of `STEP_GROUP_BYTES`, a larger tensor alone).
The engine sleeps during the update (colocated: its KV cache and, unless it shares them, its weights are released),
so it counts during the rollout: the policy's resident state plus the engine's share of the device. The tokens
its KV cache holds are counted from the model's key and value widths, 1 byte an element where the rollout format
quantizes the cache (an FP8 KV cache: docs/guides/kv-cache.md), else the compute dtype's.

The per-token activation figures are estimates for a Llama/Qwen-style decoder in transformers (bytes a token a
layer); `benchmarks/user_shape.py` measures the real peaks beside the plan (`memory/planned_update_gib` in every
metrics row), in benchmarks/results/gpu/.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
from transformers import AutoConfig

from qarl.config import ConfigError, RecipeConfig
from qarl.generation import sleeps_between_rollouts
from qarl.models.checks import load_pretrained, parameter_count
from qarl.optim import STEP_GROUP_BYTES
from qarl.quant.formats import QuantFormat, quantizes_kv_cache, resolve_format

GiB = 2**30
CHECKPOINTING = ("off", "on", "auto")
HEADROOM = 0.92  # of the device's free memory the plan may use: the allocator's fragmentation, CUDA graphs, NCCL
VOCAB_CHUNK_TENSORS = 10  # fp32 [chunk, vocab] tensors alive while one chunk is scored and differentiated
ENGINE_WORKSPACE = GiB  # a GPU engine with a fixed KV cache (gpu_kv_cache_gib): its activations and CUDA graphs


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of a model: its parameter count and its decoder's widths."""

    params: int
    layers: int
    hidden: int
    intermediate: int
    vocab: int
    attention_width: int  # q + k + v output features of one layer
    query_width: int  # q's output features (the attention output projection's input)
    experts: int = 0  # a Mixture-of-Experts model's experts a layer (0: dense); `intermediate` is then a token's share
    experts_per_token: int = 0
    expert_params: int = 0  # all its experts' weights

    @classmethod
    def of(cls, model_dir: str, trust_remote_code: bool = False) -> "ModelShape":
        config = load_pretrained(AutoConfig, model_dir, trust_remote_code).get_text_config()
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        intermediate = getattr(config, "intermediate_size", 4 * config.hidden_size)
        experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0
        expert_params = 0
        if experts:  # what a token's activations hold: its experts' intermediate width
            per_expert = getattr(config, "moe_intermediate_size", None) or intermediate
            intermediate = config.num_experts_per_tok * per_expert
            expert_params = config.num_hidden_layers * experts * 3 * config.hidden_size * per_expert
        return cls(params=parameter_count(model_dir, trust_remote_code), layers=config.num_hidden_layers,
                   hidden=config.hidden_size, intermediate=intermediate, vocab=config.vocab_size,
                   attention_width=(heads + 2 * kv_heads) * head_dim, query_width=heads * head_dim, experts=experts,
                   experts_per_token=config.num_experts_per_tok if experts else 0, expert_params=expert_params)

    @property
    def linear_params(self) -> int:
        """The decoder's quantized weights (q, k, v, o, and the MLP's gate, up, down: a dense model's, or every
        expert's of a MoE model): what a frozen quantized model keeps packed."""
        mlp = 0 if self.experts else 3 * self.intermediate
        return self.layers * self.hidden * (self.attention_width + self.query_width + mlp) + self.expert_params

    @property
    def kv_width(self) -> int:
        """A token's keys and values in one layer, in elements (2 x key heads x head_dim): what the KV cache holds."""
        return self.attention_width - self.query_width

    @property
    def largest_tensor(self) -> int:
        """The most elements one parameter has: the embedding or head, or (MoE) one layer's experts at most."""
        return max(self.vocab * self.hidden, self.expert_params // self.layers if self.experts else 0,
                   self.intermediate * self.hidden)

    def layer_activation_bytes(self, dtype_bytes: int, tensor_parallel: int = 1) -> int:
        """What autograd keeps of one decoder layer for one token: the norms' fp32 inputs and outputs, q/k/v and the
        attention output, the MLP's gate/up, activation and down-projection input, the residual stream; in a MoE
        layer also about four hidden-wide tensors for each expert the token is routed to (transformers' eager experts
        gather its input, and keep the expert's output and its weighted copy; fitted to the H100 runs of
        benchmarks/results/gpu/moe). With tensor parallelism a rank keeps its shard of q/k/v, attention and the MLP;
        the hidden-wide tensors are whole on every rank."""
        routed = 4 * self.experts_per_token * self.hidden
        sharded = -(-(self.attention_width + 4 * self.intermediate) // tensor_parallel)
        width = 6 * self.hidden + sharded + routed
        return width * dtype_bytes + 4 * 4 * self.hidden


def _bytes(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def weight_bytes(shape: ModelShape, dtype: str, packed_format: QuantFormat | None = None) -> int:
    """A model's weights in `dtype`; its decoder's linear weights as their codes where they are packed under
    `packed_format` (a frozen quantized model: qarl/quant/packed.py)."""
    from qarl.quant.packed import packed_bytes_per_weight

    full = shape.params * _bytes(dtype)
    per_weight = packed_bytes_per_weight(packed_format) if packed_format is not None else None
    if per_weight is None:
        return full
    return full - shape.linear_params * _bytes(dtype) + int(shape.linear_params * per_weight)


@dataclass(frozen=True)
class FrozenModel:
    """The loop's frozen model beside the policy: GRPO's KL reference, QAD's teacher (its logits are chunked with
    the student's)."""

    name: str
    shape: ModelShape
    dtype: str
    packed_format: QuantFormat | None = None  # its quantized weights are packed (`weight_bytes`)


def kv_cache_token_bytes(shape: ModelShape, dtype: str, fp8: bool) -> int:
    """The engine's KV cache bytes per token: every layer's keys and values, 1 byte an element in an FP8 cache, else
    the compute dtype's."""
    return shape.layers * shape.kv_width * (1 if fp8 else _bytes(dtype))


@dataclass
class MemoryPlan:
    """Bytes by part; `update` and `rollout` are the two peaks, `available` what the device offers."""

    resident: dict[str, int]  # the policy's state through the whole run
    update_parts: dict[str, int]  # on top of `resident` at the update's peak
    engine: int  # the engine's memory while it runs (rollout)
    engine_knob: str  # the setting that sizes it
    available: int
    checkpointing: bool
    tokens_per_micro_batch: int
    activations: int  # what autograd keeps of the decoder for one micro-batch
    kv_cache_tokens: int = 0  # the tokens the engine's KV cache holds (its share, less weights, where it has one)
    kv_cache_dtype: str = ""  # what it holds them in: "fp8" (1 byte an element) or the compute dtype

    @property
    def update(self) -> int:
        return sum(self.resident.values()) + sum(self.update_parts.values())

    @property
    def rollout(self) -> int:
        return sum(self.resident.values()) + self.engine

    def fits(self) -> bool:
        return max(self.update, self.rollout) <= self.available

    def describe(self) -> str:
        parts = {**self.resident, **self.update_parts}
        return (f"update ~{self.update / GiB:.1f} GiB ({', '.join(f'{k} {v / GiB:.1f}' for k, v in parts.items())}), "
                f"rollout ~{self.rollout / GiB:.1f} GiB (engine {self.engine / GiB:.1f}, its KV cache ~"
                f"{self.kv_cache_tokens:,} tokens in {self.kv_cache_dtype}), {self.available / GiB:.1f} GiB usable")


def checkpoint_bytes(plan: MemoryPlan, shards: int = 1) -> dict[str, int]:
    """What one checkpoint writes (qarl/checkpoint.py), from the state the plan counts: the master weights (policy/,
    in the master dtype: the compute weights when they are the masters) and AdamW's two moments (trainer_state.pt);
    `shards`: the processes each holding a share (tensor parallelism). The amax and the tokenizer add little. A LoRA
    run (no AdamW state in the plan: its adapters' is small) writes only its adapters: {}."""
    if "adamw" not in plan.resident:
        return {}
    weights = plan.resident.get("masters", plan.resident["weights"])
    return {"weights": weights * shards, "AdamW state": plan.resident["adamw"] * shards}


def available_bytes() -> int:
    """The free bytes the plan may use, for this process: on a GPU its own device; on a CPU its share of the host's
    memory, which torchrun's processes on this host (LOCAL_WORLD_SIZE) divide."""
    if torch.cuda.is_available():
        return int(torch.cuda.mem_get_info()[0] * HEADROOM)
    import psutil

    return int(psutil.virtual_memory().available * HEADROOM) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def engine_bytes(cfg: RecipeConfig, shape: ModelShape) -> tuple[int, str]:
    """The engine's memory while it runs, and the setting that sizes it: on a GPU its share of the device (the weights
    it shares with the policy are in it already), or a fixed KV cache with its own weights and working memory; on a
    CPU its KV cache and its own weights."""
    gen, weights = cfg.policy.generation, shape.params * _bytes(cfg.policy.dtype)
    if not torch.cuda.is_available():
        return gen.cpu_kv_cache_gib * GiB + weights, "policy.generation.kv_cache_gib"
    if gen.gpu_kv_cache_gib is None:
        share = gen.gpu_memory_utilization * torch.cuda.mem_get_info()[1]
        return int(share), "policy.generation.gpu_memory_utilization"
    return int(gen.gpu_kv_cache_gib * GiB) + weights + ENGINE_WORKSPACE, "policy.generation.gpu_kv_cache_gib"


def engine_kv_cache_bytes(cfg: RecipeConfig, shape: ModelShape, engine: int) -> int:
    """The engine's KV cache: its fixed size (CPU: kv_cache_gib; GPU: gpu_kv_cache_gib), else what its share of the GPU
    (`engine` bytes) leaves beside the weights and working memory (an estimate: vLLM measures it as it starts)."""
    gen = cfg.policy.generation
    if not torch.cuda.is_available():
        return gen.cpu_kv_cache_gib * GiB
    if gen.gpu_kv_cache_gib is not None:
        return int(gen.gpu_kv_cache_gib * GiB)
    return max(0, engine - shape.params * _bytes(cfg.policy.dtype) - ENGINE_WORKSPACE)


def plan(cfg: RecipeConfig, shape: ModelShape, longest_prompt: int, checkpointing: bool,
         frozen: FrozenModel | None = None, micro_batch_size: int | None = None) -> MemoryPlan:
    """The plan of `cfg` for a policy of `shape` (and the loop's frozen model), one micro-batch of
    `micro_batch_size` rows (default: the recipe's) of at most `longest_prompt` + max_new_tokens tokens each, on one
    process: on the Megatron backend its tensor-parallel shard of the weights, master weights, AdamW state,
    gradients and layer activations (data-parallel ranks each hold their whole shard; the frozen model and the
    gathered vocabulary are counted whole)."""
    p, t, gen = cfg.policy, cfg.trainer, cfg.policy.generation
    compute, master = _bytes(p.dtype), _bytes(p.master_dtype)
    tp = p.tensor_parallel_size if p.backend == "megatron" else 1
    params = -(-shape.params // tp)  # this rank's share
    row = min(longest_prompt + gen.max_new_tokens, gen.max_model_len)
    if t.token_budget > 0 and micro_batch_size is None:  # by tokens (a longer row goes alone)
        tokens = max(t.token_budget, row)
    else:
        tokens = (micro_batch_size or t.micro_batch_size) * row
    if p.lora.mode != "none":  # a frozen base (packed in qlora); the adapters are small
        packed = resolve_format(p.quant_cfg) if p.lora.mode == "qlora" and p.lora.pack_base else None
        resident = {"weights": weight_bytes(shape, p.dtype, packed)}
        gradients, step = 0, 0
    else:
        resident = {"weights": params * compute}
        if master != compute:
            resident["masters"] = params * master
        resident["adamw"] = 2 * params * master
        gradients = params * compute
        step_group = min(params, max(STEP_GROUP_BYTES // master, -(-shape.largest_tensor // tp)))
        step = (params + step_group) * master - gradients  # master-dtype gradients, a group's temporaries
    if frozen is not None:
        resident[frozen.name] = weight_bytes(frozen.shape, frozen.dtype, frozen.packed_format)
    layer = shape.layer_activation_bytes(compute, tp)
    if checkpointing:  # each layer's input kept, one layer's activations at a time in the backward
        activations = tokens * (shape.layers * shape.hidden * compute + layer)
    else:
        activations = tokens * shape.layers * layer
    if shape.experts and resolve_format(p.quant_cfg) is not None:  # ModelOpt's experts keep each used expert's Q(W)
        activations += shape.expert_params * compute // tp // (shape.layers if checkpointing else 1)  # (backward)
    chunk = min(p.logprob_chunk_tokens, tokens) if p.logprob_chunk_tokens > 0 else tokens
    vocab_chunks = (2 if frozen is not None and frozen.name == "teacher" else 1) * chunk * shape.vocab * 4
    forward_backward = gradients + activations + VOCAB_CHUNK_TENSORS * vocab_chunks + tokens * shape.hidden * 4
    if t.cuda_graphs == "on":  # the graphs' pool and the kept gradients stay through the optimizer step
        update_parts = {"gradients": gradients, "CUDA graph pool": forward_backward - gradients,
                        "optimizer step": gradients + step}
    elif forward_backward >= gradients + step:
        update_parts = {"gradients": gradients, "activations": activations,
                        "vocabulary chunk": VOCAB_CHUNK_TENSORS * vocab_chunks}
    else:
        update_parts = {"optimizer step": gradients + step}
    engine, engine_knob = engine_bytes(cfg, shape)
    if not sleeps_between_rollouts(gen):  # awake during the update
        update_parts["engine (awake)"] = engine
    fp8_cache = quantizes_kv_cache(resolve_format(gen.quant_cfg))
    kv_tokens = engine_kv_cache_bytes(cfg, shape, engine) // kv_cache_token_bytes(shape, p.dtype, fp8_cache)
    return MemoryPlan(resident, update_parts, engine, engine_knob, available_bytes(), checkpointing, tokens,
                      activations, kv_tokens, "fp8" if fp8_cache else p.dtype)


def plan_memory(cfg: RecipeConfig, shape: ModelShape, longest_prompt: int,
                frozen: FrozenModel | None = None) -> tuple[RecipeConfig, MemoryPlan]:
    """The recipe with `policy.gradient_checkpointing` decided (auto: on only when the update does not fit without
    it), and its plan; a ConfigError naming the knob when nothing fits."""
    mode = cfg.policy.gradient_checkpointing
    candidates = {"off": [False], "on": [True], "auto": [False, True]}[mode]
    if cfg.trainer.cuda_graphs == "on" or cfg.policy.exact_forward:  # a captured micro-batch is not checkpointed
        candidates = [False]  # (qarl/graphs.py refuses "on"), nor is the exact forward's own loop over the layers
    for checkpointing in candidates:
        found = plan(cfg, shape, longest_prompt, checkpointing, frozen)
        check_kv_cache_holds_a_sequence(cfg, found)
        if found.fits():
            decided = dataclasses.replace(cfg.policy, gradient_checkpointing="on" if checkpointing else "off")
            return dataclasses.replace(cfg, policy=decided), found
    raise ConfigError(_refusal(cfg, shape, longest_prompt, frozen, found))


def check_kv_cache_holds_a_sequence(cfg: RecipeConfig, memory: MemoryPlan) -> None:
    """A KV cache of a fixed size (kv_cache_gib, gpu_kv_cache_gib) must hold one sequence of max_model_len tokens, or
    vLLM refuses to start once the policy has loaded."""
    longest = cfg.policy.generation.max_model_len
    if memory.engine_knob != "policy.generation.gpu_memory_utilization" and memory.kv_cache_tokens < longest:
        raise ConfigError(f"the engine's KV cache ({memory.engine_knob}) holds ~{memory.kv_cache_tokens:,} tokens in "
                          f"{memory.kv_cache_dtype}, fewer than one sequence of policy.generation.max_model_len="
                          f"{longest}: raise {memory.engine_knob}, lower max_model_len, or hold the cache in FP8 "
                          "(quant_configs/*_kv_fp8.yaml, docs/guides/kv-cache.md)")


def _refusal(cfg: RecipeConfig, shape: ModelShape, longest_prompt: int, frozen: FrozenModel | None,
             failed: MemoryPlan) -> str:
    """Why the run cannot fit, and the setting to change: the largest micro-batch that fits, else what else to try."""
    head = f"the run does not fit in memory: {failed.describe()}. "
    if frozen is not None and frozen.name == "teacher":
        head += ("Change teacher.dtype (e.g. bfloat16) or choose a smaller teacher.model_name "
                 f"({frozen.shape.params / 1e9:.2f}B parameters in {frozen.dtype}). ")
    if failed.rollout > failed.available:
        return head + (f"The policy's state and the engine's share do not fit together: lower {failed.engine_knob}, "
                       "train adapters (policy.lora.mode=qlora), or use a smaller model.")
    budget = cfg.trainer.token_budget
    if budget > 0:  # micro-batches by tokens: the largest budget that fits, in steps of 1,024 tokens
        fitting = [tokens for tokens in range(budget - budget % 1024, 0, -1024)
                   if plan(dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, max_tokens_per_micro_batch=tokens)),
                           shape, longest_prompt, failed.checkpointing, frozen).fits()]
        knob = "trainer.max_tokens_per_micro_batch"
    else:
        fitting = [rows for rows in range(cfg.trainer.micro_batch_size - 1, 0, -1)
                   if plan(cfg, shape, longest_prompt, failed.checkpointing, frozen, micro_batch_size=rows).fits()]
        knob = "trainer.micro_batch_size"
    if fitting:
        hint = f"set {knob}={fitting[0]} (the largest that fits)"
    else:
        hint = ("no micro-batch fits: lower policy.generation.max_new_tokens or policy.logprob_chunk_tokens, or "
                "train adapters (policy.lora.mode=qlora)")
    if cfg.trainer.cuda_graphs == "on":
        hint += ", or set trainer.cuda_graphs=off (its pool holds a micro-batch's activations through the step)"
    elif not failed.checkpointing and not cfg.policy.exact_forward:
        hint += ", or set policy.gradient_checkpointing=on (or auto)"
    return head + hint + "."
