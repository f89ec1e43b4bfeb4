"""benchmarks/smollm2_curves.py on the kept SmolLM2 runs: its table gives the numbers docs/results/smollm2.md
publishes from the runs' own evaluations (the two stages from the base, 2026-12-05); a seed stopped early is
listed, not averaged; a kind's gain is measured against the GRPO runs of its own seeds."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

KEPT = REPO / "benchmarks" / "results" / "gpu" / "smollm2"


def curves(folder: Path, out: Path) -> str:
    proc = subprocess.run([sys.executable, "benchmarks/smollm2_curves.py", str(folder), "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=120, check=True)
    assert out.stat().st_size > 0
    return proc.stdout


def row(table: str, label: str) -> str:
    return next(line for line in table.splitlines() if line.startswith(f"| {label} |"))


def test_the_table_gives_the_published_two_stage_row(tmp_path: Path):
    table = curves(KEPT / "two_stage", tmp_path / "curves.png")
    assert table.startswith("![learning curves](curves.png)")
    stage2 = row(table, "QAD, then QA-GRPO NVFP4 W4A4 (stage 2, exact)")
    assert "| 3 at step 60 | 40.8% (39.5%, 41.1%, 41.8%) | 53% | 6.2% (5.7%, 6.9%, 6.1%) | 34% | 0.0% |" in stage2
    assert "| 100% |" in row(table, "GRPO (bf16)")


def test_a_seed_stopped_early_is_listed_not_averaged_and_its_gain_is_against_its_own_teacher(tmp_path: Path):
    table = curves(KEPT / "qad_methods", tmp_path / "curves.png")
    # seed 0's teacher: 61.5 % from 16.8 %, so (33.7 - 16.8) / (61.5 - 16.8); the three teachers' mean would give 36 %
    assert "| 1 (+2 stopped early) at step 50 | 33.7% (33.7%) | 38% |" in row(table, "QAD NVFP4 W4A4")
