"""No metrics row is dropped without a word (qarl/metrics.py): a resume, which rewrites metrics.jsonl, keeps a damaged
row aside in metrics.jsonl.damaged with its line number and names it; a torn last line (a crash mid-write) is dropped
and said; a reader (plots, summaries, benchmarks/compare_runs.py) says what it skipped and writes nothing."""

from __future__ import annotations

import json
from pathlib import Path

from qarl.metrics import MetricsLog, read_metrics

ROWS = [{"step": s, "reward/mean": 0.25 * s} for s in range(5)]


def damaged_log(run_dir: Path) -> Path:
    """Rows 0..4 with row 1 cut short mid-file, a line of bytes that are no text (line 4), and a torn last line."""
    run_dir.mkdir()
    lines = [json.dumps(r) for r in ROWS]
    lines[1] = lines[1][:9]
    path = run_dir / "metrics.jsonl"
    path.write_bytes(("\n".join(lines[:3]) + "\n").encode() + b"\xff\xfe garbage\n"
                     + ("\n".join(lines[3:]) + "\n").encode() + b'{"step": 5, "rew')
    return path


def test_a_resume_keeps_damaged_rows_aside_and_names_them(tmp_path, capsys):
    path = damaged_log(tmp_path / "run")
    MetricsLog(path, resume_step=4).close()
    assert read_metrics(path) == [ROWS[0], ROWS[2], ROWS[3]]  # rows before the checkpoint's step, the damaged aside
    aside = [json.loads(line) for line in (path.parent / "metrics.jsonl.damaged").read_text().splitlines()]
    assert [(a["line"], a["resume_step"]) for a in aside] == [(2, 4), (4, 4)]
    assert aside[0]["text"] == '{"step": ' and aside[1]["text"].endswith(" garbage")
    out = capsys.readouterr().out.strip().splitlines()
    assert out == [f"{path}: 2 damaged row(s) (lines 2, 4) kept aside in metrics.jsonl.damaged; its torn last line 7 "
                   "(a crash mid-write) dropped"]


def test_a_second_resume_appends_to_what_was_kept_aside(tmp_path):
    path = damaged_log(tmp_path / "run")
    MetricsLog(path, resume_step=4).close()
    with path.open("a") as f:
        f.write('{"step": 4\n{"step": 4}\n')
    MetricsLog(path, resume_step=5).close()
    aside = (path.parent / "metrics.jsonl.damaged").read_text().splitlines()
    assert [json.loads(line)["line"] for line in aside] == [2, 4, 4]


def test_a_reader_says_what_it_skipped_and_writes_nothing(tmp_path, capsys):
    path = damaged_log(tmp_path / "run")
    before = path.read_bytes()
    assert [r["step"] for r in read_metrics(path)] == [0, 2, 3, 4]
    err = capsys.readouterr().err
    assert "2 damaged row(s) (lines 2, 4) skipped; its torn last line 7 (a crash mid-write) skipped" in err
    assert path.read_bytes() == before and sorted(p.name for p in path.parent.iterdir()) == ["metrics.jsonl"]


def test_a_clean_log_says_nothing(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    MetricsLog(tmp_path / "metrics.jsonl", resume_step=3).close()
    assert read_metrics(tmp_path / "metrics.jsonl") == ROWS[:3]
    captured = capsys.readouterr()
    assert captured.out == captured.err == "" and not (tmp_path / "metrics.jsonl.damaged").exists()
