"""Where a rollout spends its time on a GPU: qarl's engine, with and without what qarl asks of vLLM.

    python benchmarks/gpu_profile_rollout.py [--batch 512] [--tokens 256] [--model embedded:0.5b] [--format none]
        [--exact] [--kernels 15] [--memory 0.4]

The engine of `benchmarks/gpu_rollout.py` (refitted from a policy in `--format`, CUDA graphs; `--exact`: the exact
forward's engine) samples `--batch` completions of `--tokens` tokens, EOS ignored, through qarl's `generate` and,
unquantized, through vLLM's own `generate` with each combination of per-token log-probs and per-sample seeds. For
each: tokens/s, the GPU's busy time (torch profiler, CUDA kernels) against the wall time, the `--kernels` kernels
with the most GPU time, and the host's Python functions by own time (cProfile) in a separate run of the same call.
"""

from __future__ import annotations

import argparse
import time

import torch

from gpu_profile_update import host_functions
from gpu_rollout import qarl_engine


def busy_ms(run, kernels: int) -> tuple[float, str]:
    """Milliseconds of GPU kernel time in one call of `run`, and the table of its `kernels` kernels with the most."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    events = prof.key_averages()
    table = events.table(sort_by="self_cuda_time_total", row_limit=kernels, max_name_column_width=70) if kernels else ""
    return sum(e.self_device_time_total for e in events) / 1e3, table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="embedded:0.5b")
    parser.add_argument("--format", default="none")
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--top", type=int, default=22, help="host functions shown")
    parser.add_argument("--kernels", type=int, default=15, help="GPU kernels shown (0: none)")
    parser.add_argument("--exact", action="store_true", help="the exact forward's engine (vLLM's batch-invariant mode)")
    parser.add_argument("--memory", type=float, default=0.4, help="the engine's share of the GPU")
    args = parser.parse_args()

    from qarl.models.resolve import resolve_model_dir

    runners = qarl_engine(args.format, resolve_model_dir(args.model), "bfloat16", args.tokens, eager=False,
                          memory=args.memory, request_options=args.format == "none" and not args.exact,
                          exact=args.exact)
    for name, generate in runners.items():
        generate(args.batch)  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        generate(args.batch)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
        busy, kernels = busy_ms(lambda: generate(args.batch), args.kernels)
        functions = host_functions(lambda: generate(args.batch), args.top)
        print(f"== {name}: batch {args.batch}, {args.batch * args.tokens / wall:.0f} tok/s, wall {wall * 1e3:.0f} ms, "
              f"GPU busy {busy:.0f} ms ({busy / args.tokens:.2f} ms per step)")
        print(kernels)
        print(functions)


if __name__ == "__main__":
    main()
