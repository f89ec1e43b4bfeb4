"""Why bf16 compute is a bf16 copy of the model (plus fp32 master weights) and not fp32 weights under
autocast: which policy forward reproduces what a bf16 vLLM engine samples.

    python benchmarks/mixed_precision_choice.py [--model embedded:tiny] [--format nvfp4_a16]

The engine runs in bf16 and is refitted from each policy (its folded weights, which both policies
derive from the same fp32 masters); the engine samples 16 held-out prompts x 32 tokens at temperature 1;
each policy recomputes the log-probs of the sampled tokens. Reports mean / max |Δ log-prob| against the
engine, and the policy forward's time for those samples.
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch


def main() -> None:
    from qarl.config import GenerationConfig, PolicyConfig
    from qarl.generation import VLLMEngine
    from qarl.models.resolve import resolve_model_dir
    from qarl.policy import build_policy
    from qarl.scoring import score_completions
    from qarl.tasks import ArithmeticTask

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="embedded:tiny")
    parser.add_argument("--format", default="nvfp4_a16")
    args = parser.parse_args()
    model_dir = resolve_model_dir(args.model)
    task = ArithmeticTask(num_train=64, num_eval=16, seed=0)
    texts = task.calibration_texts(32)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    policies = {
        "bf16 copy + fp32 masters (qarl)": (build_policy(PolicyConfig(dtype="bfloat16", quant_cfg=args.format), texts,
                                                         model_dir=model_dir, trainable=True), contextlib.nullcontext),
        "fp32 weights + bf16 autocast": (build_policy(PolicyConfig(dtype="float32", quant_cfg=args.format), texts,
                                                      model_dir=model_dir),
                                         lambda: torch.autocast(device, dtype=torch.bfloat16)),
    }
    engine = VLLMEngine(model_dir, GenerationConfig(max_new_tokens=32), dtype="bfloat16", seed=0,
                        quant_format=next(iter(policies.values()))[0].format)
    prompts = [policies["fp32 weights + bf16 autocast"][0].tokenizer(p.prompt).input_ids for p in task.eval]
    print("| policy forward | mean |Δ log-prob| vs bf16 engine | max | forward time |\n|---|---|---|---|---|")
    for name, (policy, context) in policies.items():
        engine.refit(policy.model)  # autocast's matmuls see bf16(folded fp32) weights: the engine gets those
        comps = [c for c in engine.generate(prompts, max_new_tokens=32, temperature=1.0, seed=0) if c.token_ids]
        with torch.no_grad(), context():
            start = time.perf_counter()
            scores = score_completions(policy.model, [c.prompt_ids for c in comps], [c.token_ids for c in comps],
                                       policy.tokenizer.pad_token_id)
            seconds = time.perf_counter() - start
        diffs = torch.cat([(scores.logprobs[i, : len(c.token_ids)].float().cpu() - torch.tensor(c.logprobs)).abs()
                           for i, c in enumerate(comps)])
        print(f"| {name} | {diffs.mean():.2e} | {diffs.max():.2e} | {seconds * 1e3:.0f} ms |")


if __name__ == "__main__":
    main()
