"""Compare training runs: one plot with every run's curves, and a table of held-out accuracy.

    python benchmarks/compare_runs.py runs/qa_grpo_tiny runs/grpo_tiny_bf16 --out benchmarks/results/qa_grpo_vs_bf16.png

A run is a run directory (its metrics.jsonl) or a metrics file; `--panels` picks the metrics plotted.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from qarl.metrics import PLOTTED, plot_runs, read_metrics


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("runs", nargs="+", help="run directories (each with metrics.jsonl) or metrics files")
    parser.add_argument("--out", default="comparison.png")
    parser.add_argument("--panels", nargs="+", default=[key for key, _ in PLOTTED], help="metric keys to plot")
    args = parser.parse_args()
    runs = {}
    for run in map(Path, args.runs):
        runs[run.name.removesuffix(".metrics.jsonl")] = read_metrics(run if run.is_file() else run / "metrics.jsonl")
    titles = dict(PLOTTED)
    plot_runs(runs, Path(args.out), [(key, titles.get(key, key)) for key in args.panels])
    steps = sorted({r["step"] for rows in runs.values() for r in rows if r.get("eval/accuracy") is not None})
    print("| step | " + " | ".join(runs) + " |")
    print("|---|" + "---|" * len(runs))
    for step in steps:
        cells = []
        for rows in runs.values():
            value = next((r["eval/accuracy"] for r in rows if r["step"] == step and r.get("eval/accuracy") is not None), None)
            cells.append("" if value is None else f"{value:.3f}")
        print(f"| {step} | " + " | ".join(cells) + " |")
    for name, rows in runs.items():
        trained = [r for r in rows if r.get("mismatch/kl") is not None]
        if trained:
            print(f"{name}: mean mismatch/kl {sum(r['mismatch/kl'] for r in trained) / len(trained):.2e}, "
                  f"max |Δlogprob| {max(r['mismatch/max_abs_logprob_diff'] for r in trained):.2e}, "
                  f"median step {sorted(r['perf/step_s'] for r in trained)[len(trained) // 2]:.2f} s")
    print(f"plot: {args.out}")


if __name__ == "__main__":
    main()
