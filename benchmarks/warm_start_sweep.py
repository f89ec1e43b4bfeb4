"""How long a warm start gives a model a real but low success rate (what RL needs to start from).

    python benchmarks/warm_start_sweep.py RECIPE [--steps 20 40 80 160] [a.b=c ...]

For each step count, runs the recipe's warm start (cached like a training run's, so the chosen one is
reused by `qarl train RECIPE warm_start.steps=N`) and reports its greedy held-out accuracy, computed
exactly without sampling: greedy decoding reproduces the answer iff, fed the answer, the model's argmax
at every position is the next answer token and then the end of the answer
(EOS, or the chat template's end of turn). The last line prints the smallest
step count whose accuracy is at least --target (default 0.15), the setting to train from.
"""

from __future__ import annotations

import argparse

import torch


@torch.no_grad()
def greedy_exact_match(model_dir: str, problems: list, chat, device: torch.device) -> float:
    """`chat`: the recipe's task settings (how prompts are formatted and answers end)."""
    from transformers import AutoModelForCausalLM

    from qarl.scoring import completion_logits
    from qarl.tasks import model_prompt_format

    formatting = model_prompt_format(model_dir, chat)
    tokenizer = formatting.tokenizer
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    hits = 0
    for start in range(0, len(problems), 100):
        rows = problems[start : start + 100]
        prompts = formatting.batch([p.prompt for p in rows])
        answers = [formatting.answer_ids(p.answer) for p in rows]
        logits, targets, mask = completion_logits(model, prompts, answers, tokenizer.pad_token_id)
        hits += int(((logits.argmax(-1) == targets) | (mask == 0)).all(dim=1).sum())
    return hits / len(problems)


def main() -> None:
    from qarl.config import RecipeConfig, load_recipe
    from qarl.models.resolve import cache_dir, default_device, resolve_model_dir
    from qarl.tasks import build_task
    from qarl.warm_start import warm_start

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--steps", type=int, nargs="+", default=[20, 40, 80, 160])
    parser.add_argument("--target", type=float, default=0.15)
    args = parser.parse_args()
    cfg = load_recipe(args.recipe, args.overrides, RecipeConfig)
    task = build_task(cfg.task, cfg.run.seed)
    base = resolve_model_dir(cfg.policy.model_name)
    chosen = None
    print("| warm_start.steps | held-out greedy accuracy |\n|---|---|")
    for steps in sorted(args.steps):
        settings = type(cfg.warm_start)(**{**vars(cfg.warm_start), "steps": steps})
        model_dir = warm_start(base, task.train, settings, cfg.run.seed, cache_dir(), cfg.task)
        accuracy = greedy_exact_match(model_dir, task.eval[: cfg.eval.num_prompts], cfg.task, default_device())
        print(f"| {steps} | {accuracy:.3f} |", flush=True)
        if chosen is None and accuracy >= args.target:
            chosen = steps
    print(f"chosen warm_start.steps={chosen or max(args.steps)}")


if __name__ == "__main__":
    main()
