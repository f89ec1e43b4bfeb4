"""Run metrics: one JSON object per step in RUN_DIR/metrics.jsonl, a plot, and a one-screen summary.

Under torchrun every process computes the same rows; the main process alone writes, plots and prints them
(qarl/distributed.py)."""

from __future__ import annotations

import json
import math
import sys
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from qarl.distributed import is_main_process

LOGGERS = ("tensorboard", "wandb")


def check_loggers(loggers: list[str]) -> None:
    """Named loggers exist and their packages are installed, before any model is loaded."""
    import importlib.util

    from qarl.config import ConfigError

    for name in loggers:
        if name not in LOGGERS:
            raise ConfigError(f"run.loggers: unknown logger {name!r}; choose from {LOGGERS} (metrics.jsonl is always written)")
        if importlib.util.find_spec(name) is None:
            raise ConfigError(f"run.loggers includes {name!r} but the {name} package is not installed: "
                              f"pip install {name} (or qarl[{name}]), or remove it from run.loggers")


class MetricsLog:
    """Appends rows to metrics.jsonl (the source of truth) and mirrors them to the optional loggers.

    On resume from step N, rows of step >= N (written after the checkpoint by the run that stopped)
    are dropped first, so the file reads as one clean run; damaged rows are kept aside (`salvage_metrics`)."""

    def __init__(self, path: Path, resume_step: int | None, loggers: list[str] = (), config: dict | None = None,
                 project: str = "qarl"):
        self.path = path
        self.sinks = []
        self.writes = is_main_process()
        if not self.writes:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        kept = [r for r in salvage_metrics(path, resume_step) if resume_step is not None and r["step"] < resume_step]
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        tmp.replace(path)
        if "tensorboard" in loggers:
            from torch.utils.tensorboard import SummaryWriter

            writer = SummaryWriter(log_dir=str(path.parent / "tensorboard"), purge_step=resume_step)
            self.sinks.append((lambda row, step: [writer.add_scalar(k, v, step) for k, v in row.items()], writer.close))
        if "wandb" in loggers:
            import os

            import wandb

            run = wandb.init(project=project, name=path.parent.name, dir=str(path.parent), config=config or {},
                             mode=os.environ.get("WANDB_MODE", "offline"), resume="allow", id=_wandb_id(path.parent))
            self.sinks.append((lambda row, step: run.log(row, step=step), run.finish))

    def write(self, row: dict[str, Any]) -> None:
        """Append `row`, with the process's host memory peak so far (`memory/host_peak_rss_gib`) added."""
        if not self.writes:
            return
        row = {**row, HOST_PEAK_KEY: row.get(HOST_PEAK_KEY, host_peak_rss_gib())}
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        with self.path.open("a") as f:
            f.write(json.dumps(clean) + "\n")
            f.flush()
        scalars = {k: v for k, v in clean.items() if k != "step" and isinstance(v, (int, float)) and v is not None}
        for log, _ in self.sinks:
            log(scalars, int(row["step"]))

    def close(self) -> None:
        for _, close in self.sinks:
            close()
        self.sinks = []


def _wandb_id(run_dir: Path) -> str:
    """One W&B run per run directory, so a resumed run continues its W&B run."""
    import hashlib

    return hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:16]


class ProgressFigures:
    """The figures people watch on the progress bar: QAD's KL, reward, held-out accuracy, mismatch, tokens/s
    (held-out accuracy and the skipped-step count carry over from the rows that have them)."""

    def __init__(self) -> None:
        self.accuracy: float | None = None
        self.skipped = 0

    def update(self, row: dict[str, Any]) -> str:
        if row.get("eval/accuracy") is not None:
            self.accuracy = row["eval/accuracy"]
        self.skipped += int(row.get("train/skipped") or 0)
        parts = [f"kl={row['distill/kl']:.4f}"] if row.get("distill/kl") is not None else []  # QAD's loss
        parts.append(f"reward={row['reward/mean']:.2f}" if row.get("reward/mean") is not None else "reward=nan")
        if self.accuracy is not None:
            parts.append(f"eval_acc={self.accuracy:.3f}")
        if row.get("mismatch/kl") is not None:
            parts.append(f"mismatch_kl={row['mismatch/kl']:.1e}")
        if row.get("perf/rollout_tokens_per_s") is not None:
            parts.append(f"tok/s={row['perf/rollout_tokens_per_s']:.0f}")
        if self.skipped:
            parts.append(f"skipped={self.skipped}")
        return ", ".join(parts)


