"""What the exact forward costs the policy: forward + backward of one micro-batch of teacher-forced
completions (the work of a policy update), `policy.exact_forward` on against off, on a Hopper GPU.

    python benchmarks/exact_step_time.py [--format quant_configs/nvfp4_w4a4.yaml] [--repeats 5]

The embedded 0.5B model (bf16, fp32 masters), 64 completions of 64 prompt + 192 sampled tokens (random
token ids: the cost does not depend on them); medians after two warm-up passes. Each mode runs in a process
of its own, as training runs it: the exact forward puts its process in vLLM's batch-invariant mode (aten
overrides, cuBLAS without split-K) for good. The ratio is exact / default from one invocation.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_step_time import _timed  # noqa: E402


def measure(exact: bool, quant_cfg: str, repeats: int) -> float:
    """Median seconds of one forward + backward in this process."""
    import torch

    from qarl.config import PolicyConfig
    from qarl.policy import build_policy, resolve_model_dir, score_completions
    from qarl.tasks import ArithmeticTask

    task = ArithmeticTask(num_train=400, num_eval=32, seed=0)
    cfg = PolicyConfig(model_name="embedded:0.5b", quant_cfg=quant_cfg, dtype="bfloat16", exact_forward=exact)
    policy = build_policy(cfg, task.calibration_texts(32), model_dir=resolve_model_dir(cfg.model_name), trainable=True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 100, (64,), generator=g).tolist() for _ in range(64)]
    completions = [torch.randint(3, 100, (192,), generator=g).tolist() for _ in range(64)]
    step = lambda: score_completions(policy.model, prompts, completions, 0).logprobs.sum().backward()  # noqa: E731
    times = [_timed(step) for _ in range(repeats + 2)][2:]
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--format", default="quant_configs/nvfp4_w4a4.yaml")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--mode", choices=["exact", "default"], help=argparse.SUPPRESS)  # one measuring process
    args = parser.parse_args()
    if args.mode:
        print(json.dumps({"seconds": measure(args.mode == "exact", args.format, args.repeats)}))
        return
    seconds = {}
    for mode in ("default", "exact"):
        run = subprocess.run([sys.executable, __file__, "--mode", mode, "--format", args.format,
                              "--repeats", str(args.repeats)], capture_output=True, text=True, check=True)
        seconds[mode] = json.loads(run.stdout.strip().splitlines()[-1])["seconds"]
        print(f"exact_forward={mode == 'exact'}: forward + backward {seconds[mode] * 1e3:.1f} ms")
    print(f"ratio exact / default: {seconds['exact'] / seconds['default']:.2f}")


if __name__ == "__main__":
    main()
