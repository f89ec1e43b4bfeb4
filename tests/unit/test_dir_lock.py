"""A directory is owned while its command runs (qarl/dir_lock.py), with real processes and real locks: two `qarl
train` started at one instant into one run.dir (one is refused at once, naming the other), a second run or a resume
while the first runs, a lock left by a SIGKILLed run (refused, taken over only with trainer.resume or run.overwrite),
one naming another host, and the same for `qarl matrix`'s matrix.out and `qarl export`'s --out.

A holder that must stay up while another command is tried is a real process that takes the lock through the very
function qarl's command uses (`own_run_dir`, `owning`) and sleeps: a real `qarl train` would start vLLM and run for
minutes on these 2 cores; the instant race is between two real `qarl train` commands."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from qarl.config import ConfigError
from qarl.dir_lock import LOCK_FILE, beside, held, owning, take_lock
from qarl.run_dir import is_main_launch, named_checkpoint, own_run_dir
from tests.conftest import REPO

TINY = "recipes/qa_grpo_tiny.yaml"


def qarl(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "qarl", *args], cwd=REPO, capture_output=True, text=True, timeout=60)
    return proc, time.perf_counter() - start


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("qarl: error: "), proc.stderr
    return lines[0]


def holder(take: str) -> subprocess.Popen:
    """A process that runs `take` (Python that takes a lock the way a qarl command does), says so, and sleeps."""
    code = f"import time\n{take}\nprint('held', flush=True)\ntime.sleep(120)\n"
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def kill(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)  # no cleanup: its lock file stays behind
    proc.wait()


@pytest.fixture
def run_holder(tmp_path):
    """A first run that has locked and claimed its run directory (its identity and config.yaml written, no metrics
    row yet: what run.dir's contents alone once let a second run take over) and goes on running."""
    run_dir = tmp_path / "run"
    proc = holder(f"from qarl.run_dir import claim_run_dir, own_run_dir, plan_run_dir\n"
                  f"own_run_dir({str(run_dir)!r}, 'false', False)\n"
                  f"claim_run_dir(plan_run_dir({str(run_dir)!r}, 'false', False), {{}}, 'run: {{}}\\n')")
    yield run_dir, proc
    if proc.poll() is None:
        kill(proc)


def test_two_runs_started_at_once_one_is_refused_naming_the_other(tmp_path):
    """Two real `qarl train` into one empty run.dir at the same instant: exactly one is refused, within 2 s, by one
    line naming the other's pid; the other holds on (and is then SIGKILLed, before any model loads)."""
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "qarl", "train", TINY, f"run.dir={run_dir}"]
    start = time.perf_counter()
    procs = [subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True) for _ in range(2)]
    try:
        while all(p.poll() is None for p in procs):
            assert time.perf_counter() - start < 10, "neither run was refused"
            time.sleep(0.02)
        seconds = time.perf_counter() - start
        refused = next(p for p in procs if p.poll() is not None)
        running = next(p for p in procs if p is not refused)
        line = one_error_line(subprocess.CompletedProcess(refused.args, refused.returncode, "", refused.stderr.read()))
        assert f"run.dir={run_dir} is in use by another qarl process, pid {running.pid} on" in line
        assert "qarl train recipes/qa_grpo_tiny.yaml" in line and "choose another run.dir" in line
        assert seconds < 2.0, f"{seconds:.2f} s"
        assert running.poll() is None
        assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == running.pid
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


def test_a_second_run_and_a_resume_are_refused_while_the_first_runs(run_holder):
    run_dir, first = run_holder
    run_id = json.loads((run_dir / "qarl_run.json").read_text())["run_id"]
    for extra in ((), ("trainer.resume=true",), ("run.overwrite=true",)):
        proc, seconds = qarl("train", TINY, f"run.dir={run_dir}", *extra)
        line = one_error_line(proc)
        assert f"is in use by another qarl process, pid {first.pid} on {socket.gethostname()}" in line, line
        assert f"run {run_id}" in line and "wait for it to finish or stop it, or choose another run.dir" in line
        assert seconds < 2.0, f"{seconds:.2f} s"
    assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_FILE, "config.yaml", "qarl_run.json"]


def test_a_lock_left_by_a_killed_run_is_taken_over_only_with_resume_or_overwrite(run_holder, capsys):
    run_dir, first = run_holder
    kill(first)
    proc, seconds = qarl("train", TINY, f"run.dir={run_dir}")
    line = one_error_line(proc)
    assert f"holds the lock left by pid {first.pid}" in line and "no longer running: killed or crashed" in line
    assert "trainer.resume=true|auto" in line and "run.overwrite=true" in line and seconds < 2.0
    # trainer.resume takes it over (and then finds no checkpoint: refused by the plan, the lock let go at exit)
    proc, _ = qarl("train", TINY, f"run.dir={run_dir}", "trainer.resume=true")
    assert f"taking over the lock left by pid {first.pid}" in proc.stdout
    assert "no complete checkpoint" in one_error_line(proc)
    assert not (run_dir / LOCK_FILE).exists()


def test_overwrite_takes_over_a_left_lock_in_process(run_holder, capsys):
    run_dir, first = run_holder
    kill(first)
    with pytest.raises(ConfigError, match=f"left by pid {first.pid}"):
        own_run_dir(run_dir, "false", False)
    lock = own_run_dir(run_dir, "false", True)
    assert f"taking over the lock left by pid {first.pid}" in capsys.readouterr().out
    assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert own_run_dir(run_dir, "false", False) is lock  # this process holds it already
    lock.release()
    assert not (run_dir / LOCK_FILE).exists() and held(run_dir / LOCK_FILE) is None


