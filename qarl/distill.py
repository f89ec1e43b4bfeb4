"""QAD: on-policy quantization-aware distillation, top to bottom.

    recipe -> checks (settings; teacher and student tokenizers match; the memory plan: teacher + student + engine fit)
    -> student: the fake-quantized policy (warm start, quantize, calibrate | resume from a checkpoint)
    -> teacher: full precision, frozen (default: the student's own starting point, unquantized)
    -> vLLM engine: the teacher's held-out accuracy once (engine unquantized), then the student's
       format and a refit (weights + amax) -> for each step:
         rollout (the quantized student samples) -> student and teacher score the same sequences
         -> per-token reverse KL(student || teacher) over the vocabulary, optionally mixed with the forward KL
            (qarl/distill_loss.py)
         -> update of the fake-quantized student (straight-through to the master weights)
         -> refit -> metrics row -> checkpoint
    -> final evaluation, plot, summary.

Evaluation (step 0 = plain post-training quantization of the teacher, every `eval.every` steps, and
at the end): `eval/accuracy`, the quantized student's greedy held-out accuracy (and `eval_transfer/accuracy` on a
task's transfer split), and `eval/teacher_kl`, the full-vocabulary reverse KL (the loss by default) on the
student's samples for held-out prompts.

What QA-GRPO and QAD share (the step-0 policy, the step's prompts, the rollout, the step skeleton,
checkpoints, metrics) lives in qarl/run.py; this file holds what distillation adds.
`qarl distill RECIPE [a.b=c ...]` (qarl/cli.py) runs it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from qarl.config import WARM_START, ConfigError, LoraConfig, RecipeConfig, check_qad_recipe
from qarl.distill_loss import divergence, reverse_kl
from qarl.evaluate import SPLIT_PREFIX, evaluate_splits, split_metrics
from qarl.generation import Completion, VLLMEngine
from qarl.lora import ADAPTER_PARAMS
from qarl.memory import FrozenModel, ModelShape
from qarl.models.checks import tokenizer_differences
from qarl.models.resolve import resolve_model_dir
from qarl.optim import PolicyOptimizer, step_metrics
from qarl.policy import build_policy, Policy
from qarl.quant import resolve_format
from qarl.run import (Rollout, Run, engine_in_format, initial_model_dir, mismatch_sums, run_steps, start_engine,
                      start_run)
from qarl.scoring import CHUNK_TOKENS, completion_logits, completion_states, in_chunks, micro_batches, token_scores
from qarl.seeds import derived_seed
from qarl.tasks import Problem, PromptFormat, Task, eval_splits
from qarl.transfer import on_host

DISTILL_PANELS = [("distill/kl", "the KL loss, training samples"), ("eval/teacher_kl", "KL to teacher, held-out"),
                  ("eval/accuracy", "held-out accuracy (quantized student)"), ("mismatch/kl", "train/rollout mismatch KL")]
EVAL_SEED_OFFSET = 2**30  # the held-out samples' seed position: apart from every rollout's


# -- checks before anything heavy ------------------------------------------------------------------
def teacher_source(cfg: RecipeConfig) -> str:
    """The teacher's model directory (or hub id) without running anything: the warm-start teacher
    shares the base model's tokenizer and shape, so the checks read the base model."""
    name = cfg.teacher.model_name
    return resolve_model_dir(cfg.policy.model_name if name == WARM_START else name)


def check_tokenizers(student_dir: str, teacher_dir: str, trust_remote_code: bool = False) -> None:
    """Distillation compares the two next-token distributions id by id: same vocabulary, same
    special tokens, same output width."""
    problems = tokenizer_differences(student_dir, teacher_dir, trust_remote_code)
    if problems:
        raise ConfigError(f"teacher.model_name ({teacher_dir}) does not share the student's tokenizer "
                          f"(policy.model_name: {student_dir}): {'; '.join(problems)}. Distillation compares the "
                          "two next-token distributions token by token; choose a teacher of the student's model family.")


