"""What the exact forward costs the policy: forward + backward of one micro-batch of teacher-forced
completions (the work of a policy update), `policy.exact_forward` on against off, on a Hopper GPU.

    python benchmarks/exact_step_time.py [--format quant_configs/nvfp4_w4a4.yaml] [--repeats 5]

The embedded 0.5B model (bf16, fp32 masters), 64 completions of 64 prompt + 192 sampled tokens (random
token ids: the cost does not depend on them); medians, ratio exact / default from one process.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    import torch

    from qarl.config import PolicyConfig
    from qarl.policy import build_policy, resolve_model_dir, score_completions
    from qarl.tasks import ArithmeticTask

    parser = argparse.ArgumentParser()
    parser.add_argument("--format", default="quant_configs/nvfp4_w4a4.yaml")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    task = ArithmeticTask(num_train=400, num_eval=32, seed=0)
    model_dir = resolve_model_dir("embedded:0.5b")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 100, (64,), generator=g).tolist() for _ in range(64)]
    completions = [torch.randint(3, 100, (192,), generator=g).tolist() for _ in range(64)]
    medians = {}
    for exact in (False, True):  # the default first: the exact forward puts the process in batch-invariant mode
        cfg = PolicyConfig(model_name="embedded:0.5b", quant_cfg=args.format, dtype="bfloat16", exact_forward=exact)
        policy = build_policy(cfg, task.calibration_texts(32), model_dir=model_dir, trainable=True)
        times = []
        for i in range(args.repeats + 2):  # two warm-up passes
            torch.cuda.synchronize()
            start = time.perf_counter()
            score_completions(policy.model, prompts, completions, 0).logprobs.sum().backward()
            torch.cuda.synchronize()
            if i >= 2:
                times.append(time.perf_counter() - start)
        medians[exact] = statistics.median(times)
        print(f"exact_forward={exact}: forward + backward {medians[exact] * 1e3:.1f} ms")
        del policy
    print(f"ratio exact / default: {medians[True] / medians[False]:.2f}")


if __name__ == "__main__":
    main()
