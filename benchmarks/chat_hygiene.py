"""Raw-text prompts against the chat template, on a model warm-started with the template: what the evaluation's
hygiene (parse rate, truncation rate, stop/EOS rate, length) says of each, side by side.

    python benchmarks/chat_hygiene.py [--out benchmarks/results/chat_hygiene.md] [--warm-start-steps 300]

A GSM8K-style dataset is made locally (qarl/tasks/word_problems.py); the embedded tiny model is warm-started on it
through its chat template, as `qarl train` would; then one engine answers the held-out questions greedily, unquantized
and in NVFP4 W4A16, with the prompts formatted both ways. A model that learned to answer inside a turn, asked in raw
text, does not know where its answer ends (the failure posttrain-quant-serve's study found in its own evaluation).
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from pathlib import Path


def main() -> None:
    from qarl.config import RecipeConfig, load_recipe
    from qarl.evaluate import evaluate
    from qarl.generation import VLLMEngine
    from qarl.policy import build_policy
    from qarl.quant import resolve_format
    from qarl.rewards import WeightedRewards
    from qarl.run import initial_model_dir
    from qarl.tasks import build_task, model_prompt_format
    from qarl.tasks.word_problems import write_word_problems

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/chat_hygiene.md")
    parser.add_argument("--warm-start-steps", type=int, default=300)
    parser.add_argument("--eval-prompts", type=int, default=100)
    args = parser.parse_args()
    files = write_word_problems(Path(tempfile.mkdtemp()) / "data", num_train=2000, num_eval=args.eval_prompts)
    cfg = load_recipe("recipes/qa_grpo_tiny.yaml", [
        "task.name=dataset", f"task.train_data={files['gsm8k_train']}", f"task.eval_data={files['gsm8k_test']}",
        "task.prompt_column=question", "task.answer_column=answer", "trainer.rewards=[{name: gsm8k}]",
        f"warm_start.steps={args.warm_start_steps}", "policy.generation.max_new_tokens=48",
        "policy.generation.max_model_len=200"], RecipeConfig)
    task = build_task(cfg.task, cfg.run.seed)
    model_dir = initial_model_dir(cfg, task)  # warm-started through the template (task.chat_template=auto)
    rewards = WeightedRewards.from_specs(cfg.trainer.rewards)
    ways = {mode: model_prompt_format(model_dir, dataclasses.replace(cfg.task, chat_template=mode))
            for mode in ("off", "on")}
    engine = VLLMEngine(model_dir, cfg.policy.generation, cfg.policy.dtype, cfg.run.seed)
    lines = ["| precision | prompts | accuracy | parse rate | truncation rate | stop/EOS rate | mean length |",
             "|---|---|---|---|---|---|---|"]
    for name, spec in (("fp32", None), ("NVFP4 W4A16", "quant_configs/nvfp4_a16.yaml")):
        fmt = resolve_format(spec) if spec else None
        policy = build_policy(cfg.policy, task.calibration_texts(cfg.policy.quant_calib_size, ways["on"]),
                              model_dir=model_dir, fmt=fmt)
        engine.set_quant_format(fmt)
        engine.refit(policy.model)
        for mode, way in ways.items():
            result = evaluate(engine, way, task.eval, rewards)
            h = result.hygiene()
            lines.append(f"| {name} | {'chat template' if mode == 'on' else 'raw text'} | {result.accuracy:.2f} | "
                         f"{h['parse_rate']:.2f} | {h['truncation_rate']:.2f} | {h['stop_rate']:.2f} | "
                         f"{h['mean_length']:.1f} |")
    text = (f"# Raw-text prompts against the chat template (GSM8K-style, embedded model)\n\n"
            f"`python benchmarks/chat_hygiene.py --warm-start-steps {args.warm_start_steps} --eval-prompts "
            f"{args.eval_prompts}`: the embedded tiny model warm-started {args.warm_start_steps} steps on 2,000 "
            f"GSM8K-style problems through its chat template, then {len(task.eval)} held-out questions answered "
            f"greedily (max 48 tokens) with each prompt format.\n\n" + "\n".join(lines) + "\n")
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
