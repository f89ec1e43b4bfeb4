"""The two training loops as the tests see them, one row each: QA-GRPO (`qarl train`, qarl/train.py) and QAD
(`qarl distill`, qarl/distill.py), with the few-steps settings their end-to-end runs use, and the helpers those
runs share (start a run, SIGKILL it after its first checkpoint, compare metrics without timings).

tests/e2e/test_loops.py and tests/unit/test_loop_checks.py are written once over `LOOPS`; `Runs` makes each
loop's runs once per session, on first use."""

from __future__ import annotations

import importlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from qarl.metrics import read_metrics


@dataclass(frozen=True)
class Loop:
    name: str  # the test id
    cli: str  # the `qarl` subcommand
    recipe: str
    entry: str  # the in-process entry, "module:function"
    small: tuple[str, ...]  # the few-steps overrides of the end-to-end runs
    steps: int  # trainer.steps in `small`
    metrics: tuple[str, ...]  # keys every training step's metrics row holds
    checkpoints: tuple[str, ...]  # what a run with `small` keeps

    def command(self, run_dir: Path, *extra: str) -> list[str]:
        """`python -m qarl <cli> <recipe> run.dir=<run_dir> <small> <extra>` (extra overrides small)."""
        return [sys.executable, "-m", "qarl", self.cli, self.recipe, f"run.dir={run_dir}", *self.small, *extra]

    def run_in_process(self, cfg) -> Path:
        module, function = self.entry.split(":")
        return getattr(importlib.import_module(module), function)(cfg)


WEIGHT_MEMORY = ("memory/policy_weight_bytes", "memory/adapter_bytes", "memory/optimizer_bytes", "memory/engine_weight_bytes")
GRPO = Loop(
    name="grpo", cli="train", recipe="recipes/qa_grpo_tiny.yaml", entry="qarl.train:train",
    small=("trainer.steps=4", "trainer.batch_size=16", "trainer.num_generations=4", "warm_start.steps=30",
           "checkpoint.every=2", "eval.every=2", "eval.num_prompts=16", "task.num_train=200", "task.num_eval=16",
           "policy.quant_calib_size=16", "policy.generation.max_new_tokens=4", "trainer.no_signal_window=3"),
    steps=4,
    metrics=("reward/mean", "reward/std", "reward/frac_zero_std", "kl/ref", "entropy", "mismatch/kl",
             "mismatch/max_abs_logprob_diff", "perf/rollout_tokens_per_s", "perf/step_s", *WEIGHT_MEMORY),
    checkpoints=("step_2", "step_4"),
)
QAD = Loop(
    name="qad", cli="distill", recipe="recipes/qa_distillation_tiny.yaml", entry="qarl.distill:distill",
    small=("trainer.steps=3", "trainer.batch_size=16", "trainer.num_generations=2", "trainer.micro_batch_size=8",
           "warm_start.steps=30", "checkpoint.every=2", "eval.every=2", "eval.num_prompts=16", "task.num_train=200",
           "task.num_eval=16", "policy.quant_calib_size=16", "policy.generation.max_new_tokens=6"),
    steps=3,
    metrics=("distill/kl", "mismatch/kl", "entropy", "grad_norm", "reward/mean", "perf/step_s", *WEIGHT_MEMORY),
    checkpoints=("step_2", "step_3"),
)
LOOPS = [GRPO, QAD]
EVAL_EVERY = 2  # eval.every in both `small`s


def deterministic(rows: list[dict]) -> list[dict]:
    """Metrics rows without the timings (perf/*) and the memory figures (memory/*: measurements of the process, such
    as how a loaded checkpoint's small buffers share storage): what a resumed run must reproduce exactly."""
    return [{k: v for k, v in r.items() if not k.startswith(("perf/", "memory/"))} for r in rows]


