"""QA-GRPO: the training loop, top to bottom.

    recipe -> checks -> policy (warm start, quantize, calibrate | resume from a checkpoint)
    -> vLLM engine (refit: weights + amax) -> for each step:
         rollout (G completions per prompt) -> rewards -> group-relative advantages
         -> policy update on the fake-quantized policy (straight-through to the master weights)
         -> refit -> metrics row -> checkpoint
    -> final evaluation, plot, summary.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import OmegaConf

from qarl.checkpoint import (latest_checkpoint, load_policy_checkpoint, restore_trainer_state, save_checkpoint,
                             trainer_state)
from qarl.config import RecipeConfig, to_dict
from qarl.evaluate import evaluate
from qarl.generation import Completion, VLLMEngine, runs_eager, sleeps_between_rollouts
from qarl.generation.vllm_engine import RefitTiming
from qarl.grpo import check_trainer_config, group_advantages, grpo_loss, sequence_weights
from qarl.lora import check_lora
from qarl.metrics import MetricsLog, ProgressFigures, check_loggers, device_memory_gib, progress_bar, report_run
from qarl.optim import NonFiniteGuard, PolicyOptimizer, step_metrics
from qarl.policy import (Policy, TokenScores, attach_rollout_view, build_policy, cache_dir, check_backend,
                         check_precision, resolve_model_dir, score_completions)
from qarl.quant import check_generation_matches, resolve_format
from qarl.quant.input_quant import input_quant_plan
from qarl.quant.quantize import check_trainable_format
from qarl.rewards import WeightedRewards
from qarl.tasks import Problem, Task, build_task
from qarl.warm_start import fingerprint, warm_start


@dataclass
class Rollout:
    """One step's samples, flattened prompt-major: completion i belongs to problem i // G."""

    problems: list[Problem]
    completions: list[Completion]
    texts: list[str]
    seconds: float


def initial_model_dir(cfg: RecipeConfig, task: Task) -> str:
    """The step-0 model directory: the base model, warm-started if asked (cached, so a resumed run,
    a baseline and a distillation teacher all find the very model the policy started from)."""
    model_dir = resolve_model_dir(cfg.policy.model_name)
    if cfg.warm_start.enabled:
        model_dir = warm_start(model_dir, task.train, cfg.warm_start, _warm_start_seed(cfg), cache_dir())
    return model_dir


def _warm_start_seed(cfg: RecipeConfig) -> int:
    return cfg.run.seed if cfg.warm_start.seed is None else cfg.warm_start.seed


def initial_model_key(cfg: RecipeConfig, task: Task) -> str:
    """What identifies the step-0 model without making it: the warm start's cache key, or the base's path.
    Two recipes with one key start from one model."""
    model_dir = resolve_model_dir(cfg.policy.model_name)
    if not cfg.warm_start.enabled:
        return str(Path(model_dir).resolve())
    return fingerprint(model_dir, task.train, cfg.warm_start, _warm_start_seed(cfg))


def initial_policy(cfg: RecipeConfig, task: Task, trainable: bool = True) -> Policy:
    """The step-0 policy: the initial model, quantized and calibrated (`trainable`: with master weights).
    Deterministic, so the KL reference is this policy built again."""
    calibration = task.calibration_texts(cfg.policy.quant_calib_size)
    return build_policy(cfg.policy, calibration, model_dir=initial_model_dir(cfg, task), trainable=trainable)


def check_run_settings(cfg: RecipeConfig) -> None:
    """What every training loop checks before anything loads: precision, the backend, trainable quant formats,
    metric loggers, colocation, LoRA settings against the model's layers."""
    check_precision(cfg.policy)
    check_backend(cfg.policy)
    check_trainable_format(resolve_format(cfg.policy.quant_cfg), "policy.quant_cfg")
    check_trainable_format(resolve_format(cfg.policy.generation.quant_cfg), "policy.generation.quant_cfg")
    check_loggers(cfg.run.loggers)
    sleeps_between_rollouts(cfg.policy.generation)
    runs_eager(cfg.policy.generation, qlora=cfg.policy.lora.mode == "qlora")
    input_quant_plan(resolve_model_dir(cfg.policy.model_name), resolve_format(cfg.policy.generation.quant_cfg))
    if cfg.policy.lora.mode != "none":
        check_lora(cfg.policy, resolve_model_dir(cfg.policy.model_name))


