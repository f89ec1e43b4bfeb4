"""Where a rollout spends its time on a GPU: qarl's engine, with and without what qarl asks of vLLM.

    python benchmarks/gpu_profile_rollout.py [--batch 512] [--tokens 256] [--model embedded:0.5b] [--format none]

The engine of `benchmarks/gpu_rollout.py` (refitted from a policy in `--format`, CUDA graphs) samples
`--batch` completions of `--tokens` tokens, EOS ignored, through qarl's `generate` and through vLLM's own
`generate` with each combination of per-token log-probs and per-sample seeds. For each: tokens/s, the
GPU's busy time (torch profiler, CUDA kernels) against the wall time, and the host's Python functions
by own time (cProfile) in a separate run of the same call.
"""

from __future__ import annotations

import argparse
import time

import torch

from gpu_profile_update import host_functions
from gpu_rollout import qarl_engine


def busy_ms(run) -> float:
    """Milliseconds of GPU kernel time in one call of `run`."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="embedded:0.5b")
    parser.add_argument("--format", default="none")
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--top", type=int, default=22)
    args = parser.parse_args()

    from qarl.models.resolve import resolve_model_dir

    runners = qarl_engine(args.format, resolve_model_dir(args.model), "bfloat16", args.tokens, eager=False,
                          request_options=args.format == "none")
    for name, generate in runners.items():
        generate(args.batch)  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        generate(args.batch)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
        busy = busy_ms(lambda: generate(args.batch))
        functions = host_functions(lambda: generate(args.batch), args.top)
        print(f"== {name}: batch {args.batch}, {args.batch * args.tokens / wall:.0f} tok/s, wall {wall * 1e3:.0f} ms, "
              f"GPU busy {busy:.0f} ms ({busy / args.tokens:.2f} ms per step)")
        print(functions)


if __name__ == "__main__":
    main()
