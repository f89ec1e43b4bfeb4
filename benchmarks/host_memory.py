"""Host memory of a QA-GRPO run on CPU as the rollout grows: the user-vocabulary shape (a 2-layer Qwen2 with Qwen's
151,936-token vocabulary, 1,024-token completions, micro-batch 8; benchmarks/recipes/user_vocab_cpu.yaml) at 16, 32
and 64 completions a step, each in a fresh process, its peak RSS as the kernel counts it (ru_maxrss of the child,
from wait4) beside the largest `memory/host_peak_rss_gib` of its metrics rows (the same counter, read by the run).

    PYTHONPATH=. python benchmarks/user_shape.py make /tmp/qwen2_2l_151k --shape qwen2-2l-151k
    PYTHONPATH=. python benchmarks/host_memory.py --model /tmp/qwen2_2l_151k      # ~30 min on 2 cores

Prints a markdown table (benchmarks/results/host_memory.md). What should hold: the peak flat in the number of
completions (within ~0.2 GiB), since the update runs in micro-batches of fixed size and the rollout's per-token
records are a few bytes a token.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = "benchmarks/recipes/user_vocab_cpu.yaml"


def run(model: str, completions: int, steps: int, out: Path) -> dict[str, float]:
    """One `qarl train` of `completions` a step, in a fresh process: its peak RSS (GiB) and wall time."""
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "qarl", "train", RECIPE, f"policy.model_name={model}", f"run.dir={out / 'run'}",
               f"trainer.batch_size={completions}", f"trainer.steps={steps}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # the recipe's reward: benchmarks.user_shape:spread
    start = time.perf_counter()
    with (out / "train.log").open("w") as log:
        child = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(child.pid, 0)  # this child's own rusage (KiB on Linux)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(command)} failed; see {out / 'train.log'}")
    rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = [r["memory/host_peak_rss_gib"] for r in rows if r.get("memory/host_peak_rss_gib") is not None]
    return {"peak_gib": usage.ru_maxrss / 2**20, "logged_gib": max(logged) if logged else float("nan"),
            "wall_s": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="the qwen2-2l-151k directory (benchmarks/user_shape.py make)")
    parser.add_argument("--completions", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="where the runs go (default: a temporary directory)")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="host_memory_"))
    results = {}
    for n in args.completions:
        results[n] = run(args.model, n, args.steps, out / f"c{n}")
        print(f"{n} completions: {results[n]}", file=sys.stderr, flush=True)
    first = results[args.completions[0]]["peak_gib"]
    print(f"{RECIPE}, policy.model_name={args.model}, {args.steps} steps each, a fresh process each\n")
    print("| completions a step | rollout tokens a step (at most) | peak RSS (GiB) | vs the first | "
          "`memory/host_peak_rss_gib` (max) | wall (s) |")
    print("|---|---|---|---|---|---|")
    for n, r in results.items():
        print(f"| {n} | {n * 1024:,} | {r['peak_gib']:.2f} | {r['peak_gib'] - first:+.2f} | {r['logged_gib']:.2f} | "
              f"{r['wall_s']:.0f} |")


if __name__ == "__main__":
    main()