def resumed_policy(checkpoint: Path, cfg: RecipeConfig, task: Task) -> Policy:
    """A checkpoint's policy, trainable. A LoRA adapter must sit on the very base this recipe starts from."""
    base = initial_model_dir(cfg, task) if cfg.policy.lora.mode != "none" else None
    return load_policy_checkpoint(checkpoint, cfg.policy, trainable=True, base_dir=base)


def step_problems(task: Task, step: int, count: int, seed: int) -> list[Problem]:
    """The prompts of a step: consecutive slices of per-epoch shuffles, a pure function of the step
    (so a resumed run reads exactly the prompts the uninterrupted run would have read)."""
    out = []
    for position in range(step * count, (step + 1) * count):
        epoch, index = divmod(position, len(task.train))
        order = list(range(len(task.train)))
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
        out.append(task.train[order[index]])
    return out


def rollout(engine: VLLMEngine, policy: Policy, problems: list[Problem], num_generations: int, seed: int) -> Rollout:
    start = time.perf_counter()
    prompts = [policy.tokenizer(p.prompt).input_ids for p in problems]
    completions = engine.generate(prompts, num_samples=num_generations, seed=seed)
    texts = policy.tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
    return Rollout(problems, completions, texts, time.perf_counter() - start)


def rollout_and_timing_metrics(batch: Rollout, step_start: float, train_start: float, refit_start: float,
                               refit: RefitTiming, done: float, sleep_wake_s: float) -> dict[str, float]:
    """The per-step completion statistics and timings, shared by every training loop. `perf/train_s` runs
    from the engine's sleep to its wake-up; `perf/sleep_wake_s` is the part of it those two took."""
    generated = sum(len(c.token_ids) for c in batch.completions)
    return {"completion/mean_length": generated / len(batch.completions),
            "completion/truncated_frac": sum(c.truncated for c in batch.completions) / len(batch.completions),
            "perf/rollout_tokens_per_s": generated / max(batch.seconds, 1e-9), "perf/rollout_s": batch.seconds,
            "perf/train_s": refit_start - train_start, "perf/sleep_wake_s": sleep_wake_s, "perf/refit_s": refit.total_s,
            "perf/refit_bytes": float(refit.bytes), "perf/refit_shared_bytes": float(refit.shared_bytes),
            "perf/step_s": done - step_start}


