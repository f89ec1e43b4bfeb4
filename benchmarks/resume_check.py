"""Is resume after SIGKILL exact? One `qarl train` run uninterrupted; the same run killed (SIGKILL to its whole
process group) once its first checkpoint is complete, then resumed with `trainer.resume=true`; every non-timing
metric of every step compared. Writes a markdown table (--out) with the command.

    python benchmarks/resume_check.py recipes/qa_grpo_0p5b_gpu.yaml policy.backend=megatron trainer.steps=20 \
        checkpoint.every=10 --out benchmarks/results/gpu/resume_megatron_0p5b.md
    python benchmarks/resume_check.py --nproc 2 recipes/qa_grpo_0p5b_gpu.yaml policy.backend=megatron \
        policy.tensor_parallel_size=2 ...        # each run under torchrun, one process per GPU
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def train(recipe: str, run_dir: Path, overrides: list[str], kill_at: int | None = None, nproc: int = 1) -> None:
    """`qarl train` (under torchrun with `nproc` > 1); with `kill_at`, SIGKILLed (torchrun and its workers: one
    process group) as soon as checkpoint step_<kill_at> is complete."""
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc > 1 else []
    command = [sys.executable, *launcher, "-m", "qarl", "train", recipe, f"run.dir={run_dir}", *overrides]
    process = subprocess.Popen(command, start_new_session=True, stdout=subprocess.DEVNULL)
    if kill_at is None:
        if process.wait() != 0:
            raise SystemExit(f"{' '.join(command)} failed")
        return
    marker = run_dir / "checkpoints" / f"step_{kill_at}" / "COMPLETE"
    while not marker.exists():
        if process.poll() is not None:
            raise SystemExit(f"{' '.join(command)} ended before checkpoint step_{kill_at}")
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def rows(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if not k.startswith("perf/")} for line in lines]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*", help="recipe overrides; set checkpoint.every below trainer.steps")
    parser.add_argument("--runs", default="runs/resume_check", help="where the two runs go")
    parser.add_argument("--kill-at", type=int, required=True, help="the checkpoint step after which to SIGKILL")
    parser.add_argument("--out", help="write the markdown table here")
    parser.add_argument("--nproc", type=int, default=1, help="processes (GPUs) per run, started by torchrun")
    args = parser.parse_args()
    root = Path(args.runs)
    whole, killed = root / "uninterrupted", root / "killed"
    for run in (whole, killed):
        subprocess.run(["rm", "-rf", str(run)], check=True)
    train(args.recipe, whole, args.overrides, nproc=args.nproc)
    train(args.recipe, killed, args.overrides, kill_at=args.kill_at, nproc=args.nproc)
    steps_before = len(rows(killed))
    train(args.recipe, killed, [*args.overrides, "trainer.resume=true"], nproc=args.nproc)
    a, b = rows(whole), rows(killed)
    differing = [(x["step"], k, x[k], y.get(k)) for x, y in zip(a, b) for k in x
                 if x[k] != y.get(k) and not (isinstance(x[k], float) and math.isnan(x[k]) and math.isnan(y.get(k)))]
    nproc = f"--nproc {args.nproc} " if args.nproc > 1 else ""
    lines = [f"`python benchmarks/resume_check.py {nproc}{args.recipe} {' '.join(args.overrides)} --kill-at {args.kill_at}`", "",
             f"killed after checkpoint step_{args.kill_at} (metric rows written before the kill: {steps_before}), "
             f"resumed to step {a[-1]['step']}; {len(a)} vs {len(b)} metric rows",
             f"non-timing values that differ: **{len(differing)}** of {sum(len(x) for x in a)}"]
    lines += [f"- step {s}: {k} {x!r} vs {y!r}" for s, k, x, y in differing[:20]]
    accuracy = [(r["step"], r["eval/accuracy"]) for r in a if r.get("eval/accuracy") is not None]
    lines += ["", "held-out accuracy by step (uninterrupted): " + ", ".join(f"{s}: {v:.3f}" for s, v in accuracy)]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
