"""QA-GRPO vs unquantized GRPO step time, in one process, on the embedded default.

    python benchmarks/step_time.py [recipe overrides...]

Both policies start from the same warm-started model; one vLLM engine serves both (its quantizers
are switched between steps, outside the timed region). Steps alternate quantized / unquantized so
machine noise hits both alike. Prints the median step time of each, their ratio, and the share of
rollout, training and refit in each step.
"""

from __future__ import annotations

import sys
import time

import torch


def main(overrides: list[str]) -> None:
    from qarl.config import RecipeConfig, load_recipe
    from qarl.generation import VLLMEngine
    from qarl.grpo import group_advantages
    from qarl.optim import PolicyOptimizer
    from qarl.policy import build_policy
    from qarl.rewards import WeightedRewards
    from qarl.tasks import build_task, recipe_prompt_format
    from qarl.run import initial_policy, rollout, step_problems
    from qarl.train import policy_update

    cfg = load_recipe("recipes/qa_grpo_tiny.yaml", ["trainer.steps=12", *overrides], RecipeConfig)
    t = cfg.trainer
    task = build_task(cfg.task, cfg.run.seed)
    rewards = WeightedRewards.from_specs(t.rewards)
    quantized = initial_policy(cfg, task)
    prompts = recipe_prompt_format(cfg)
    plain = build_policy(cfg.policy, [], model_dir=quantized.model_dir, fmt=None)
    engine = VLLMEngine(quantized.model_dir, cfg.policy.generation, cfg.policy.dtype, cfg.run.seed)
    runs = {"QA-GRPO": quantized, "GRPO (unquantized)": plain}
    optimizers = {name: PolicyOptimizer(p, t.lr, t.weight_decay, t.max_grad_norm) for name, p in runs.items()}
    parts: dict[str, list[tuple[float, float, float]]] = {name: [] for name in runs}
    for step in range(t.steps):
        for name, policy in runs.items():
            engine.set_quant_format(policy.format)
            engine.refit(policy.model)
            problems = step_problems(task, step, t.batch_size // t.num_generations, cfg.run.seed)
            start = time.perf_counter()
            batch = rollout(engine, prompts, problems, t.num_generations, seed=step)
            values, _ = rewards(batch.texts, [p.answer for p in problems for _ in range(t.num_generations)])
            advantages, _ = group_advantages(torch.tensor(values), t.num_generations, t.scale_rewards)
            trained = time.perf_counter()
            policy_update(policy, None, optimizers[name], batch, advantages, cfg)
            refit_start = time.perf_counter()
            engine.refit(policy.model)
            done = time.perf_counter()
            if step >= 2:  # the first steps warm up allocators and vLLM's caches
                parts[name].append((trained - start, refit_start - trained, done - refit_start))
    medians = {}
    print("| run | step (median) | rollout | train | refit |")
    print("|---|---|---|---|---|")
    for name, rows in parts.items():
        totals = sorted(sum(r) for r in rows)
        medians[name] = totals[len(totals) // 2]
        share = [sum(r[i] for r in rows) / sum(map(sum, rows)) for i in range(3)]
        print(f"| {name} | {medians[name] * 1e3:.0f} ms | {share[0]:.0%} | {share[1]:.0%} | {share[2]:.0%} |")
    ratio = medians["QA-GRPO"] / medians["GRPO (unquantized)"]
    print(f"\nstep-time ratio QA-GRPO / GRPO: {ratio:.3f} (goal <= 1.10); torch threads: {torch.get_num_threads()}")


if __name__ == "__main__":
    main(sys.argv[1:])