def policy_update(policy: Policy, reference: torch.nn.Module | None, optimizer: PolicyOptimizer,
                  batch: Rollout, advantages: torch.Tensor, cfg: RecipeConfig) -> dict[str, float]:
    """`num_iterations` passes of the GRPO loss over the step's completions, in micro-batches.
    A pass whose loss or gradient is not finite is skipped (`train/skipped`)."""
    t = cfg.trainer
    temperature = cfg.policy.generation.temperature
    pad = policy.tokenizer.pad_token_id
    comps = batch.completions
    keep = [i for i, c in enumerate(comps) if c.token_ids and not (t.mask_truncated_completions and c.truncated)]
    if not keep:
        return {}
    max_len = max(len(c.token_ids) for c in comps)
    total_tokens = sum(len(comps[i].token_ids) for i in keep)
    micro = [keep[s : s + t.micro_batch_size] for s in range(0, len(keep), t.micro_batch_size)]
    mine = policy.local_share(micro)  # this process's micro-batches (data parallel); each weighted for the whole step
    engine_lp, old_lp, ref_lp = {}, {}, {}
    args = {rows[0]: ([comps[i].prompt_ids for i in rows], [comps[i].token_ids for i in rows], pad, temperature)
            for rows in mine}
    for rows in mine:  # the rollout-time log-probs: the engine's, and the reference's if there is one
        width = max(len(comps[i].token_ids) for i in rows)
        engine_lp[rows[0]] = torch.tensor([c.logprobs + [0.0] * (width - len(c.logprobs)) for c in (comps[i] for i in rows)],
                                          device=policy.device)
        with torch.no_grad():
            if reference is not None:
                ref_lp[rows[0]] = score_completions(reference, *args[rows[0]]).logprobs
            if t.num_iterations > 1:  # later passes compare against the policy as it was at rollout
                old_lp[rows[0]] = score_completions(policy.model, *args[rows[0]])
    stats: dict[str, list[float]] = {k: [] for k in ("loss", "clip", "kl", "is_weight", "grad_norm", "max_diff", "k3",
                                                     "entropy", "tokens")}
    results = []
    policy.model.train()
    for _ in range(t.num_iterations):
        optimizer.zero_grad()
        for rows in mine:
            scores = score_completions(policy.model, *args[rows[0]])
            if rows[0] not in old_lp:  # one pass: the policy has not moved since rollout, old = current
                old_lp[rows[0]] = TokenScores(scores.logprobs.detach(), scores.entropy.detach(), scores.mask)
            old = old_lp[rows[0]]
            weights = sequence_weights(old.mask, t.loss_type, len(keep), max_len, total_tokens, len(micro))
            terms = grpo_loss(scores.logprobs, old.logprobs, engine_lp[rows[0]], ref_lp.get(rows[0]),
                              advantages[rows].to(policy.device), old.mask, weights, t)
            optimizer.backward(terms.loss)
            stats["loss"].append(terms.loss.item())
            stats["clip"].append(terms.clip_fraction.item())
            stats["kl"].append(terms.kl.item() if terms.kl is not None else float("nan"))
            stats["is_weight"].append(terms.is_weight_mean.item() if terms.is_weight_mean is not None else float("nan"))
        results.append(optimizer.step())
        stats["grad_norm"].append(results[-1].grad_norm)
    policy.model.eval()
    # rollout/train mismatch on the sampled tokens: engine log-probs vs the policy's at rollout time
    for rows in mine:
        old, eng = old_lp[rows[0]], engine_lp[rows[0]]
        delta = (old.logprobs - eng) * old.mask
        stats["max_diff"].append(delta.abs().max().item())
        stats["k3"].append(((torch.exp(delta) - delta - 1) * old.mask).sum().item())
        stats["entropy"].append(old.entropy.sum().item())
        stats["tokens"].append(old.mask.sum().item())
    every = {k: policy.all_values(v) for k, v in stats.items() if k != "grad_norm"}  # every process's micro-batches
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    tokens = sum(every["tokens"])
    return {"loss": sum(every["loss"]) / t.num_iterations, "clip_fraction": mean(every["clip"]),
            "kl/ref": mean(every["kl"]), "is_weight_mean": mean(every["is_weight"]),
            "grad_norm": mean(stats["grad_norm"]), "entropy": sum(every["entropy"]) / tokens,
            "mismatch/kl": sum(every["k3"]) / tokens, "mismatch/max_abs_logprob_diff": max(every["max_diff"]),
            **step_metrics(results)}


