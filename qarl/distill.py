"""QAD: on-policy quantization-aware distillation, top to bottom.

    recipe -> checks (settings; teacher and student tokenizers match; teacher + student + engine fit)
    -> student: the fake-quantized policy (warm start, quantize, calibrate | resume from a checkpoint)
    -> teacher: full precision, frozen (default: the student's own starting point, unquantized)
    -> vLLM engine: the teacher's held-out accuracy once (engine unquantized), then the student's
       format and a refit (weights + amax) -> for each step:
         rollout (the quantized student samples) -> student and teacher score the same sequences
         -> per-token reverse KL(student || teacher) over the vocabulary (qarl/distill_loss.py)
         -> update of the fake-quantized student (straight-through to the master weights)
         -> refit -> metrics row -> checkpoint
    -> final evaluation, plot, summary.

Evaluation (step 0 = plain post-training quantization of the teacher, every `eval.every` steps, and
at the end): `eval/accuracy`, the quantized student's greedy held-out accuracy, and
`eval/teacher_kl`, the same reverse KL as the loss on the student's samples for held-out prompts.

What QA-GRPO and QAD share (the step-0 policy, the step's prompts, the rollout, evaluation,
checkpoints, metrics) comes from qarl.train and the modules it uses; this file holds what
distillation adds. `qarl distill RECIPE [a.b=c ...]` (qarl/cli.py) runs it.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from transformers import PreTrainedModel

from qarl.checkpoint import latest_checkpoint, resolve_checkpoint, restore_trainer_state, save_checkpoint, trainer_state
from qarl.config import ConfigError, LoraConfig, RecipeConfig, to_dict
from qarl.distill_loss import reverse_kl
from qarl.evaluate import evaluate
from qarl.generation import Completion, VLLMEngine
from qarl.lora import ADAPTER_PARAMS
from qarl.models.checks import parameter_count, tokenizer_differences, vocab_width
from qarl.metrics import MetricsLog, ProgressFigures, device_memory_gib, progress_bar, report_run
from qarl.optim import NonFiniteGuard, PolicyOptimizer, step_metrics
from qarl.policy import DTYPES, Policy, attach_rollout_view, build_policy, completion_logits, resolve_model_dir
from qarl.quant import check_generation_matches, resolve_format
from qarl.rewards import WeightedRewards
from qarl.tasks import Problem, Task, build_task
from qarl.train import (Rollout, check_run_settings, initial_model_dir, initial_policy, resumed_policy, rollout,
                        rollout_and_timing_metrics, step_problems)

GiB = 2**30
WARM_START_TEACHER = "warm-start"
DISTILL_PANELS = [("distill/kl", "KL(student || teacher), training samples"), ("eval/teacher_kl", "KL to teacher, held-out"),
                  ("eval/accuracy", "held-out accuracy (quantized student)"), ("mismatch/kl", "train/rollout mismatch KL")]
LR_SCHEDULES = ("constant", "cosine")
MEMORY_MARGIN = 0.1  # of the available memory, left for activations and allocator slack
EVAL_SEED_OFFSET = 2**30  # held-out samples' seeds: apart from every rollout's (run.seed * 1_000_003 + position)


# -- checks before anything heavy ------------------------------------------------------------------
def check_distill_config(cfg: RecipeConfig) -> None:
    t = cfg.trainer
    if t.steps < 1 or t.micro_batch_size < 1 or t.num_generations < 1:
        raise ConfigError("trainer.steps, trainer.micro_batch_size and trainer.num_generations must be >= 1")
    if t.batch_size % t.num_generations:
        raise ConfigError(f"trainer.batch_size={t.batch_size} is not divisible by trainer.num_generations="
                          f"{t.num_generations}")
    if cfg.distill.top_k < 0:
        raise ConfigError(f"distill.top_k={cfg.distill.top_k}: use 0 (full vocabulary) or a positive k")
    if cfg.distill.lr_schedule not in LR_SCHEDULES:
        raise ConfigError(f"distill.lr_schedule={cfg.distill.lr_schedule!r}; choose one of {LR_SCHEDULES}")
    if cfg.teacher.dtype not in DTYPES:
        raise ConfigError(f"teacher.dtype={cfg.teacher.dtype!r}; choose one of {DTYPES}")


def teacher_source(cfg: RecipeConfig) -> str:
    """The teacher's model directory (or hub id) without running anything: the warm-start teacher
    shares the base model's tokenizer and shape, so the checks read the base model."""
    name = cfg.teacher.model_name
    if name == WARM_START_TEACHER:
        return resolve_model_dir(cfg.policy.model_name)
    path = Path(name).expanduser()
    if path.is_dir() and ((path / "policy").is_dir() or (path / "checkpoints").is_dir()):
        return str(resolve_checkpoint(path) / "policy")
    return resolve_model_dir(name)


