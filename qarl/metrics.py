"""Run metrics: one JSON object per step in RUN_DIR/metrics.jsonl, a plot, and a one-screen summary."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


class MetricsLog:
    """Appends rows to metrics.jsonl. On resume from step N, rows of step >= N (written after the
    checkpoint by the run that stopped) are dropped first, so the file reads as one clean run."""

    def __init__(self, path: Path, resume_step: int | None):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        kept = [r for r in read_metrics(path) if resume_step is not None and r["step"] < resume_step]
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        tmp.replace(path)

    def write(self, row: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        with self.path.open("a") as f:
            f.write(json.dumps(clean) + "\n")
            f.flush()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Rows of a metrics.jsonl; a torn last line (a crash mid-write) is skipped."""
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


PLOTTED = [("reward/mean", "reward"), ("eval/accuracy", "held-out accuracy (quantized, greedy)"),
           ("kl/ref", "KL to reference"), ("mismatch/kl", "train/rollout mismatch KL")]


def plot_runs(runs: dict[str, list[dict[str, Any]]], out: Path,
              panels: list[tuple[str, str]] = PLOTTED) -> Path:
    """One panel per (key, title) in `panels`, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4))
    for ax, (key, title) in zip(axes, panels):
        for label, rows in runs.items():
            points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
            if points:
                ax.plot(*zip(*points), marker="o" if key.startswith("eval") else None, ms=3, label=label)
        if not ax.lines:
            ax.text(0.5, 0.5, "not computed\n(trainer.beta = 0)" if key == "kl/ref" else "no data",
                    ha="center", va="center", transform=ax.transAxes, color="gray")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def summary(rows: list[dict[str, Any]]) -> str:
    """A few lines: accuracy first to last, final reward, mismatch, speed."""
    evals = [r for r in rows if r.get("eval/accuracy") is not None]
    steps = [r for r in rows if r.get("reward/mean") is not None]
    lines = []
    if evals:
        lines.append(f"held-out accuracy (quantized policy, greedy): {evals[0]['eval/accuracy']:.3f} at step "
                     f"{evals[0]['step']} -> {evals[-1]['eval/accuracy']:.3f} at step {evals[-1]['step']}")
    if steps:
        last = steps[-10:]
        mean = lambda k: sum(r[k] for r in last if r.get(k) is not None) / max(1, sum(r.get(k) is not None for r in last))  # noqa: E731
        lines.append(f"reward (last {len(last)} steps): {mean('reward/mean'):.3f}")
        lines.append(f"train/rollout mismatch KL: {mean('mismatch/kl'):.2e}, max |Δlogprob| "
                     f"{max(r['mismatch/max_abs_logprob_diff'] for r in steps):.2e}")
        lines.append(f"step time {mean('perf/step_s'):.2f} s, rollout {mean('perf/rollout_tokens_per_s'):.0f} tokens/s")
    return "\n".join(lines)
