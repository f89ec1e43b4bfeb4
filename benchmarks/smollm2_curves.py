"""Learning curves of the SmolLM2 runs (benchmarks/smollm2_gpu.sh): held-out accuracy against step, bf16 GRPO
against QA-GRPO per format and QAD, each seed a thin line and their mean a thick one; and on stdout the table of
where each kind ends, on the test and the transfer split, with the share of GRPO's gain it keeps (from the runs' own
evaluations: the rows a session with no `qarl matrix` has).

    python benchmarks/smollm2_curves.py DIR --out DIR/curves.png > DIR/table.md  # DIR: NAME_sSEED.metrics.jsonl

Gain kept: (kind's mean - base) / (GRPO's mean - base), base the unquantized model (GRPO's step 0), GRPO the folder's
grpo_bf16 runs of the kind's seeds (its teachers or starts; all of them where some seed has none; "-" in a folder
without them). A seed stopped before its kind's last evaluation is drawn and listed, not averaged.
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from pathlib import Path
from statistics import fmean as mean

from qarl.metrics import read_metrics

LABELS = {"grpo_bf16": "GRPO (bf16)", "qa_grpo_w4a16": "QA-GRPO NVFP4 W4A16", "qa_grpo_w4a4": "QA-GRPO NVFP4 W4A4 (exact)",
          "qa_grpo_fp8": "QA-GRPO FP8", "qad_w4a4": "QAD NVFP4 W4A4",
          "qad_w4a4_down_bf16": "QAD NVFP4 W4A4, down_proj unquantized",
          "qad_base_w4a4": "QAD NVFP4 W4A4 from the base (stage 1)",
          "qad_then_qa_grpo_w4a4": "QAD, then QA-GRPO NVFP4 W4A4 (stage 2, exact)",
          "qad_base_w4a16": "QAD NVFP4 W4A16 from the base (stage 1)",
          "qad_then_qa_grpo_w4a16": "QAD, then QA-GRPO NVFP4 W4A16 (stage 2)",
          "qad_grpo_then_qa_grpo_w4a4": "GRPO, QAD, then QA-GRPO NVFP4 W4A4 (stage 3, exact)",
          "qad_w4a4_methods": "QAD NVFP4 W4A4, the methods together",
          "qad_grpo_then_qa_grpo_w4a4_methods": "GRPO, QAD, then QA-GRPO W4A4, the methods together (stage 3, exact)"}


def label(kind: str) -> str:
    """A kind's legend; a variant KIND+TAG (its own overrides, benchmarks/smollm2_gpu.sh) is its kind's, tagged."""
    base, _, tag = kind.partition("+")
    return LABELS.get(base, base) + (f" +{tag}" if tag else "")


def evaluations(folder: Path) -> dict[str, dict[int, list[dict]]]:
    """{run kind: {seed: its evaluation rows}}."""
    out: dict[str, dict[int, list[dict]]] = defaultdict(dict)
    for path in sorted(folder.glob("*_s[0-9]*.metrics.jsonl")):
        kind, seed = re.fullmatch(r"(.+)_s(\d+)\.metrics\.jsonl", path.name).groups()
        rows = [r for r in read_metrics(path) if r.get("eval/accuracy") is not None]
        if rows:
            out[kind][int(seed)] = rows
    return out


def whole(seeds: dict[int, list[dict]]) -> dict[int, list[dict]]:
    """The seeds that reached their kind's last evaluation."""
    last = max(rows[-1]["step"] for rows in seeds.values())
    return {seed: rows for seed, rows in seeds.items() if rows[-1]["step"] == last}


def gain_kept(finals: list[float], grpo: list[list[dict]], key: str) -> str:
    """(mean - base) / (GRPO's mean - base), base GRPO's step-0 evaluation (the unquantized model); "-" where the
    GRPO runs lack one."""
    if not grpo or not all(rows[0]["step"] == 0 and key in rows[0] and key in rows[-1] for rows in grpo):
        return "-"
    base, top = mean([rows[0][key] for rows in grpo]), mean([rows[-1][key] for rows in grpo])
    return f"{(mean(finals) - base) / (top - base):.0%}" if top != base else "-"


def table(runs: dict[str, dict[int, list[dict]]]) -> str:
    """Markdown: each kind's last evaluation, test and transfer, mean and per seed, and the gain it keeps against
    the GRPO runs of its own seeds (its teachers or starts) where the folder has them all, else all of them."""
    splits = [("test", "eval/accuracy"), ("transfer", "eval_transfer/accuracy")]
    grpo = whole(runs["grpo_bf16"]) if "grpo_bf16" in runs else {}
    lines = ["| run | seeds | " + " | ".join(f"{name}: mean (seeds) | gain kept" for name, _ in splits)
             + " | answers cut at the limit (test) |", "|---|---|" + "---|---|" * len(splits) + "---|"]
    for kind, seeds in sorted(runs.items()):
        ended, cells = whole(seeds), []
        reference = [grpo[seed] for seed in ended] if set(ended) <= set(grpo) else list(grpo.values())
        for _, key in splits:
            finals = [rows[-1].get(key) for rows in ended.values()]
            if None in finals:
                cells += ["-", "-"]
                continue
            per_seed = ", ".join(f"{v:.1%}" for v in finals)
            cells += [f"{mean(finals):.1%} ({per_seed})", gain_kept(finals, reference, key)]
        cut = mean([rows[-1].get("eval/truncation_rate", float("nan")) for rows in ended.values()])
        stopped = f" (+{len(seeds) - len(ended)} stopped early)" if len(ended) < len(seeds) else ""
        lines.append(f"| {label(kind)} | {len(ended)}{stopped} at step {next(iter(ended.values()))[-1]['step']} | "
                     + " | ".join(cells) + f" | {cut:.1%} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = evaluations(args.folder)
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for i, (kind, seeds) in enumerate(sorted(runs.items())):
        color = f"C{i}"
        curves = {seed: {r["step"]: r["eval/accuracy"] for r in rows} for seed, rows in seeds.items()}
        for points in curves.values():
            ax.plot(list(points), list(points.values()), color=color, alpha=0.3, lw=0.8)
        ended = [curves[seed] for seed in whole(seeds)]  # a seed stopped early: drawn, not averaged
        steps = sorted(set.intersection(*(set(points) for points in ended)))
        stopped = f"; {len(seeds) - len(ended)} stopped early" if len(ended) < len(seeds) else ""
        ax.plot(steps, [mean([points[s] for points in ended]) for s in steps], color=color, lw=2.2,
                marker="o" if len(steps) < 3 else None,
                label=f"{label(kind)} ({len(ended)} seed{'s' if len(ended) != 1 else ''}{stopped})")
    ax.set_xlabel("step")
    ax.set_ylabel("held-out accuracy (greedy; QA-GRPO: quantized)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"![learning curves]({args.out.name})\n\n{table(runs)}")  # markdown: `keep` saves it as table.md


if __name__ == "__main__":
    main()