class MismatchWatch:
    """Says on the terminal, once, the first step whose train/rollout log-probs differ where the run promises they
    cannot (`policy.exact_forward`: equal bit for bit), rather than leaving it to the metrics: something broke that
    promise, most likely a sequence the engine preempted and recomputed for lack of KV cache."""

    def __init__(self, expect_zero: bool) -> None:
        self.expect_zero, self.said = expect_zero, False

    def __call__(self, step: int, row: dict[str, Any], write: Callable[[str], Any]) -> None:
        diff = row.get("mismatch/max_abs_logprob_diff")
        if not self.expect_zero or self.said or not diff or not is_main_process():
            return
        self.said = True
        write(f"policy.exact_forward: at step {step} the policy's log-probs of the sampled tokens differ from the "
              f"engine's (largest |difference| {diff:.3g}, mismatch/kl {row.get('mismatch/kl') or 0:.3g}), which the "
              "exact forward makes equal. The likeliest cause is a sequence the engine preempted and recomputed for "
              "lack of KV cache: give the engine more (policy.generation.gpu_memory_utilization or gpu_kv_cache_gib). "
              "The run goes on (importance weights correct for it); mismatch/* in metrics.jsonl has every step.")


HOST_PEAK_KEY = "memory/host_peak_rss_gib"


def host_peak_rss_gib() -> float:
    """The most resident host memory this process has held since it started, in GiB (`ru_maxrss`: KiB on Linux,
    bytes on macOS): vLLM, the policy and everything else in the process; on CPU the run's whole footprint."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (2**30 if sys.platform == "darwin" else 2**20)


def free_device_bytes() -> int:
    """The device's free memory as its driver reports it (0 without a GPU)."""
    import torch

    return torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else 0


def device_memory_line() -> str:
    """What the device has in use (the driver's view) and how much of it this process's torch allocator holds:
    the difference is other processes, vLLM's pool and the CUDA context."""
    import torch

    free, total = torch.cuda.mem_get_info()
    return (f"{(total - free) / 2**30:.2f} GiB of {total / 2**30:.1f} GiB in use on the device, torch's allocator "
            f"{torch.cuda.memory_allocated() / 2**30:.2f} GiB allocated, {torch.cuda.memory_reserved() / 2**30:.2f} GiB "
            "reserved")


class DriverPeak:
    """The most device memory in use from the driver's view (NVML, what nvidia-smi shows: every allocator and
    process, vLLM's pool and the CUDA contexts included), sampled on a thread every `interval` seconds: torch's
    counters miss what is not torch's, and the driver's view at a phase's end misses the phase's peak. `read` gives
    the bytes in use; None: the current GPU's through NVML, and nothing at all without a GPU or NVML."""

    def __init__(self, read: Callable[[], int] | None = None, interval: float = 0.02):
        self._read = read if read is not None else _nvml_used_bytes()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        if self._read is not None:
            self._peak = self._read()
            self._thread = threading.Thread(target=self._sample, args=(interval,), name="qarl-driver-peak", daemon=True)
            self._thread.start()

    def _sample(self, interval: float) -> None:
        while not self._stop.wait(interval):
            used = self._read()
            with self._lock:
                self._peak = max(self._peak, used)

    def take(self) -> int | None:
        """The peak since the last `take` (or the start), in bytes; the next period starts now. None: not measured."""
        if self._read is None:
            return None
        used = self._read()
        with self._lock:
            peak, self._peak = max(self._peak, used), used
        return peak

    def __enter__(self) -> DriverPeak:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def _nvml_used_bytes() -> Callable[[], int] | None:
    """The current GPU's memory in use as NVML reports it, or None (no GPU, or no NVML: the `nvidia-ml-py` package
    vLLM installs)."""
    import torch

    if not torch.cuda.is_available():
        return None
    device = torch.cuda.current_device()
    try:
        torch.cuda.device_memory_used(device)
    except Exception as e:  # no NVML here (a container without it): the runs go on without this figure, said once
        print(f"memory/device_peak_*: not measured, NVML cannot read device {device} ({type(e).__name__}: {e})")
        return None
    return lambda: torch.cuda.device_memory_used(device)


