"""Recipes: OmegaConf YAML with `defaults:` inheritance and `a.b=c` overrides, validated into dataclasses.

A recipe file may list `defaults: [other.yaml, ...]` (paths relative to the file); those are merged
first, in order, then the file itself, then command-line overrides. The result is merged onto the
dataclass schema below, so a misspelt key or a wrongly typed value is an error that names it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

REPO_ROOT = Path(__file__).resolve().parent.parent


class ConfigError(ValueError):
    """A recipe, override or setting that cannot be used; the message says what to change."""


SWITCH_MODES = ("auto", "on", "off")


def switch_mode(value: object, key: str) -> str:
    """A setting of SWITCH_MODES read from a recipe (`key`: its name, for the error). YAML reads a bare on/off as a
    boolean: both spellings are accepted."""
    mode = {"true": "on", "false": "off"}.get(str(value).lower(), str(value))
    if mode not in SWITCH_MODES:
        raise ConfigError(f"{key}={value!r}; choose one of {SWITCH_MODES}")
    return mode


class TrainingDiverged(RuntimeError):
    """Too many consecutive steps with a non-finite loss or gradient (raised by qarl.optim's guard)."""


@dataclass
class RunConfig:
    dir: str = "runs/default"
    seed: int = 0
    # Where metrics go besides RUN_DIR/metrics.jsonl (always written, the source of truth):
    # "tensorboard" (RUN_DIR/tensorboard, needs the tensorboard package) and/or "wandb" (needs wandb;
    # offline unless WANDB_MODE says otherwise, so nothing leaves the machine unless asked).
    loggers: list[str] = field(default_factory=list)
    wandb_project: str = "qarl"


@dataclass
class GenerationConfig:
    """The rollout engine (vLLM) and how it samples."""

    backend: str = "vllm"
    # Must equal policy.quant_cfg (the engine quantizes exactly as the policy trains) unless
    # allow_quant_mismatch is set, for experiments on what a mismatch costs. "none" = unquantized.
    quant_cfg: str | None = "${policy.quant_cfg}"
    allow_quant_mismatch: bool = False
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    # vLLM engine settings. kv_cache_gib only matters on CPU (VLLM_CPU_KVCACHE_SPACE).
    gpu_memory_utilization: float = 0.3
    kv_cache_gib: float = 1.0
    max_model_len: int = 256
    tensor_parallel_size: int = 1
    # Colocation on one GPU: the engine sleeps (KV cache released; weights to host memory unless the policy
    # shares them, see share_weights) while the policy trains and wakes for the rollout. "auto": on when CUDA
    # is used; ignored on CPU.
    sleep_between_rollouts: str = "auto"  # auto | on | off
    # "auto": CUDA graphs and vLLM's compilation on a GPU, refit in place; eager on CPU and for runs
    # graphs cannot serve (qlora adapters, AWQ input scales). "true": always eager; "false": graphs or refuse.
    enforce_eager: str = "auto"  # auto | true | false
    # One copy of the rollout weights: with mixed precision (compute weights rewritten from fp32 masters) the
    # policy's compute weights become views into the engine's tensors after the first refit, so refits copy
    # only the rest and a sleeping engine keeps its weights (the policy trains with them). false: copy them all.
    share_weights: bool = True
    # A qlora policy's frozen base in the engine (qarl/generation/packed_base.py). "auto": written once as a packed
    # NVFP4 W4A16 checkpoint that vLLM serves with its own 4-bit kernel (FP4 Marlin) where it can (a CUDA GPU, an
    # NVFP4 W4A16 qlora base in bf16/fp16), else folded in the compute dtype; "on": packed or refuse; "off": folded.
    # (Training and QAD runs; `qarl eval`, `parity` and `matrix` keep the base folded.)
    packed_base: str = "auto"  # auto | on | off
    # How the engine computes a qlora policy's adapters. "lora": beside its base, in vLLM's LoRA layers (qarl's hooks,
    # eagerly, where they cannot serve); refits send only the adapters. "merged": folded into its weights as
    # Q(W) + s B A (as TRL syncs LoRA into vLLM): the engine's own speed without LoRA kernels, the adapted layers' whole
    # weights sent at every refit, the base held in the compute dtype (not with packed_base=on); weight-only formats (a
    # quantized layer input would reach the merged adapter quantized). "auto": lora where vLLM's LoRA serves the
    # adapters, merged where it cannot and a merge can (e.g. MoE models), else lora's hooks. Training and QAD runs.
    qlora_adapters: str = "auto"  # auto | lora | merged

    def __post_init__(self) -> None:
        if self.qlora_adapters not in ("auto", "lora", "merged"):
            raise ConfigError(f"policy.generation.qlora_adapters={self.qlora_adapters!r}; choose auto, lora or merged")


@dataclass
class LoraConfig:
    """LoRA adapters over the frozen (fake-quantized) base; see qarl/lora.py for when to pick which mode.

    mode "none": full training. "qlora": y = Q(W) x + s B A x, the adapter (fp32 masters) next to the
    packed quantized base (deployed: the quantized base plus the adapter). "merged": y = Q(W + s B A) x, LoRA-only
    QAT (deployed: one quantized merged model). s = alpha / rank, as in PEFT.
    """

    mode: str = "none"  # none | qlora | merged
    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0  # on the adapter's input (qlora only: merged has no separate adapter input)
    # Module names (or their last components) the adapters attach to, PEFT's matching.
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    # Adaptive quantization noise (QeRL): channel-wise Gaussian noise of std noise_start, decaying
    # geometrically to noise_end over the run, multiplied into the frozen norm weights in front of the
    # quantized projections (policy and engine see the same noise). 0 = off.
    noise_start: float = 0.0
    noise_end: float = 5e-4
    # qlora: keep the frozen base as its codes (NVFP4: 0.56 bytes a parameter, FP8: 1), decoded per layer in the
    # forward and the backward, the same bits as the quantized weight (qarl/quant/packed.py). false: the base in
    # the compute dtype (needed only to change or unquantize frozen weights in a script).
    pack_base: bool = True


@dataclass
class PolicyConfig:
    # "embedded:tiny" (made locally, the default) or any Hugging Face causal LM directory or hub name.
    model_name: str = "embedded:tiny"
    # The compute dtype: what the forward, the fake quantizers and the rollout engine run in.
    dtype: str = "float32"
    # Master weights and optimizer state. Wider than `dtype` (bf16/fp16 compute), the model holds a
    # compute-dtype copy that is refreshed from these after every optimizer step (qarl/optim.py).
    master_dtype: str = "float32"
    trust_remote_code: bool = False
    # A built-in ModelOpt config name (NVFP4_DEFAULT_CFG, W4A16_NVFP4_CFG, FP8_DEFAULT_CFG, ...),
    # a YAML path (absolute, relative to the working directory, or to quant_configs/), or "none".
    quant_cfg: str = "quant_configs/nvfp4_a16.yaml"
    # "task" (the task's own prompts), a local .jsonl/.json/.parquet/.txt file, or a datasets hub name.
    quant_calib_data: str = "task"
    quant_calib_text_column: str = "prompt"
    quant_calib_size: int = 64
    quant_batch_size: int = 16
    quant_sequence_length: int = 64
    # Quantize each weight once per change of the weights instead of at every forward, and skip ModelOpt's
    # per-call machinery (same bits; with master weights each compute weight holds its quantized value, else
    # one quantized copy of each quantized weight is cached; see qarl/quant/fastpath/weight_cache.py). false: ModelOpt's
    # own path, unchanged.
    quant_weight_cache: bool = True
    # Run the policy's forward with the rollout engine's own kernels, in its order and layout (GPU: Hopper,
    # bf16/fp16, Llama/Qwen2): the engine's log-prob of every sampled token then equals the policy's bit for
    # bit, in every format. The engine runs vLLM's batch-invariant mode. See qarl/backends/exact_forward.py.
    exact_forward: bool = False
    # Log-probs, entropy and the QAD KL come from the final hidden states this many completion tokens at a time (the
    # head, the log-softmax, the KL), each chunk recomputed in the backward: a [tokens, vocabulary] fp32 tensor
    # exists for one chunk, never for the whole micro-batch (qarl/scoring.py). 0: the whole vocabulary at once (the
    # path before chunking, for comparisons; split chunks differ from it within fp32 rounding).
    logprob_chunk_tokens: int = 512
    # Activation checkpointing of the decoder layers during the update: "off", "on", or "auto" (on only when the
    # memory plan finds the update does not fit without it; qarl/memory.py). The STE gradients are unchanged.
    gradient_checkpointing: str = "auto"
    # Each RMSNorm layer compiled (torch.compile) into fused kernels instead of ~7 eager ones a pass
    # (qarl/models/compiled.py). Sums in another order: the policy's log-probs move within fp32 rounding, and the
    # engine's own norm kernel differs from either, so synced parity stays at its floor. The HF backend; not with
    # the exact forward.
    compile_norms: bool = False
    # Each gated MLP's act(gate) * up compiled into one kernel (qarl/models/compiled.py; the Llama, Mistral, Qwen and
    # Gemma 3 MLPs): rounded once where eager rounds the activation and the product each, so within bf16 rounding of
    # eager, and refused with the exact forward like compile_norms. The HF backend.
    compile_mlp: bool = False
    # Each decoder layer compiled whole (qarl/models/compiled.py): its norms, gated MLP, rotary embedding, residual
    # additions and the reshapes around attention fused; a quantized linear layer is traced only as the plain matmul
    # of a weight that holds its quantized value (mixed precision), any other runs eagerly between the graphs, the
    # same quantizer ops as eager. Within rounding of eager like compile_norms and compile_mlp, which it includes
    # (set those false); an activation format's codes can flip where a compiled norm's output differs in its last bit.
    # Dense layers, no LoRA, the weight cache on; not with the exact forward. The HF backend.
    compile_layers: bool = False
    # The linear head's scoring (each chunk's log-softmax, picked log-prob and entropy, and its backward) run as
    # compiled kernels that read the logits a few times instead of writing several fp32 [chunk, vocabulary] tensors
    # (qarl/scoring.py LinearHeadScores): within fp32 rounding of eager. QA-GRPO's scoring (the sampled tokens'
    # log-probs), not QAD's KL; a plain linear head and logprob_chunk_tokens > 0; not with the exact forward. The HF
    # backend.
    compile_scores: bool = False
    # The training backend: "hf" (transformers, one process) or "megatron" (megatron-core, tensor parallel
    # over the processes torchrun starts; see the README's Megatron section).
    backend: str = "hf"
    tensor_parallel_size: int = 1  # megatron: the TP size (the processes beyond it are data parallel)
    lora: LoraConfig = field(default_factory=LoraConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)

    def __post_init__(self) -> None:
        """Settings that cannot run, and those the exact forward cannot serve, refused as the recipe loads (what
        the machine and the model must offer is checked in qarl/backends/exact_forward.py before the model loads)."""
        if self.logprob_chunk_tokens < 0:
            raise ConfigError(f"policy.logprob_chunk_tokens={self.logprob_chunk_tokens}: use a count of tokens, or 0 "
                              "for the whole vocabulary at once")
        self.gradient_checkpointing = switch_mode(self.gradient_checkpointing, "policy.gradient_checkpointing")
        if self.compile_layers and (self.compile_norms or self.compile_mlp):
            raise ConfigError("policy.compile_layers compiles the norms and gated MLPs inside each decoder layer too: "
                              "set policy.compile_norms=false and policy.compile_mlp=false")
        if self.compile_layers and not self.quant_weight_cache:
            raise ConfigError("policy.compile_layers keeps qarl's quantized linear layers out of the compiled graphs "
                              "(but plain matmuls of held weights); with policy.quant_weight_cache=false they run "
                              "ModelOpt's own forward, which the compiler would trace: set "
                              "policy.quant_weight_cache=true or policy.compile_layers=false")
        if self.compile_layers and self.lora.mode != "none":
            raise ConfigError(f"policy.compile_layers with policy.lora.mode={self.lora.mode}: the adapters' layers are "
                              "not kept out of the compiled graphs; set policy.compile_layers=false (compile_norms and "
                              "compile_mlp work with LoRA)")
        if self.compile_scores and self.logprob_chunk_tokens == 0:
            raise ConfigError("policy.compile_scores compiles the scoring of each chunk of tokens, and "
                              "policy.logprob_chunk_tokens=0 scores the whole vocabulary at once: set one of them")
        if not self.exact_forward:
            return
        conflicts = [
            f"policy.dtype={self.dtype} (FlashAttention computes in bfloat16 or float16)"
            if self.dtype not in ("bfloat16", "float16") else "",
            f"policy.backend={self.backend} (the Megatron backend's attention, norms and sharded matmuls are not the "
            "engine's kernels; use policy.backend=hf)" if self.backend != "hf" else "",
            f"policy.lora.mode={self.lora.mode} (the engine's adapters, vLLM's LoRA kernels or qarl's hooks, are not "
            "part of the exact forward)" if self.lora.mode != "none" else "",
            "policy.generation.allow_quant_mismatch (the engine would quantize differently on purpose)"
            if self.generation.allow_quant_mismatch else "",
            "policy.generation.tensor_parallel_size > 1 (sharded matmuls sum in another order)"
            if self.generation.tensor_parallel_size != 1 else "",
            f"policy.generation.top_p={self.generation.top_p} (the engine's log-probs would be of the top-p-masked "
            "logits)" if self.generation.top_p < 1 else "",
            "policy.quant_weight_cache=false (the exact forward quantizes fused layers' shared input once, through "
            "qarl's fast input quantizers)" if not self.quant_weight_cache else "",
            "policy.compile_norms (compiled norms sum in another order than the engine's)"
            if self.compile_norms else "",
            "policy.compile_mlp (the fused activation rounds once where the engine's kernel rounds twice)"
            if self.compile_mlp else "",
            "policy.compile_layers (compiled norms, activations and rotary embeddings round otherwise than the "
            "engine's kernels)" if self.compile_layers else "",
            "policy.compile_scores (the exact forward scores with the engine's own log-softmax kernel)"
            if self.compile_scores else "",
        ]
        conflicts = [c for c in conflicts if c]
        if conflicts:
            raise ConfigError("policy.exact_forward=true cannot run with " + "; ".join(conflicts))


@dataclass
class TaskConfig:
    """Where prompts and answers come from: the embedded arithmetic task, or a prompt dataset."""

    name: str = "arithmetic"  # "arithmetic" (embedded, see qarl/tasks/arithmetic.py) or "dataset"
    op: str = "reverse"  # arithmetic: reverse | add
    num_digits: int = 5
    num_train: int = 2000
    num_eval: int = 100
    # arithmetic: the seed that draws the problems and splits them; None = run.seed. Pin it to give runs
    # of different run.seed one train/held-out split (and `qarl matrix` one held-out set for all of them).
    seed: int | None = None
    # name=dataset: local .jsonl/.json/.parquet files or hub names (datasets.load_dataset), with a
    # prompt and an answer column; eval_data is the held-out split.
    train_data: str = ""
    eval_data: str = ""
    prompt_column: str = "prompt"
    answer_column: str = "answer"
    # prompts through the tokenizer's chat template (qarl/tasks/chat.py): auto = when the tokenizer has one
    # (the embedded one does), on = required, off = raw text. The answer ends with the token the template closes
    # a turn with (stop_token: that token's name, found from the template when empty).
    chat_template: str = "auto"
    system_prompt: str = ""
    stop_token: str = ""


@dataclass
class RewardSpec:
    """A registered reward name (see qarl.rewards.REWARDS) or a dotted path `pkg.module:function`."""

    name: str = "arithmetic"
    weight: float = 1.0


@dataclass
class WarmStartConfig:
    """A short supervised warm start so the embedded model sometimes succeeds (RL needs reward > 0)."""

    enabled: bool = True
    steps: int = 150
    batch_size: int = 64
    lr: float = 3e-3
    seed: int | None = None  # None = run.seed; pin it so RL runs of several seeds share one base model


@dataclass
class TrainerConfig:
    """GRPO. Names follow TRL's GRPOConfig where it has the same knob."""

    steps: int = 100
    batch_size: int = 64  # completions per step; num_generations must divide it
    num_generations: int = 8
    micro_batch_size: int = 64
    # > 0: micro-batches by tokens instead of rows: as many completions as fit in this many prompt + completion
    # tokens, packed back to back without padding (micro_batch_size is then not used; qarl/scoring.py). The loss
    # normalizations are unchanged (bnpo stays a token mean within each micro-batch).
    max_tokens_per_micro_batch: int = 0
    lr: float = 1e-4
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    scale_rewards: str = "group"  # group | batch | none
    epsilon: float = 0.2
    epsilon_high: float | None = None  # clip-higher (DAPO); None = epsilon
    loss_type: str = "dapo"  # grpo | dr_grpo | dapo | bnpo
    importance_sampling_level: str = "token"  # token | sequence (GSPO)
    beta: float = 0.0  # KL to a frozen reference (k3); 0 loads no reference
    mask_truncated_completions: bool = False
    num_iterations: int = 1
    vllm_importance_sampling_correction: bool = True
    vllm_importance_sampling_cap: float = 2.0
    rewards: list[RewardSpec] = field(default_factory=lambda: [RewardSpec()])
    reward_error: str = "raise"  # raise | zero: what a reward function that raises on a sample does
    # A step whose loss or gradient is not finite is skipped (and counted in the metrics); this many
    # in a row stop the run with an error. fp16 loss-scale overflows are skipped but not counted.
    max_nonfinite_steps: int = 3
    resume: bool = False


@dataclass
class EvalConfig:
    every: int = 10  # also at step 0 and at the end; 0: no held-out evaluation (a long-completion run's costs a step)
    num_prompts: int = 100


@dataclass
class CheckpointConfig:
    every: int = 25
    keep: int = 2


@dataclass
class TeacherConfig:
    """The frozen full-precision teacher of QAD."""

    # "warm-start": the student's own starting point (policy.model_name, warm-started when
    # warm_start.enabled), unquantized. Else a Hugging Face model directory or hub id, or a qarl
    # checkpoint / run directory (its policy/ master weights, unquantized).
    model_name: str = "warm-start"
    dtype: str = "${policy.dtype}"
    trust_remote_code: bool = False


@dataclass
class DistillConfig:
    """The QAD loss. Both models' distributions are taken at policy.generation.temperature, the
    temperature the student samples at, so the loss is the KL of what the engine actually samples.
    Steps, batch, micro-batch, optimizer, resume and the evaluation verifier come from `trainer`
    (its GRPO-only keys are unused)."""

    top_k: int = 0  # 0: the full vocabulary; k > 0: the student's top-k + a rest bucket (a lower bound)
    # "constant" (trainer.lr throughout) or "cosine" (trainer.lr decayed to 0 at trainer.steps): the
    # KL's gradient is a noisy estimate from one batch of samples, and a decaying step averages it out.
    lr_schedule: str = "constant"
    eval_teacher_accuracy: bool = True  # the teacher's greedy held-out accuracy at step 0 (never with eval.every=0)


@dataclass
class ParityConfig:
    """`qarl parity`: which formats to compare and how many samples."""

    formats: list[str] = field(default_factory=lambda: ["quant_configs/nvfp4_a16.yaml"])
    num_prompts: int = 16
    max_new_tokens: int = 32
    # Also measure each format with LoRA adapters (random, non-zero) in these modes: qlora, merged.
    lora_modes: list[str] = field(default_factory=list)


@dataclass
class MatrixConfig:
    """`qarl matrix`: held-out accuracy of several models at several precisions, and whether each
    model's gain over `base` survives quantization better than post-training quantization (PTQ)."""

    # The model gains are measured from: "warm-start" (this recipe's step-0 model) or a model/run path.
    base: str = "warm-start"
    # name -> qarl run directories, checkpoints or Hugging Face model directories. Several paths are
    # seeds of one recipe: each is evaluated, and the rows average them prompt by prompt.
    models: dict[str, list[str]] = field(default_factory=dict)
    # Every model is evaluated unquantized, at each of these formats with each PTQ method (ModelOpt
    # calibration algorithms: max, mse, awq_lite, ...; "default" = the format's own; on the recipe's
    # calibration data), and at its own trained quantization.
    formats: list[str] = field(default_factory=lambda: [
        "quant_configs/nvfp4_a16.yaml", "quant_configs/nvfp4_w4a4.yaml", "quant_configs/fp8_w8a8.yaml"])
    ptq_methods: list[str] = field(default_factory=lambda: ["max", "awq_lite"])
    num_prompts: int = 1000  # held-out prompts (task.num_eval must provide them); SE <= 0.5/sqrt(n)
    out: str = "${run.dir}/matrix"


@dataclass
class RecipeConfig:
    run: RunConfig = field(default_factory=RunConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    parity: ParityConfig = field(default_factory=ParityConfig)
    matrix: MatrixConfig = field(default_factory=MatrixConfig)


def _load_with_defaults(path: Path, seen: tuple[Path, ...] = ()) -> DictConfig:
    if not path.is_file():
        raise ConfigError(f"recipe file not found: {path}")
    if path in seen:
        raise ConfigError(f"recipe defaults form a cycle: {' -> '.join(map(str, seen + (path,)))}")
    node = OmegaConf.load(path)
    defaults = node.pop("defaults", [])
    merged = OmegaConf.create()
    for parent in defaults:
        merged = OmegaConf.merge(merged, _load_with_defaults((path.parent / str(parent)).resolve(), seen + (path,)))
    return OmegaConf.merge(merged, node)


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = (), schema: type = RecipeConfig) -> Any:
    """Load a recipe file, apply `a.b=c` overrides, and validate it into `schema` (a dataclass)."""
    raw = _load_with_defaults(Path(path).resolve())
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(f"overrides must look like key.sub=value; got {bad}")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), raw, OmegaConf.from_dotlist(list(overrides)))
        OmegaConf.resolve(merged)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise ConfigError(f"invalid recipe {path}: {e.msg if hasattr(e, 'msg') else e}".strip()) from None


def to_dict(cfg: Any) -> dict:
    """A plain dict of a validated config, for logging next to a run's outputs."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