def check_tokenizers(student_dir: str, teacher_dir: str, trust_remote_code: bool = False) -> None:
    """Distillation compares the two next-token distributions id by id: same vocabulary, same
    special tokens, same output width."""
    problems = tokenizer_differences(student_dir, teacher_dir, trust_remote_code)
    if problems:
        raise ConfigError(f"teacher.model_name ({teacher_dir}) does not share the student's tokenizer "
                          f"(policy.model_name: {student_dir}): {'; '.join(problems)}. Distillation compares the "
                          "two next-token distributions token by token; choose a teacher of the student's model family.")


def _dtype_bytes(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def check_memory(cfg: RecipeConfig, student_dir: str, teacher_dir: str) -> dict[str, float]:
    """Teacher weights + student training state + the engine's share + the loss's logits tensors must
    fit in the memory available now (GPU: torch.cuda.mem_get_info; CPU: psutil), minus a margin.
    Returns the estimate in GiB; raises a ConfigError naming the settings to change."""
    t, gen = cfg.trainer, cfg.policy.generation
    student_params = parameter_count(student_dir, cfg.policy.trust_remote_code)
    teacher_params = (student_params if teacher_dir == student_dir
                      else parameter_count(teacher_dir, cfg.teacher.trust_remote_code))
    vocab = vocab_width(student_dir, cfg.policy.trust_remote_code)
    need = {
        "teacher": teacher_params * _dtype_bytes(cfg.teacher.dtype),
        # the compute-dtype model and its grads; master weights, their grads and AdamW's two moments
        "student": student_params * (4 * _dtype_bytes(cfg.policy.master_dtype) + (
            2 * _dtype_bytes(cfg.policy.dtype) if cfg.policy.dtype != cfg.policy.master_dtype else 0)),
        # one micro-batch's fp32 [tokens, vocab] tensors: both models' logits, log-softmaxes, the KL terms, a grad
        "loss": 6 * t.micro_batch_size * gen.max_model_len * vocab * 4,
    }
    if torch.cuda.is_available():
        available, total = torch.cuda.mem_get_info()
        need["engine"] = gen.gpu_memory_utilization * total
        engine_knob = f"policy.generation.gpu_memory_utilization ({gen.gpu_memory_utilization} of {total / GiB:.1f} GiB)"
    else:
        import psutil

        available = psutil.virtual_memory().available
        need["engine"] = student_params * _dtype_bytes(cfg.policy.dtype) + max(1.0, gen.kv_cache_gib) * GiB
        engine_knob = f"policy.generation.kv_cache_gib ({gen.kv_cache_gib})"
    estimate = {k: v / GiB for k, v in need.items()}
    if sum(need.values()) > (1 - MEMORY_MARGIN) * available:
        parts = ", ".join(f"{k} {v:.1f}" for k, v in estimate.items())
        raise ConfigError(
            f"the teacher does not fit alongside the student and the engine: need ~{sum(estimate.values()):.1f} GiB "
            f"({parts}; teacher {cfg.teacher.model_name} = {teacher_params / 1e9:.2f}B params in {cfg.teacher.dtype}) "
            f"but {available / GiB:.1f} GiB is available ({1 - MEMORY_MARGIN:.0%} usable). Change teacher.dtype "
            f"(e.g. bfloat16), choose a smaller teacher.model_name, lower {engine_knob}, or lower "
            f"trainer.micro_batch_size / policy.generation.max_model_len for the loss tensors.")
    return estimate


# -- the teacher -----------------------------------------------------------------------------------
def load_teacher(cfg: RecipeConfig, task: Task) -> Policy:
    """The teacher as an unquantized, frozen Policy (so `evaluate` and the engine take it like the student)."""
    name = cfg.teacher.model_name
    model_dir = initial_model_dir(cfg, task) if name == WARM_START_TEACHER else teacher_source(cfg)
    # a whole model, never adapted; no exact forward (its log-probs are targets, never compared with the engine's)
    settings = dataclasses.replace(cfg.policy, dtype=cfg.teacher.dtype, trust_remote_code=cfg.teacher.trust_remote_code,
                                   lora=LoraConfig(), exact_forward=False)
    teacher = build_policy(settings, [], model_dir=model_dir, fmt=None)
    teacher.model.eval().requires_grad_(False)
    return teacher


def same_architecture(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    """Same weight names and shapes (adapters aside): the teacher's weights fit the student's engine."""
    shapes = lambda m: {n: tuple(p.shape) for n, p in m.named_parameters()  # noqa: E731
                        if n.rpartition(".")[2] not in ADAPTER_PARAMS}
    return shapes(a) == shapes(b)


# -- the loss on a step's samples ------------------------------------------------------------------
@dataclass
class PairScores:
    """Per completion token, [batch, longest completion]: the KL that is optimized (top-k estimate
    when top_k > 0), the full-vocabulary KL (no grad), the student's log-prob of the sampled token
    and its entropy (no grad), and the 0/1 mask. Padding positions are 0 everywhere."""

    kl: torch.Tensor
    kl_full: torch.Tensor
    logprobs: torch.Tensor
    entropy: torch.Tensor
    mask: torch.Tensor


def score_pair(student: PreTrainedModel, teacher: PreTrainedModel, completions: list[Completion], pad_id: int,
               temperature: float, top_k: int = 0) -> PairScores:
    """Both models score the same sequences; grad flows through the student only."""
    prompts, tokens = [c.prompt_ids for c in completions], [c.token_ids for c in completions]
    student_logits, targets, mask = completion_logits(student, prompts, tokens, pad_id)
    with torch.no_grad():
        teacher_logits = completion_logits(teacher, prompts, tokens, pad_id)[0].to(student_logits.device)
    kl = reverse_kl(student_logits, teacher_logits, temperature, top_k) * mask
    with torch.no_grad():
        kl_full = kl.detach() if top_k <= 0 else reverse_kl(student_logits, teacher_logits, temperature) * mask
        log_p = torch.log_softmax(student_logits.detach().float() / temperature, dim=-1)
        logprobs = log_p.gather(-1, targets[..., None]).squeeze(-1) * mask
        entropy = -(log_p.exp() * log_p).sum(-1) * mask
    return PairScores(kl=kl, kl_full=kl_full, logprobs=logprobs, entropy=entropy, mask=mask)


def learning_rate(cfg: RecipeConfig, step: int) -> float:
    """The step's learning rate: a pure function of the step, so a resumed run needs no scheduler state."""
    if cfg.distill.lr_schedule == "cosine":
        return cfg.trainer.lr * 0.5 * (1 + math.cos(math.pi * step / cfg.trainer.steps))
    return cfg.trainer.lr


def _micro_batches(items: list, size: int) -> list[list]:
    return [items[s : s + size] for s in range(0, len(items), size)]


def distill_update(student: Policy, teacher: Policy, optimizer: PolicyOptimizer, batch: Rollout,
                   cfg: RecipeConfig, lr: float) -> dict[str, float]:
    """One optimizer step on the masked token mean of the reverse KL over the step's samples.

    One pass only: the samples are the student's own, drawn by the engine that equals it, so the
    loss stays on-policy; the next step draws fresh ones from the updated student.
    """
    t = cfg.trainer
    comps = [c for c in batch.completions if c.token_ids]
    if not comps:
        return {}
    total_tokens = sum(len(c.token_ids) for c in comps)
    parts: dict[str, list[float]] = {"kl": [], "kl_full": [], "entropy": [], "mismatch": [], "max_diff": []}
    student.model.train()
    optimizer.zero_grad()
    for group in optimizer.param_groups:
        group["lr"] = lr
    # this process's micro-batches (data parallel), each weighted for the whole step
    for rows in student.local_share(_micro_batches(comps, t.micro_batch_size)):
        scores = score_pair(student.model, teacher.model, rows, student.tokenizer.pad_token_id,
                            cfg.policy.generation.temperature, cfg.distill.top_k)
        optimizer.backward(scores.kl.sum() / total_tokens)
        width = scores.mask.shape[1]
        engine_lp = torch.tensor([c.logprobs + [0.0] * (width - len(c.logprobs)) for c in rows],
                                 device=scores.mask.device)
        delta = (scores.logprobs - engine_lp) * scores.mask  # rollout/train mismatch on the sampled tokens
        parts["max_diff"].append(delta.abs().max().item())
        parts["mismatch"].append(((torch.exp(delta) - delta - 1) * scores.mask).sum().item())
        parts["kl"].append(scores.kl.detach().sum().item())
        parts["kl_full"].append(scores.kl_full.sum().item())
        parts["entropy"].append(scores.entropy.sum().item())
    result = optimizer.step()
    student.model.eval()
    sums = {k: sum(student.all_values(v)) for k, v in parts.items() if k != "max_diff"}  # of every process's
    max_diff = max(student.all_values(parts["max_diff"]), default=0.0)
    out = {"distill/kl": sums["kl"] / total_tokens, "lr": lr, "grad_norm": result.grad_norm,
           "entropy": sums["entropy"] / total_tokens, "mismatch/kl": sums["mismatch"] / total_tokens,
           "mismatch/max_abs_logprob_diff": max_diff, **step_metrics([result])}
    if cfg.distill.top_k > 0:
        out["distill/kl_full"] = sums["kl_full"] / total_tokens
    return out


@torch.no_grad()
def teacher_kl(engine: VLLMEngine, student: Policy, teacher: Policy, problems: list[Problem], cfg: RecipeConfig) -> float:
    """Held-out reverse KL(student || teacher), full vocabulary, per token, on one sample per prompt
    from the quantized student at the training temperature. The same seed at every evaluation, so
    successive values differ by the student, not by the sampling noise."""
    prompts = [student.tokenizer(p.prompt).input_ids for p in problems]
    comps = [c for c in engine.generate(prompts, seed=cfg.run.seed * 1_000_003 + EVAL_SEED_OFFSET) if c.token_ids]
    kl, tokens = 0.0, 0.0
    for rows in _micro_batches(comps, cfg.trainer.micro_batch_size):
        scores = score_pair(student.model, teacher.model, rows, student.tokenizer.pad_token_id,
                            cfg.policy.generation.temperature)
        kl += scores.kl_full.sum().item()
        tokens += scores.mask.sum().item()
    return kl / max(tokens, 1.0)


# -- the loop --------------------------------------------------------------------------------------
def distill(cfg: RecipeConfig) -> Path:
    # 1. Check everything cheap before anything expensive.
    check_distill_config(cfg)
    check_run_settings(cfg)
    rewards = WeightedRewards.from_specs(cfg.trainer.rewards, cfg.trainer.reward_error)  # [0] = the verifier
    student_format = resolve_format(cfg.policy.quant_cfg)
    check_generation_matches(student_format, resolve_format(cfg.policy.generation.quant_cfg),
                             cfg.policy.generation.allow_quant_mismatch)
    task = build_task(cfg.task, cfg.run.seed)
    student_source, source = resolve_model_dir(cfg.policy.model_name), teacher_source(cfg)
    if source != student_source:
        check_tokenizers(student_source, source, cfg.teacher.trust_remote_code or cfg.policy.trust_remote_code)
    memory = check_memory(cfg, student_source, source)
    run_dir = Path(cfg.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(to_dict(cfg)))
    t = cfg.trainer
    prompts_per_step = t.batch_size // t.num_generations
    print(f"QAD memory estimate (GiB): {', '.join(f'{k} {v:.2f}' for k, v in memory.items())}")

    # 2. The student (resumed, or built fresh: warm start, quantize, calibrate) and the frozen teacher.
    checkpoint = latest_checkpoint(run_dir) if t.resume else None
    torch.manual_seed(cfg.run.seed)
    student = resumed_policy(checkpoint, cfg, task) if checkpoint else initial_policy(cfg, task)
    student.start_noise(t.steps, cfg.run.seed)
    teacher = load_teacher(cfg, task)
    attach_rollout_view(student, cfg.policy, task.calibration_texts(cfg.policy.quant_calib_size))
    optimizer = PolicyOptimizer(student, t.lr, t.weight_decay, t.max_grad_norm)
    start_step = restore_trainer_state(checkpoint, optimizer) if checkpoint else 0
    guard = NonFiniteGuard(t.max_nonfinite_steps)
    student.model.eval()

    # 3. The engine: the teacher's own accuracy first (unquantized), then the student's format, synced.
    rollout_format = resolve_format(cfg.policy.generation.quant_cfg)
    teacher_first = start_step == 0 and cfg.distill.eval_teacher_accuracy
    engine = VLLMEngine(student.model_dir, cfg.policy.generation, cfg.policy.dtype, cfg.run.seed,
                        quant_format=None if teacher_first else rollout_format, qlora=cfg.policy.lora.mode == "qlora",
                        exact=cfg.policy.exact_forward)
    eval_problems = task.eval[: cfg.eval.num_prompts]
    first_row: dict[str, float] = {}
    if teacher_first:
        if same_architecture(teacher.model, student.model):
            engine.refit(teacher.model)
            first_row["eval/teacher_accuracy"] = evaluate(engine, teacher, eval_problems, rewards).accuracy
        else:
            print("teacher accuracy skipped: the teacher's architecture differs from the student's engine")
    engine.set_quant_format(rollout_format)  # a graph engine restarts for it (once, after the teacher)
    step_state = student.prepare_step(start_step)
    engine.refit(student.rollout_model())
    metrics = MetricsLog(run_dir / "metrics.jsonl", resume_step=start_step if checkpoint else None,
                         loggers=cfg.run.loggers, config=to_dict(cfg), project=cfg.run.wandb_project)

    def evaluation() -> dict[str, float]:
        return {"eval/accuracy": evaluate(engine, student, eval_problems, rewards).accuracy,
                "eval/teacher_kl": teacher_kl(engine, student, teacher, eval_problems, cfg)}

    # 4. The loop.
    bar = progress_bar(range(start_step, t.steps), "QAD")
    progress = ProgressFigures()
    for step in bar:
        step_start = time.perf_counter()
        row: dict[str, float | int | None] = {"step": step, **step_state, **(first_row if step == 0 else {})}
        if step % cfg.eval.every == 0:
            row.update(evaluation())

        problems = step_problems(task, step, prompts_per_step, cfg.run.seed)
        batch = rollout(engine, student, problems, t.num_generations, seed=cfg.run.seed * 1_000_003 + step * t.batch_size)
        reward_values, reward_parts = rewards(batch.texts, [p.answer for p in problems for _ in range(t.num_generations)])

        rollout_memory = device_memory_gib("rollout")
        train_start = time.perf_counter()
        engine.sleep()  # colocated on one GPU: the engine's memory is the models' during the update
        update = distill_update(student, teacher, optimizer, batch, cfg, learning_rate(cfg, step))
        memory = {**rollout_memory, **device_memory_gib("update")}
        engine.wake()
        refit_start = time.perf_counter()
        step_state = student.prepare_step(step + 1)
        refit = engine.refit(student.rollout_model())
        done = time.perf_counter()

        row.update({**update, "reward/mean": sum(reward_values) / len(reward_values), **reward_parts, **memory,
                    **rollout_and_timing_metrics(batch, step_start, train_start, refit_start, refit, done,
                                                 engine.sleep_wake_s)})
        metrics.write(row)
        bar.set_postfix_str(f"kl={update.get('distill/kl', float('nan')):.4f}, {progress.update(row)}")
        guard(update.get("train/nonfinite", 0) > 0, step)
        if (step + 1) % cfg.checkpoint.every == 0 or step + 1 == t.steps:
            save_checkpoint(run_dir, step + 1, student, trainer_state(step + 1, optimizer, prompts_per_step),
                            keep=cfg.checkpoint.keep)

    # 5. Final evaluation, plot, summary.
    metrics.write({"step": t.steps, **evaluation()})
    metrics.close()
    report_run(run_dir, DISTILL_PANELS, distill_summary)
    return run_dir


def distill_summary(rows: list[dict[str, Any]]) -> str:
    """What `summary` does not say for QAD: the teacher's accuracy and the held-out KL, first to last."""
    lines = [f"teacher held-out accuracy (unquantized, greedy): {r['eval/teacher_accuracy']:.3f}"
             for r in rows if r.get("eval/teacher_accuracy") is not None]
    kls = [r for r in rows if r.get("eval/teacher_kl") is not None]
    if kls:
        lines.append(f"held-out KL(student || teacher) per token: {kls[0]['eval/teacher_kl']:.4f} at step "
                     f"{kls[0]['step']} -> {kls[-1]['eval/teacher_kl']:.4f} at step {kls[-1]['step']}")
    return "\n".join(lines)