def device_memory_gib(phase: str, released: int = 0, driver_peak: DriverPeak | None = None) -> dict[str, float]:
    """GPU memory of a phase of the step ("rollout": from the last update's end through the refit, any evaluation
    and the rollout; "update"): in use on the whole device at its end and, with `driver_peak`, at its peak (the
    driver's view: every allocator, vLLM's pool included), the peak of torch's allocator during the phase, and that
    peak less `released`, the memory the sleeping engine gave back to the device but torch's allocator still counts
    as allocated (vLLM's pool): what the phase really used at its peak. Nothing on CPU."""
    import torch

    if not torch.cuda.is_available():
        return {}
    free, total = torch.cuda.mem_get_info()
    peak = torch.cuda.max_memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    driver = driver_peak.take() if driver_peak is not None else None
    return {f"perf/gpu_mem_after_{phase}_gib": (total - free) / 2**30, f"perf/torch_peak_{phase}_gib": peak / 2**30,
            f"memory/{phase}_peak_gib": (peak - released) / 2**30,
            **({f"memory/device_peak_{phase}_gib": driver / 2**30} if driver is not None else {})}


def storage_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the distinct storages behind `tensors` (a view into a tensor already counted adds nothing)."""
    storages = {}
    for t in tensors:
        storage = t.untyped_storage()
        storages[(str(t.device), storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())


def weight_memory(model: Any, optimizer: Any, engine_model: Any) -> dict[str, float]:
    """What each side holds, measured from its tensors: the policy's weights (parameters, buffers and the weight
    cache's quantized copies, adapters excluded), its adapters, the optimizer's (master weights when they are not
    the parameters, AdamW's moments) and the rollout engine's weights. A tensor both sides share (one copy of the
    rollout weights) counts on both; `perf/refit_shared_bytes` says how much is shared."""
    from qarl.lora import ADAPTER_PARAMS
    from qarl.quant.fastpath.weight_cache import cached_weights

    named = [(n.rpartition(".")[2] in ADAPTER_PARAMS, t) for n, t in [*model.named_parameters(), *model.named_buffers()]]
    adapters = [t for adapter, t in named if adapter]
    weights = [t for adapter, t in named if not adapter] + list(cached_weights(model))
    state = [v for s in optimizer.optimizer.state.values() for v in s.values() if hasattr(v, "untyped_storage")]
    masters = [] if optimizer.masters is optimizer.params else optimizer.masters
    engine = list(engine_model.parameters()) + list(engine_model.buffers()) if engine_model is not None else []
    return {"memory/policy_weight_bytes": float(storage_bytes(weights)),
            "memory/adapter_bytes": float(storage_bytes(adapters)),
            "memory/optimizer_bytes": float(storage_bytes(masters + state)),
            "memory/engine_weight_bytes": float(storage_bytes(engine))}


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Rows of a metrics.jsonl, for reading only (plots, summaries, comparisons: nothing is written). A line that is
    not a row is skipped and said on stderr: a torn last line (a crash mid-write), or a damaged row, which a resumed
    run keeps aside in metrics.jsonl.damaged (`salvage_metrics`)."""
    rows, damaged, torn = _parse_metrics(path)
    if damaged or torn is not None:
        print(f"{path}: {_unreadable_words(damaged, torn, 'skipped', 'skipped')}", file=sys.stderr)
    return rows


DAMAGED_SUFFIX = ".damaged"  # metrics.jsonl.damaged: the damaged rows a resume kept aside


def salvage_metrics(path: Path, resume_step: int | None) -> list[dict[str, Any]]:
    """Rows of a metrics.jsonl that a resumed run is about to rewrite: a damaged row (a line before the last that is
    not a row) is appended, with its line number, to metrics.jsonl.damaged and named on the console; a torn last
    line (a crash mid-write) is dropped, and said."""
    rows, damaged, torn = _parse_metrics(path)
    if damaged:
        aside = path.with_name(path.name + DAMAGED_SUFFIX)
        with aside.open("a") as f:
            for line, text in damaged:
                f.write(json.dumps({"line": line, "resume_step": resume_step, "text": text}) + "\n")
    if damaged or torn is not None:
        print(f"{path}: {_unreadable_words(damaged, torn, f'kept aside in {path.name + DAMAGED_SUFFIX}', 'dropped')}")
    return rows


def _parse_metrics(path: Path) -> tuple[list[dict[str, Any]], list[tuple[int, str]], int | None]:
    """A metrics.jsonl's rows; its damaged lines before the last (line number, text); the number of its last line
    if torn (not a row and not ended by a newline: a crash mid-write)."""
    text = path.read_text(errors="surrogateescape") if path.is_file() else ""  # bytes kept as they are
    lines = text.splitlines()
    rows, damaged, torn = [], [], None
    for number, line in enumerate(lines, 1):
        row = _row(line)
        if row is not None:
            rows.append(row)
        elif line.strip() and number == len(lines) and not text.endswith("\n"):
            torn = number
        elif line.strip():
            damaged.append((number, line))
    return rows, damaged, torn


def _row(line: str) -> dict[str, Any] | None:
    """A metrics row (a JSON object with an integer step), or None."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return None
    return row if isinstance(row, dict) and isinstance(row.get("step"), int) else None


def _unreadable_words(damaged: list[tuple[int, str]], torn: int | None, damaged_fate: str, torn_fate: str) -> str:
    lines = f"line{'s' if len(damaged) > 1 else ''} {', '.join(str(n) for n, _ in damaged)}"
    parts = [f"{len(damaged)} damaged row(s) ({lines}) {damaged_fate}"] if damaged else []
    if torn is not None:
        parts.append(f"its torn last line {torn} (a crash mid-write) {torn_fate}")
    return "; ".join(parts)


PLOTTED = [("reward/mean", "reward"), ("eval/accuracy", "held-out accuracy (quantized, greedy)"),
           ("kl/ref", "KL to reference"), ("mismatch/kl", "train/rollout mismatch KL")]


def plot_runs(runs: dict[str, list[dict[str, Any]]], out: Path,
              panels: list[tuple[str, str]] = PLOTTED) -> Path:
    """One panel per (key, title) in `panels`, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4))
    for ax, (key, title) in zip(axes, panels):
        for label, rows in runs.items():
            points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
            if points:
                ax.plot(*zip(*points), marker="o" if key.startswith("eval") else None, ms=3, label=label)
        if not ax.lines:
            ax.text(0.5, 0.5, "not computed\n(trainer.beta = 0)" if key == "kl/ref" else "no data",
                    ha="center", va="center", transform=ax.transAxes, color="gray")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def summary(rows: list[dict[str, Any]]) -> str:
    """A few lines: accuracy first to last, final reward, mismatch, speed."""
    evals = [r for r in rows if r.get("eval/accuracy") is not None]
    steps = [r for r in rows if r.get("reward/mean") is not None]
    lines = []
    if evals:
        lines.append(f"held-out accuracy (quantized policy, greedy): {evals[0]['eval/accuracy']:.3f} at step "
                     f"{evals[0]['step']} -> {evals[-1]['eval/accuracy']:.3f} at step {evals[-1]['step']}")
    transfer = [r for r in rows if r.get("eval_transfer/accuracy") is not None]
    if transfer:
        lines.append(f"transfer accuracy: {transfer[0]['eval_transfer/accuracy']:.3f} at step {transfer[0]['step']} -> "
                     f"{transfer[-1]['eval_transfer/accuracy']:.3f} at step {transfer[-1]['step']}")
    if steps:
        last = steps[-10:]
        mean = lambda k: sum(r[k] for r in last if r.get(k) is not None) / max(1, sum(r.get(k) is not None for r in last))  # noqa: E731
        lines.append(f"reward (last {len(last)} steps): {mean('reward/mean'):.3f}")
        diffs = [r["mismatch/max_abs_logprob_diff"] for r in steps if r.get("mismatch/max_abs_logprob_diff") is not None]
        lines.append(f"train/rollout mismatch KL: {mean('mismatch/kl'):.2e}, max |Δlogprob| "
                     f"{max(diffs, default=float('nan')):.2e}")
        skipped = sum(r.get("train/skipped") or 0 for r in steps)
        if skipped:
            lines.append(f"skipped optimizer steps (non-finite loss or gradient): {skipped:.0f}")
        lines.append(f"step time {mean('perf/step_s'):.2f} s, rollout {mean('perf/rollout_tokens_per_s'):.0f} tokens/s")
    return "\n".join(lines)


def report_run(run_dir: Path, panels: list[tuple[str, str]] = PLOTTED,
               extra: Callable[[list[dict[str, Any]]], str] | None = None) -> None:
    """The end of a run, on the main process: metrics.png and the summary (plus `extra(rows)`) on the terminal."""
    if not is_main_process():
        return
    rows = read_metrics(run_dir / "metrics.jsonl")
    plot_runs({run_dir.name: rows}, run_dir / "metrics.png", panels)
    print(summary(rows))
    if extra is not None:
        print(extra(rows))
    print(f"metrics: {run_dir / 'metrics.jsonl'}  plot: {run_dir / 'metrics.png'}  checkpoints: {run_dir / 'checkpoints'}")
