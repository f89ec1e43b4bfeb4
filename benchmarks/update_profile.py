"""Where a whole policy update's time goes, with CUDA graphs and without (issue 74): the host's busy time against
the GPU's, and the train phase's MFU, for one step's update at a user's shape.

    python benchmarks/update_profile.py --model runs/qwen3_1p7b_shape [--format quant_configs/nvfp4_a16.yaml]
        [--exact] [--graphs on off] [--completions 256 --prompt-tokens 100 --completion-tokens 1024]
        [--budget 9216] [--repeats 2] [--out FILE.md]

`qarl.train.policy_update` on one step's completions (random token ids, engine log-probs and advantages: the cost
does not depend on them) with the settings a training run decides on a GPU (compiled layers and scores, or the exact
forward; micro-batches of `--budget` tokens; bf16 compute, fp32 masters), each `--graphs` setting in a process of its
own (the exact forward puts its process in vLLM's batch-invariant mode for good). One warm-up update, `--repeats`
timed ones (median), then one under torch.profiler: the GPU's busy time (kernels' own time) and the host's (the
operators' own CPU time less what they spent waiting for the GPU: synchronizations and device-to-host copies), each
beside the update's wall time; with `--out`, the profiler's tables (the top operators by GPU and by host time) go
beside it, one file per `--graphs` setting. MFU: 6 x parameters x tokens / wall time / 989 TFLOP/s (H100's and
H200's dense bf16 peak). On a GPU only.
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
from user_shape import H100_BF16_DENSE_FLOPS  # noqa: E402

# host ops that wait for the GPU ("Command Buffer Full": a launch, e.g. a graph replay, blocked on a full queue)
WAITS = ("Synchronize", "cudaMemcpy", "aten::item", "aten::_local_scalar_dense", "Command Buffer Full")


def measure(args: argparse.Namespace, graphs: str) -> dict[str, float]:
    """One update's seconds (wall, GPU busy, host busy) and its MFU, in this process."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from qarl.config import RecipeConfig, TrainerConfig
    from qarl.generation import Completion
    from qarl.models.resolve import resolve_model_dir
    from qarl.optim import PolicyOptimizer
    from qarl.policy import build_policy
    from qarl.run import Rollout
    from qarl.tasks import ArithmeticTask
    from qarl.train import policy_update

    cfg = RecipeConfig()
    p = cfg.policy
    p.model_name, p.quant_cfg, p.dtype, p.master_dtype = args.model, args.format, "bfloat16", "float32"
    p.exact_forward = args.exact
    p.compile_layers = p.compile_scores = "off" if args.exact else "on"
    p.generation.max_new_tokens = args.completion_tokens
    cfg.trainer = TrainerConfig(max_tokens_per_micro_batch=args.budget, cuda_graphs=graphs,
                                batch_size=args.completions, num_generations=1)
    task = ArithmeticTask(num_train=400, num_eval=32, seed=0)
    policy = build_policy(p, task.calibration_texts(32), model_dir=resolve_model_dir(p.model_name), trainable=True)
    optimizer = PolicyOptimizer(policy, lr=1e-6, weight_decay=0.0, max_grad_norm=1.0)
    g = torch.Generator().manual_seed(0)
    vocab = policy.model.config.get_text_config().vocab_size
    completions = [Completion(torch.randint(3, vocab, (args.prompt_tokens,), generator=g).tolist(),
                              torch.randint(3, vocab, (args.completion_tokens,), generator=g).tolist(),
                              (-torch.rand(args.completion_tokens, generator=g)).tolist(), "stop")
                   for _ in range(args.completions)]
    batch = Rollout([], completions, [""] * len(completions), 0.0)
    advantages = torch.randn(len(completions), generator=g)
    update = lambda: policy_update(policy, None, optimizer, batch, advantages, cfg)  # noqa: E731
    update()  # warm-up: compiles, autotunes
    wall = statistics.median(_timed(update) for _ in range(args.repeats))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        profiled = _timed(update)
    events = prof.key_averages()
    if args.out:  # where the time goes: the operators and kernels that take the most GPU time, and the most host time
        tables = [events.table(sort_by=key, row_limit=30, max_name_column_width=70)
                  for key in ("self_device_time_total", "self_cpu_time_total")]
        args.out.with_suffix(f".graphs_{graphs}.txt").write_text("\n\n".join(tables) + "\n")
    # the kernels' own time: an operator's row repeats its kernels' time, so only the device's rows count (as the
    # profiler's own "Self CUDA time total")
    gpu = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA) / 1e6
    host_all = sum(e.self_cpu_time_total for e in events) / 1e6
    waiting = sum(e.self_cpu_time_total for e in events if any(w in e.key for w in WAITS)) / 1e6
    params = sum(t.numel() for t in policy.model.parameters())
    tokens = args.completions * (args.prompt_tokens + args.completion_tokens)
    return {"wall_s": wall, "profiled_wall_s": profiled, "gpu_busy_s": gpu, "host_busy_s": host_all - waiting,
            "host_waiting_s": waiting, "mfu": 6 * params * tokens / wall / H100_BF16_DENSE_FLOPS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--format", default="quant_configs/nvfp4_a16.yaml")
    parser.add_argument("--exact", action="store_true", help="policy.exact_forward=true")
    parser.add_argument("--graphs", nargs="+", default=["on", "off"], choices=["on", "off"])
    parser.add_argument("--completions", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--completion-tokens", type=int, default=1024)
    parser.add_argument("--budget", type=int, default=9216, help="trainer.max_tokens_per_micro_batch")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--one", choices=["on", "off"], help=argparse.SUPPRESS)  # one measuring process
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args, args.one)))
        return
    name = f"{Path(args.format).stem}{' exact' if args.exact else ''}"
    lines = [f"update of {args.completions} x ({args.prompt_tokens} + {args.completion_tokens}) tokens, {name}, "
             f"micro-batches of {args.budget} tokens",
             "| cuda_graphs | update s | GPU busy s | host busy s | host / GPU | host waiting s | MFU |",
             "|---|---|---|---|---|---|---|"]
    for graphs in args.graphs:
        command = [sys.executable, __file__, *sys.argv[1:], "--one", graphs]
        run = subprocess.run(command, capture_output=True, text=True)
        if run.returncode:
            sys.exit(f"cuda_graphs={graphs} failed:\n{run.stderr[-4000:]}")
        r = json.loads(run.stdout.strip().splitlines()[-1])
        lines.append(f"| {graphs} | {r['wall_s']:.2f} | {r['gpu_busy_s']:.2f} | {r['host_busy_s']:.2f} | "
                     f"{r['host_busy_s'] / r['gpu_busy_s']:.2f} | {r['host_waiting_s']:.2f} | {100 * r['mfu']:.1f} % |")
        print(lines[-1], flush=True)
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
