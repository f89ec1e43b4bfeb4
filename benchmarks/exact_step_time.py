"""What the exact forward costs the policy: forward + backward of one micro-batch of teacher-forced
completions (the work of a policy update), `policy.exact_forward` on against off, on a Hopper GPU.

    python benchmarks/exact_step_time.py [--format quant_configs/nvfp4_w4a4.yaml] [--repeats 5] [--profile DIR]
        [--completions 64 --prompt-tokens 64 --completion-tokens 192] [--model embedded:0.5b]

The embedded 0.5B model (bf16, fp32 masters) or `--model` (e.g. the user shape's directory from
`benchmarks/user_shape.py make`, with `--completions 8 --prompt-tokens 100 --completion-tokens 1024`: a
micro-batch of the shipped Qwen3-1.7B recipe), by default 64 completions of 64 prompt + 192 sampled tokens
(random token ids: the cost does not depend on them); `--completions 128 --prompt-tokens 20
--completion-tokens 6` is a micro-batch of the GPU QA-GRPO recipe (recipes/qa_grpo_0p5b_gpu.yaml). Medians
after two warm-up passes. Each mode runs in a process
of its own, as training runs it: the exact forward puts its process in vLLM's batch-invariant mode (aten
overrides, cuBLAS without split-K) for good. The ratio is exact / default from one invocation. The forward
and the backward are timed apart too; `--profile DIR` writes each mode's torch-profiler table of one more
pass (its wall time, then ops by GPU time and by host time) to DIR/exact_profile_MODE.txt.
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


def measure(exact: bool, model: str, quant_cfg: str, repeats: int, profile: Path | None,
            shape: tuple[int, int, int]) -> dict[str, float]:
    """Median seconds of one forward, one backward and both, in this process."""
    import torch

    from qarl.config import PolicyConfig
    from qarl.models.resolve import resolve_model_dir
    from qarl.policy import build_policy
    from qarl.scoring import score_completions
    from qarl.tasks import ArithmeticTask

    task = ArithmeticTask(num_train=400, num_eval=32, seed=0)
    cfg = PolicyConfig(model_name=model, quant_cfg=quant_cfg, dtype="bfloat16", exact_forward=exact)
    policy = build_policy(cfg, task.calibration_texts(32), model_dir=resolve_model_dir(cfg.model_name), trainable=True)
    g = torch.Generator().manual_seed(0)
    count, prompt_tokens, completion_tokens = shape
    prompts = [torch.randint(3, 100, (prompt_tokens,), generator=g).tolist() for _ in range(count)]
    completions = [torch.randint(3, 100, (completion_tokens,), generator=g).tolist() for _ in range(count)]
    forward = lambda: score_completions(policy.model, prompts, completions, 0).logprobs.sum()  # noqa: E731
    times = {"forward": [], "backward": [], "both": []}
    for _ in range(repeats + 2):
        box = []
        times["forward"].append(_timed(lambda: box.append(forward())))
        times["backward"].append(_timed(lambda: box.pop().backward()))
        times["both"].append(_timed(lambda: forward().backward()))
    if profile is not None:
        write_profile(lambda: forward().backward(), profile / f"exact_profile_{'exact' if exact else 'default'}.txt")
    return {name: statistics.median(values[2:]) for name, values in times.items()}


def write_profile(step, path: Path) -> None:
    """One more pass under torch.profiler: its wall time, ops by GPU time, ops by host time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall = _timed(step)
    ops = prof.key_averages()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"wall {wall * 1e3:.1f} ms under the profiler (GPU busy: 'Self CUDA time total' below)\n\n"
                    + ops.table(sort_by="self_device_time_total", row_limit=45, max_name_column_width=70) + "\n"
                    + ops.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70))
    torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="embedded:0.5b")
    parser.add_argument("--format", default="quant_configs/nvfp4_w4a4.yaml")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile", type=Path, help="write each mode's torch-profiler table here")
    parser.add_argument("--completions", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--completion-tokens", type=int, default=192)
    parser.add_argument("--mode", choices=["exact", "default"], help=argparse.SUPPRESS)  # one measuring process
    args = parser.parse_args()
    if args.mode:
        shape = (args.completions, args.prompt_tokens, args.completion_tokens)
        print(json.dumps(measure(args.mode == "exact", args.model, args.format, args.repeats, args.profile, shape)))
        return
    seconds = {}
    for mode in ("default", "exact"):
        extra = ["--profile", str(args.profile)] if args.profile else []
        run = subprocess.run([sys.executable, __file__, "--mode", mode, "--model", args.model, "--format", args.format,
                              "--repeats", str(args.repeats), "--completions", str(args.completions), "--prompt-tokens",
                              str(args.prompt_tokens), "--completion-tokens", str(args.completion_tokens), *extra],
                             capture_output=True, text=True)
        if run.returncode:
            sys.exit(f"exact_forward={mode == 'exact'} failed:\n{run.stderr[-4000:]}")
        seconds[mode] = json.loads(run.stdout.strip().splitlines()[-1])
        print(f"exact_forward={mode == 'exact'}: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in seconds[mode].items()))
    print("ratio exact / default: " + ", ".join(f"{k} {seconds['exact'][k] / seconds['default'][k]:.2f}"
                                                for k in seconds["exact"]))


if __name__ == "__main__":
    main()
