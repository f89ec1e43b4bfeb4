"""Learning curves of the SmolLM2 runs (benchmarks/smollm2_gpu.sh): held-out accuracy against step, bf16 GRPO
against QA-GRPO per format and QAD, each seed a thin line and their mean a thick one.

    python benchmarks/smollm2_curves.py DIR --out DIR/curves.png    # DIR holds NAME_sSEED.metrics.jsonl files
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from pathlib import Path

from qarl.metrics import read_metrics

LABELS = {"grpo_bf16": "GRPO (bf16)", "qa_grpo_w4a16": "QA-GRPO NVFP4 W4A16", "qa_grpo_w4a4": "QA-GRPO NVFP4 W4A4 (exact)",
          "qa_grpo_fp8": "QA-GRPO FP8", "qad_w4a4": "QAD NVFP4 W4A4",
          "qad_base_w4a4": "QAD NVFP4 W4A4 from the base (stage 1)",
          "qad_then_qa_grpo_w4a4": "QAD, then QA-GRPO NVFP4 W4A4 (stage 2, exact)",
          "qad_base_w4a16": "QAD NVFP4 W4A16 from the base (stage 1)",
          "qad_then_qa_grpo_w4a16": "QAD, then QA-GRPO NVFP4 W4A16 (stage 2)",
          "qad_grpo_then_qa_grpo_w4a4": "GRPO, QAD, then QA-GRPO NVFP4 W4A4 (stage 3, exact)",
          "qad_w4a4_methods": "QAD NVFP4 W4A4, the methods together",
          "qad_grpo_then_qa_grpo_w4a4_methods": "GRPO, QAD, then QA-GRPO W4A4, the methods together (stage 3, exact)"}


def curves(folder: Path) -> dict[str, list[list[tuple[int, float]]]]:
    """{run kind: [[(step, held-out accuracy), ...] per seed]}."""
    out: dict[str, list[list[tuple[int, float]]]] = defaultdict(list)
    for path in sorted(folder.glob("*_s[0-9]*.metrics.jsonl")):
        kind = re.sub(r"_s\d+\.metrics\.jsonl$", "", path.name)
        points = [(r["step"], r["eval/accuracy"]) for r in read_metrics(path) if r.get("eval/accuracy") is not None]
        if points:
            out[kind].append(points)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.8))
    for i, (kind, seeds) in enumerate(sorted(curves(args.folder).items())):
        color = f"C{i}"
        for points in seeds:
            ax.plot(*zip(*points), color=color, alpha=0.3, lw=0.8)
        last = max(step for points in seeds for step, _ in points)  # a seed stopped early: drawn, not averaged
        whole = [points for points in seeds if points[-1][0] == last]
        steps = sorted(set.intersection(*(set(s for s, _ in points) for points in whole)))
        means = [sum(dict(points)[s] for points in whole) / len(whole) for s in steps]
        stopped = f"; {len(seeds) - len(whole)} stopped early" if len(whole) < len(seeds) else ""
        ax.plot(steps, means, color=color, lw=2.2, marker="o" if len(steps) < 3 else None,
                label=f"{LABELS.get(kind, kind)} ({len(whole)} seed{'s' if len(whole) != 1 else ''}{stopped})")
    ax.set_xlabel("step")
    ax.set_ylabel("held-out accuracy (greedy; QA-GRPO: quantized)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(args.out)


if __name__ == "__main__":
    main()
