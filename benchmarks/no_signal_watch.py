"""The no-signal watch (qarl/learning_signal.py) applied to every recorded GRPO run: does it fire, by which rule, at
which step, on which evidence, and did the run learn? Prints the table of benchmarks/results/no_signal_watch.md.

    python benchmarks/no_signal_watch.py                          # every run under benchmarks/results
    python benchmarks/no_signal_watch.py --window 12 PATH ...     # another window, other metrics files

A run "learned" when its last held-out evaluation, at step 40 or later, closed at least a quarter of the distance
from its step-0 accuracy to 100 % (the SmolLM2 runs that learned close 42-58 %, the 0.5B and tiny runs 30-100 %, the
SmolLM2 W4A4 runs at most 13 %); a run evaluated last before step 40 (a timing run) is too short to tell. A run that
trained fewer steps than the window, or is not GRPO (QAD rows have no reward groups), is left out.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from qarl.learning_signal import NoSignalWatch, Settings, read_shrink, read_window, training_rows  # noqa: E402
from qarl.metrics import read_metrics  # noqa: E402

LEARNED = 0.25  # the share of the distance to 100 % held-out accuracy a run that learned closes
LONG_ENOUGH = 40  # the earliest last evaluation that tells whether a run learned


def held_out(rows: list[dict]) -> tuple[float, float, int]:
    """Step-0 accuracy, the last evaluation's accuracy and its step."""
    evals = [r for r in rows if r.get("eval/accuracy") is not None]
    return evals[0]["eval/accuracy"], evals[-1]["eval/accuracy"], evals[-1]["step"]


def told(rows: list[dict], window: int) -> int | None:
    """The step at which the watch, run over the whole of `rows` as `qarl train` runs it, fires."""
    watch = NoSignalWatch(window, Settings(quantized=True, num_generations=8, temperature=1.0, lr=1e-5, stop=False))
    return next((row["step"] for row in rows if watch(row["step"], dict(row))), None)


def table(paths: list[Path], window: int) -> list[str]:
    lines = ["| run | fires | cause | at step | zero-std share (window) | entropy drop | reward rise (start stds) | "
             "answers at their shortest (share of the start's) | held-out, step 0 -> last | learned |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for path in paths:
        rows = read_metrics(path)
        trained = training_rows(rows)
        if len(trained) < window:
            continue
        judged = read_window(trained[:window])
        fired = told(trained, window)
        cause = "" if fired is None else judged.cause or "collapse"
        start, last, at = held_out(rows)
        learned = "too short" if at < LONG_ENOUGH else "yes" if (last - start) / (1 - start) >= LEARNED else "**no**"
        lines.append(f"| {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path} | "
                     f"{'**yes**' if fired is not None else 'no'} | {cause} | {'' if fired is None else fired} | "
                     f"{judged.zero_std_share:.3f} | {judged.entropy_drop:+.2f} | {judged.reward_gain_sd:+.2f} | "
                     f"{shortest(trained, window)} | {start:.3f} -> {last:.3f} (step {at}) | {learned} |")
    return lines


def shortest(rows: list[dict], window: int) -> str:
    """The lowest mean answer length over any `RECENT` steps after the window, as a share of the start's (what the
    collapse rule compares with `SHRINK`); empty where the rows record no lengths."""
    readings = [read_shrink(rows[: i + 1], window) for i in range(window, len(rows))]
    shares = [r.length_now / r.length_start for r in readings if r is not None]
    return f"{min(shares):.3f}" if shares else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", type=Path, help="metrics.jsonl files (default: every one under "
                                                             "benchmarks/results)")
    parser.add_argument("--window", type=int, default=15, help="trainer.no_signal_window (default 15)")
    args = parser.parse_args()
    paths = args.paths or sorted((ROOT / "benchmarks" / "results").rglob("*.metrics.jsonl"))
    print("\n".join(table(paths, args.window)))


if __name__ == "__main__":
    main()