def train(cfg: RecipeConfig) -> Path:
    # 1. Check everything cheap before anything expensive.
    check_trainer_config(cfg.trainer)
    check_run_settings(cfg)
    rewards = WeightedRewards.from_specs(cfg.trainer.rewards, cfg.trainer.reward_error)
    check_generation_matches(resolve_format(cfg.policy.quant_cfg), resolve_format(cfg.policy.generation.quant_cfg),
                             cfg.policy.generation.allow_quant_mismatch)
    task = build_task(cfg.task, cfg.run.seed)
    run_dir = Path(cfg.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(to_dict(cfg)))
    t = cfg.trainer
    prompts_per_step = t.batch_size // t.num_generations

    # 2. The policy: resumed from the newest complete checkpoint, or built fresh.
    checkpoint = latest_checkpoint(run_dir) if t.resume else None
    torch.manual_seed(cfg.run.seed)
    policy = resumed_policy(checkpoint, cfg, task) if checkpoint else initial_policy(cfg, task)
    reference = None
    if t.beta > 0:  # the step-0 policy, rebuilt (deterministic) and frozen (a LoRA policy's own base)
        reference = policy.kl_reference(lambda: initial_policy(cfg, task, trainable=False).model)
    policy.start_noise(t.steps, cfg.run.seed)
    attach_rollout_view(policy, cfg.policy, task.calibration_texts(cfg.policy.quant_calib_size))
    optimizer = PolicyOptimizer(policy, t.lr, t.weight_decay, t.max_grad_norm)
    start_step = restore_trainer_state(checkpoint, optimizer) if checkpoint else 0
    guard = NonFiniteGuard(t.max_nonfinite_steps)
    policy.model.eval()

    # 3. The rollout engine, synced to the policy (weights + amax).
    engine = VLLMEngine(policy.model_dir, cfg.policy.generation, cfg.policy.dtype, cfg.run.seed,
                        quant_format=resolve_format(cfg.policy.generation.quant_cfg), qlora=cfg.policy.lora.mode == "qlora",
                        exact=cfg.policy.exact_forward)
    step_state = policy.prepare_step(start_step)
    engine.refit(policy.rollout_model())
    eval_problems = task.eval[: cfg.eval.num_prompts]
    metrics = MetricsLog(run_dir / "metrics.jsonl", resume_step=start_step if checkpoint else None,
                         loggers=cfg.run.loggers, config=to_dict(cfg), project=cfg.run.wandb_project)

    # 4. The loop.
    bar = progress_bar(range(start_step, t.steps), "QA-GRPO" if policy.format else "GRPO")
    progress = ProgressFigures()
    for step in bar:
        step_start = time.perf_counter()
        row: dict[str, float | int | None] = {"step": step, **step_state}
        if step % cfg.eval.every == 0:
            row["eval/accuracy"] = evaluate(engine, policy, eval_problems, rewards).accuracy

        problems = step_problems(task, step, prompts_per_step, cfg.run.seed)
        batch = rollout(engine, policy, problems, t.num_generations, seed=cfg.run.seed * 1_000_003 + step * t.batch_size)
        answers = [p.answer for p in problems for _ in range(t.num_generations)]
        reward_values, reward_parts = rewards(batch.texts, answers)
        reward_tensor = torch.tensor(reward_values, dtype=torch.float32)
        advantages, frac_zero_std = group_advantages(reward_tensor, t.num_generations, t.scale_rewards)

        rollout_memory = device_memory_gib("rollout")
        train_start = time.perf_counter()
        engine.sleep()  # colocated on one GPU: the engine's memory is the policy's during the update
        update = policy_update(policy, reference, optimizer, batch, advantages, cfg)
        memory = {**rollout_memory, **device_memory_gib("update")}
        engine.wake()
        refit_start = time.perf_counter()
        step_state = policy.prepare_step(step + 1)
        refit = engine.refit(policy.rollout_model())
        done = time.perf_counter()

        row.update({"reward/mean": reward_tensor.mean().item(), "reward/std": reward_tensor.std().item(),
                    "reward/frac_zero_std": frac_zero_std, **reward_parts, **update, **memory,
                    **rollout_and_timing_metrics(batch, step_start, train_start, refit_start, refit, done,
                                                 engine.sleep_wake_s)})
        metrics.write(row)
        bar.set_postfix_str(progress.update(row))
        guard(update.get("train/nonfinite", 0) > 0, step)
        if (step + 1) % cfg.checkpoint.every == 0 or step + 1 == t.steps:
            save_checkpoint(run_dir, step + 1, policy, trainer_state(step + 1, optimizer, prompts_per_step),
                            keep=cfg.checkpoint.keep)

    # 5. Final evaluation, plot, summary.
    metrics.write({"step": t.steps, "eval/accuracy": evaluate(engine, policy, eval_problems, rewards).accuracy})
    metrics.close()
    report_run(run_dir)
    return run_dir