def test_a_lock_naming_another_host_is_refused_then_taken_over_with_resume(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / LOCK_FILE).write_text(json.dumps({"host": "node-7", "pid": 4242, "since": "2026-11-30T10:00:00",
                                                 "command": "qarl train x.yaml"}))
    with pytest.raises(ConfigError, match="pid 4242 on node-7 .* another host, whose process cannot be checked"):
        own_run_dir(run_dir, "false", False)
    own_run_dir(run_dir, "auto", False).release()
    assert "taking over the lock of pid 4242 on node-7" in capsys.readouterr().out


def test_of_many_processes_racing_for_one_directory_exactly_one_wins(tmp_path):
    run_dir = tmp_path / "run"
    code = (f"import sys, time\nfrom qarl.config import ConfigError\nfrom qarl.run_dir import own_run_dir\n"
            f"time.sleep(max(0, {time.time() + 1.5} - time.time()))\n"
            f"try:\n    own_run_dir({str(run_dir)!r}, 'false', False)\nexcept ConfigError:\n    print('refused')\n"
            f"else:\n    print('won', flush=True)\n    time.sleep(2)\n")
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
             for _ in range(4)]
    outcomes = sorted(p.communicate(timeout=60)[0].strip() for p in procs)
    assert outcomes == ["refused", "refused", "refused", "won"]
    assert not run_dir.exists(), "the winner made the directory and, having written nothing else, removed it"


def test_a_lock_that_made_its_directories_removes_them_when_nothing_else_was_written(tmp_path):
    lock = take_lock(tmp_path / "a" / "b" / LOCK_FILE, "x", False, "", "")
    lock.release()
    assert not (tmp_path / "a").exists()


def test_a_second_matrix_into_one_matrix_out_is_refused(tmp_path):
    out = tmp_path / "matrix"
    first = holder(f"from pathlib import Path\nfrom qarl.dir_lock import owning\n"
                   f"held = owning(Path({str(out / LOCK_FILE)!r}), 'matrix.out', False, '', '')\nheld.__enter__()")
    try:
        proc, seconds = qarl("matrix", "recipes/matrix_tiny.yaml", f"matrix.out={out}")
        line = one_error_line(proc)
        assert f"matrix.out={out} is in use by another qarl process, pid {first.pid}" in line
        assert "choose another matrix.out" in line and seconds < 2.0
    finally:
        kill(first)
    proc, _ = qarl("matrix", "recipes/matrix_tiny.yaml", f"matrix.out={out}")
    assert "holds the lock left by" in one_error_line(proc) and "run.overwrite=true" in proc.stderr


def test_a_second_export_into_one_out_is_refused(tmp_path):
    out = tmp_path / "export"
    first = holder(f"from pathlib import Path\nfrom qarl.dir_lock import beside, owning\n"
                   f"held = owning(beside(Path({str(out)!r})), '--out', False, '', '')\nheld.__enter__()")
    args = ("export", str(tmp_path), "--target", "nvfp4_w4a16_modelopt", "--out", str(out))
    try:
        proc, seconds = qarl(*args)
        line = one_error_line(proc)
        assert f"--out {out} is in use by another qarl process, pid {first.pid}" in line and seconds < 2.0
    finally:
        kill(first)
    assert "take it over with --overwrite, or choose another --out" in one_error_line(qarl(*args)[0])
    with owning(beside(out), f"--out {out}", True, "--overwrite", "choose another --out"):  # what --overwrite does
        assert json.loads(beside(out).read_text())["pid"] == os.getpid()
    assert not beside(out).exists()


def test_an_export_into_a_non_empty_out_is_refused_before_anything_loads(tmp_path):
    out = tmp_path / "export"
    out.mkdir()
    (out / "model.safetensors").write_text("an earlier export")
    proc, seconds = qarl("export", str(tmp_path), "--target", "nvfp4_w4a16_modelopt", "--out", str(out))
    assert "exists and is not empty; choose another or pass --overwrite" in one_error_line(proc)
    assert seconds < 2.0 and not beside(out).exists()


def test_a_with_block_keeps_an_outer_holders_lock(tmp_path):
    lock = take_lock(tmp_path / LOCK_FILE, "x", False, "", "")
    with owning(tmp_path / LOCK_FILE, "x", False, "", "") as inner:
        assert inner is lock
    assert held(tmp_path / LOCK_FILE) is lock
    lock.release()


def test_an_export_out_that_is_a_file_is_refused_even_with_overwrite(tmp_path):
    out = tmp_path / "notes.txt"
    out.write_text("mine")
    proc, seconds = qarl("export", str(tmp_path), "--target", "nvfp4_w4a16_modelopt", "--out", str(out),
                         "--overwrite")
    assert f"output directory {out} is a file" in one_error_line(proc) and out.read_text() == "mine"


def test_a_run_still_running_is_refused_as_a_start(run_holder):
    run_dir, _ = run_holder
    with pytest.raises(ConfigError, match="is in use by another qarl process, pid"):
        named_checkpoint(str(run_dir))


def test_a_lock_file_of_unreadable_bytes_is_a_left_lock(tmp_path):
    (tmp_path / LOCK_FILE).write_bytes(b"\xff\xfe{")
    with pytest.raises(ConfigError, match="left"):
        own_run_dir(tmp_path, "false", False)


@pytest.mark.parametrize("env, main", [({}, True), ({"RANK": "1", "LOCAL_RANK": "1"}, False),
                                       ({"RANK": "0", "LOCAL_RANK": "0"}, True), ({"RANK": "3"}, True),
                                       ({"RANK": "", "LOCAL_RANK": "0"}, True)])
def test_only_a_torchrun_rank_other_than_0_leaves_the_run_directory_to_rank_0(monkeypatch, env, main):
    for key in ("RANK", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert is_main_launch() is main