# -- the teacher -----------------------------------------------------------------------------------
def load_teacher(cfg: RecipeConfig, task: Task) -> Policy:
    """The teacher as an unquantized, frozen Policy (so `evaluate` and the engine take it like the student)."""
    name = cfg.teacher.model_name
    model_dir = initial_model_dir(cfg, task) if name == WARM_START else teacher_source(cfg)
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
    """Per completion token, [batch, longest completion]: the divergence that is optimized (top-k estimate
    when top_k > 0, mixed with the forward KL when forward_weight > 0), the full-vocabulary reverse KL (no grad), the
    student's log-prob of the sampled token and its entropy (no grad), and the 0/1 mask. Padding positions are 0
    everywhere."""

    kl: torch.Tensor
    kl_full: torch.Tensor
    logprobs: torch.Tensor
    entropy: torch.Tensor
    mask: torch.Tensor


def score_pair(student: PreTrainedModel, teacher: PreTrainedModel, completions: list[Completion], pad_id: int,
               temperature: float, top_k: int = 0, chunk_tokens: int = CHUNK_TOKENS, pack: bool = False,
               forward_weight: float = 0.0) -> PairScores:
    """Both models score the same sequences (packed without padding if `pack`), `chunk_tokens` completion tokens at
    a time (qarl/scoring.py); grad flows through the student only. A student with the exact forward picks its
    log-prob of each sampled token with the engine's own kernel (`qarl_token_logprobs`), so that the mismatch
    metrics compare equal bits."""
    prompts, tokens = [c.prompt_ids for c in completions], [c.token_ids for c in completions]
    pick = getattr(student, "qarl_token_logprobs", None)
    found = teacher_found = None
    if chunk_tokens > 0:
        found = completion_states(student, prompts, tokens, pad_id, pack)
        with torch.no_grad():
            teacher_found = completion_states(teacher, prompts, tokens, pad_id, pack)
    if found is None or teacher_found is None:  # a model that gives logits only: the whole vocabulary at once
        student_logits, targets, mask = completion_logits(student, prompts, tokens, pad_id)
        with torch.no_grad():
            teacher_logits = completion_logits(teacher, prompts, tokens, pad_id)[0].to(student_logits.device)
        return PairScores(*(part * mask for part in pair_terms(student_logits, teacher_logits, targets, temperature,
                                                              top_k, pick, forward_weight)), mask=mask)

    def chunk(states: torch.Tensor, teacher_states: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with torch.no_grad():
            teacher_logits = teacher_found.head(teacher_states).to(states.device)
        return pair_terms(found.head(states), teacher_logits, targets, temperature, top_k, pick, forward_weight)

    terms = in_chunks(chunk, chunk_tokens, found.states, teacher_found.states.to(found.states.device), found.targets)
    return PairScores(*(found.scatter(part) for part in terms), mask=found.mask)


def pair_terms(student_logits: torch.Tensor, teacher_logits: torch.Tensor, targets: torch.Tensor, temperature: float,
               top_k: int, pick: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] | None = None,
               forward_weight: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per token: the divergence that is optimized, the full-vocabulary reverse KL (no grad), the student's log-prob
    of the target (`pick`: the student's own kernel for it) and its entropy (no grad)."""
    kl = divergence(student_logits, teacher_logits, temperature, top_k, forward_weight)
    with torch.no_grad():
        loss_is_full_reverse = top_k <= 0 and forward_weight <= 0
        kl_full = kl.detach() if loss_is_full_reverse else reverse_kl(student_logits, teacher_logits, temperature)
        logprobs, entropy = token_scores(student_logits.detach(), targets, temperature, pick)
    return kl, kl_full, logprobs, entropy


def learning_rate(cfg: RecipeConfig, step: int) -> float:
    """The step's learning rate: a pure function of the step, so a resumed run needs no scheduler state."""
    if cfg.distill.lr_schedule == "cosine":
        return cfg.trainer.lr * 0.5 * (1 + math.cos(math.pi * step / cfg.trainer.steps))
    return cfg.trainer.lr


def distill_update(student: Policy, teacher: Policy, optimizer: PolicyOptimizer, batch: Rollout,
                   cfg: RecipeConfig, lr: float) -> dict[str, float]:
    """One optimizer step on the masked token mean of the divergence (`distill_loss.divergence`: the reverse KL
    unless distill.forward_kl_weight mixes in the forward KL) over the step's samples.

    One pass only: the samples are the student's own, drawn by the engine that quantizes as it does, so the loss
    stays on-policy; the next step draws fresh ones from the updated student. (Bit for bit with
    `policy.exact_forward`; otherwise an activation format's rounding differences drift, `mismatch/*`.)
    """
    t = cfg.trainer
    comps = [c for c in batch.completions if c.token_ids]
    if not comps:
        return {}
    total_tokens = sum(len(c.token_ids) for c in comps)
    stats: list[list[torch.Tensor]] = []  # per micro-batch, read to the host once at the end
    student.model.train()
    optimizer.zero_grad()
    for group in optimizer.param_groups:
        group["lr"] = lr
    # this process's micro-batches (data parallel), each weighted for the whole step
    every = micro_batches(comps, list(range(len(comps))), t.micro_batch_size, t.token_budget)
    for mb in student.local_share(every):
        scores = score_pair(student.model, teacher.model, mb.completions, student.tokenizer.pad_token_id,
                            cfg.policy.generation.temperature, cfg.distill.top_k, cfg.policy.logprob_chunk_tokens,
                            pack=t.token_budget > 0, forward_weight=cfg.distill.forward_kl_weight)
        optimizer.backward(scores.kl.sum() / total_tokens)
        engine_lp = mb.engine_logprobs(scores.mask.device)
        stats.append([*mismatch_sums(scores.logprobs, engine_lp, scores.mask), scores.kl.sum(),
                      scores.kl_full.sum(), scores.entropy.sum()])
    result = optimizer.step()
    parts = on_host(("max_diff", "mismatch", "kl", "kl_full", "entropy"), stats)
    student.model.eval()
    sums = {k: sum(student.all_values(v)) for k, v in parts.items() if k != "max_diff"}  # of every process's
    max_diff = max(student.all_values(parts["max_diff"]), default=0.0)
    out = {"distill/kl": sums["kl"] / total_tokens, "lr": lr, "grad_norm": result.grad_norm,
           "entropy": sums["entropy"] / total_tokens, "mismatch/kl": sums["mismatch"] / total_tokens,
           "mismatch/max_abs_logprob_diff": max_diff,
           "train/policy_tokens": float(sum(len(c.prompt_ids) + len(c.token_ids) for c in comps)),
           **step_metrics([result])}
    if cfg.distill.top_k > 0 or cfg.distill.forward_kl_weight > 0:  # what is optimized is not the full reverse KL
        out["distill/kl_full"] = sums["kl_full"] / total_tokens
    return out


@torch.no_grad()
def teacher_kl(engine: VLLMEngine, prompts: PromptFormat, student: Policy, teacher: Policy, problems: list[Problem],
               cfg: RecipeConfig) -> float:
    """Held-out reverse KL(student || teacher), full vocabulary, per token, on one sample per prompt
    from the quantized student at the training temperature. The same seed at every evaluation, so
    successive values differ by the student, not by the sampling noise."""
    comps = [c for c in engine.generate(prompts.batch([p.prompt for p in problems]), stop_token_ids=prompts.stop_ids,
                                        seed=derived_seed(cfg.run.seed, EVAL_SEED_OFFSET)) if c.token_ids]
    kl, tokens = 0.0, 0.0
    for mb in micro_batches(comps, list(range(len(comps))), cfg.trainer.micro_batch_size):
        scores = score_pair(student.model, teacher.model, mb.completions, student.tokenizer.pad_token_id,
                            cfg.policy.generation.temperature, chunk_tokens=cfg.policy.logprob_chunk_tokens)
        kl += scores.kl_full.sum().item()
        tokens += scores.mask.sum().item()
    return kl / max(tokens, 1.0)


# -- the loop --------------------------------------------------------------------------------------
def distill(cfg: RecipeConfig) -> Path:
    check_qad_recipe(cfg)
    run = start_run(cfg, frozen=lambda cfg, student, task: load_teacher(cfg, task), checks=check_teacher,
                    frozen_model=teacher_memory, distilling=True)
    # The engine: the teacher's own accuracy first (unquantized), then the student's format.
    rollout_format = resolve_format(cfg.policy.generation.quant_cfg)
    teacher_first = run.start_step == 0 and cfg.distill.eval_teacher_accuracy and cfg.eval.every > 0
    engine = start_engine(run, None if teacher_first else rollout_format)
    first_row: dict[str, float] = {}
    if teacher_first:
        teacher = run.frozen
        if same_architecture(teacher.model, run.policy.model):
            engine.refit(teacher.model)
            splits = eval_splits(run.task, cfg.eval.num_prompts, cfg.eval.num_transfer_prompts)
            first_row.update({f"{SPLIT_PREFIX[name]}/teacher_accuracy": result.accuracy
                              for name, result in evaluate_splits(engine, run.prompts, splits, run.rewards,
                                                                 "evaluating the teacher").items()})
        else:
            print("teacher accuracy skipped: the teacher's architecture differs from the student's engine")
    engine = engine_in_format(run, engine, rollout_format)  # a graph engine restarts for it (once, after the teacher)
    return run_steps(run, engine, QADSteps(run, engine), first_row)


def check_teacher(cfg: RecipeConfig) -> None:
    """Before anything loads: the teacher shares the student's tokenizer (whether teacher + student + engine fit is
    the memory plan's question: `teacher_memory`)."""
    student_source, source = resolve_model_dir(cfg.policy.model_name), teacher_source(cfg)
    if source != student_source:
        check_tokenizers(student_source, source, cfg.teacher.trust_remote_code or cfg.policy.trust_remote_code)


def teacher_memory(cfg: RecipeConfig, student: ModelShape) -> FrozenModel:
    """The teacher in the memory plan: its weights in teacher.dtype, its logits chunked beside the student's."""
    return FrozenModel("teacher", ModelShape.of(teacher_source(cfg), cfg.teacher.trust_remote_code), cfg.teacher.dtype)


class QADSteps:
    """QAD's part of a step: held-out accuracy and KL to the teacher, rewards as metrics, the distillation update."""

    label, panels = "QAD", DISTILL_PANELS

    def __init__(self, run: Run, engine: VLLMEngine):
        self.run, self.engine = run, engine
        self.eval_splits = eval_splits(run.task, run.cfg.eval.num_prompts, run.cfg.eval.num_transfer_prompts)
        self.summary = distill_summary

    def evaluate(self) -> dict[str, float]:
        student, teacher = self.run.policy, self.run.frozen
        return {**split_metrics(evaluate_splits(self.engine, self.run.prompts, self.eval_splits, self.run.rewards)),
                "eval/teacher_kl": teacher_kl(self.engine, self.run.prompts, student, teacher,
                                              self.eval_splits["test"], self.run.cfg)}

    def judge(self, step: int, batch: Rollout) -> dict[str, float]:
        values, parts = self.run.rewards(batch.texts, batch.answers)  # rewards[0] is the verifier
        return {"reward/mean": sum(values) / len(values), **parts}

    def update(self, step: int, batch: Rollout) -> dict[str, float]:
        run = self.run
        return distill_update(run.policy, run.frozen, run.optimizer, batch, run.cfg, learning_rate(run.cfg, step))

    def watch(self, step: int, row: dict[str, Any]) -> None:
        """Nothing: QAD learns from the teacher's distribution at every token, never short of a signal."""
        return None


def distill_summary(rows: list[dict[str, Any]]) -> str:
    """What `summary` does not say for QAD: the teacher's accuracy and the held-out KL, first to last."""
    lines = [f"teacher held-out accuracy (unquantized, greedy): {r['eval/teacher_accuracy']:.3f}"
             for r in rows if r.get("eval/teacher_accuracy") is not None]
    kls = [r for r in rows if r.get("eval/teacher_kl") is not None]
    if kls:
        lines.append(f"held-out KL(student || teacher) per token: {kls[0]['eval/teacher_kl']:.4f} at step "
                     f"{kls[0]['step']} -> {kls[-1]['eval/teacher_kl']:.4f} at step {kls[-1]['step']}")
    return "\n".join(lines)
