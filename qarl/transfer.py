"""Host <-> GPU transfers inside an update that never make the host wait for the GPU.

An update is host-bound (issue 74: its host time about equals its GPU time), so the host must stay ahead of the GPU,
queueing kernels while they run. A copy from pageable host memory to a GPU first waits for everything already queued
on the stream, as `torch.tensor(values, device="cuda")` does: one such copy per micro-batch input stalls the host
each time, and the GPU then idles while the host catches up. `to_device` sends a micro-batch's inputs as one pinned
buffer, copied asynchronously; `on_host` brings the update's scalars back once, at its end.
"""

from __future__ import annotations

import collections
import traceback
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import torch


def to_device(tensors: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Host tensors of one dtype on `device`, in one copy: to a GPU through pinned memory, asynchronously (torch's
    pinned-memory cache keeps the buffer until the copy has run); on a CPU, the tensors themselves. Eager code only:
    a CUDA graph captured around it would replay a copy from a pinned buffer that the cache has since handed out
    again (graphed inputs need buffers of their own)."""
    if len({t.dtype for t in tensors}) > 1:
        dtypes = sorted({str(t.dtype) for t in tensors})
        raise ValueError(f"to_device sends tensors of one dtype in one copy; got {dtypes}")
    if device.type != "cuda" or not tensors:
        return [t.to(device) for t in tensors]
    flat = torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype, pin_memory=True)
    torch.cat([t.reshape(-1) for t in tensors], out=flat)
    moved = flat.to(device, non_blocking=True)
    return [part.view(t.shape) for part, t in zip(moved.split([t.numel() for t in tensors]), tensors)]


def on_host(keys: tuple[str, ...], rows: list[list[torch.Tensor | None]]) -> dict[str, list[float]]:
    """Per-micro-batch scalars (None: NaN) as {key: [value per row]}, copied to the host in one transfer at the end of
    an update rather than one sync after each micro-batch's backward."""
    if not rows:
        return {key: [] for key in keys}
    nan = torch.full((), float("nan"), dtype=torch.float32, device=rows[0][0].device)
    table = torch.stack([torch.stack([nan if v is None else v.detach().float() for v in row]) for row in rows])
    return dict(zip(keys, table.T.tolist()))


def host_waits(step: Callable[[], object]) -> collections.Counter:
    """Where `step()` makes the host wait for the GPU, counted by place (torch's sync debug mode warns at each wait):
    the innermost frame in qarl's code, then the innermost of all where that is elsewhere (transformers, torch)."""
    found: collections.Counter = collections.Counter()
    shown = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return shown(message, category, filename, lineno, file, line)
        stack = [f for f in traceback.extract_stack()[:-1] if "warnings" not in Path(f.filename).name]
        ours, innermost = qarl_frame(stack), frame_name(stack[-1])
        found[ours if ours == innermost else f"{ours} <- {innermost}"] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        before = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(before)
    torch.cuda.synchronize()
    return found


QARL_DIR = Path(__file__).resolve().parent  # the package: a checkout's tests and virtual environment are not qarl's


def qarl_frame(stack: list[traceback.FrameSummary]) -> str:
    """The innermost frame of `stack` in qarl's code (else the innermost of all), as FILE:LINE function."""
    return frame_name(([f for f in stack if Path(f.filename).resolve().is_relative_to(QARL_DIR)] or stack)[-1])


def frame_name(frame: traceback.FrameSummary) -> str:
    """FILE:LINE function, FILE from the package directory on (qarl/..., transformers/..., torch/...)."""
    path = Path(frame.filename).resolve()
    if path.is_relative_to(QARL_DIR):
        name = str(path.relative_to(QARL_DIR.parent))
    else:
        name = str(path).rsplit("-packages/", 1)[-1]
    return f"{name}:{frame.lineno} {frame.name}"