def kill_after_first_checkpoint(cmd: list[str], run_dir: Path, sig: int = signal.SIGKILL, stderr=None) -> int:
    """Start a training command and send `sig` (SIGKILL; SIGINT is a terminal's Ctrl-C) to its whole process group
    once checkpoint step_2 is complete; its exit status. `stderr`: where its stderr goes (a file). SIGINT is the
    command's default, as in a terminal, even where this process inherited it ignored (a background job)."""
    proc = subprocess.Popen(cmd, start_new_session=True, stderr=stderr,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 600
    while not (run_dir / "checkpoints" / "step_2" / "COMPLETE").exists():
        assert proc.poll() is None, "training ended before its first checkpoint"
        assert time.time() < deadline
        time.sleep(0.01)
    os.killpg(proc.pid, sig)  # in the middle of step 2, before its metrics row and any later checkpoint
    return proc.wait(timeout=300)


class Runs:
    """Each loop's two runs with its `small` settings, made on first use and kept for the session: `uninterrupted`,
    and `resumed` (SIGKILLed once checkpoint step_2 is complete, then resumed with trainer.resume=true, which takes
    over the lock the killed run left)."""

    def __init__(self, mktemp: Callable[[str], Path]):
        self._mktemp, self._made = mktemp, {}

    def _once(self, loop: Loop, kind: str, make: Callable[[Path], None]) -> Path:
        key = (loop.name, kind)
        if key not in self._made:
            run_dir = self._mktemp(f"{loop.name}_{kind}") / "run"
            try:
                make(run_dir)
                self._made[key] = run_dir
            except Exception as e:  # a failed run fails every test that needs it, without running again
                self._made[key] = e
        if isinstance(self._made[key], Exception):
            raise self._made[key]
        return self._made[key]

    def uninterrupted(self, loop: Loop) -> Path:
        """The run; what it printed is kept beside its directory (`console`)."""
        def make(run_dir: Path) -> None:
            done = subprocess.run(loop.command(run_dir), timeout=600, capture_output=True, text=True)
            keep_console(run_dir, done)
            assert done.returncode == 0, done.stderr[-3000:]

        return self._once(loop, "uninterrupted", make)

    def console(self, loop: Loop) -> tuple[str, str]:
        """(stdout, stderr) of the uninterrupted run: a log's, not a terminal's."""
        run_dir = self.uninterrupted(loop)
        return tuple(console_file(run_dir, stream).read_text() for stream in ("stdout", "stderr"))

    def resumed(self, loop: Loop) -> Path:
        """The killed run resumed; the killed run's directory is kept beside it (`killed`) for `resume_again`."""
        def make(run_dir: Path) -> None:
            kill_after_first_checkpoint(loop.command(run_dir), run_dir)
            assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [0, 1]
            assert not (run_dir / "checkpoints" / "step_3").exists()
            shutil.copytree(run_dir, run_dir.parent / "killed")  # ~10 MB
            resumed = resume(loop, run_dir)
            assert "resuming from step 2" in resumed.stdout, resumed.stdout[-2000:]
            assert "taking over the lock left by pid" in resumed.stdout  # the killed run's (qarl/dir_lock.py)

        return self._once(loop, "resumed", make)

    def resume_again(self, loop: Loop) -> Path:
        """The killed run resumed once more, in a new process from a copy of its directory: for a failure's message.
        A resumed run has twice (in about a hundred) read an engine-side mismatch at its first step and a final
        evaluation apart from the uninterrupted run's, with checkpoints equal to the byte; this tells whether the
        same files resumed again do too (then the state is at fault) or not (the process)."""
        killed = self.resumed(loop).parent / "killed"
        again = killed.parent / "again"
        shutil.rmtree(again, ignore_errors=True)
        shutil.copytree(killed, again)
        resume(loop, again)
        return again


def resume(loop: Loop, run_dir: Path) -> subprocess.CompletedProcess:
    """`loop`'s command with trainer.resume=true in `run_dir`; its console kept beside the directory."""
    resumed = subprocess.run(loop.command(run_dir, "trainer.resume=true"), check=True, timeout=600,
                             capture_output=True, text=True)
    keep_console(run_dir, resumed)
    return resumed


def console_file(run_dir: Path, stream: str) -> Path:
    """Where a run's stdout or stderr is kept: beside its directory."""
    return run_dir.parent / f"{run_dir.name}.{stream}.txt"


def keep_console(run_dir: Path, done: subprocess.CompletedProcess) -> None:
    console_file(run_dir, "stdout").write_text(done.stdout)
    console_file(run_dir, "stderr").write_text(done.stderr)
