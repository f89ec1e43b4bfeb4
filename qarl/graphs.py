"""The update's micro-batches under CUDA graphs (`trainer.cuda_graphs`): launched by one replay instead of by the host.

An update is host-bound (issue 74): the host spends about as long launching a micro-batch's kernels as the GPU
spends running them. A CUDA graph records those launches once and replays them with none. It replays the same
kernels on the same memory, so every micro-batch of a step is packed into one `StaticShape` (the token budget,
padding sequences filling the slack; `static_shapes`), its inputs copied into the graph's own buffers before each
replay (`CapturedCalls`). What a replay does not redo is the host's Python: the graph is captured again whenever
what that Python decided may have changed (`CapturedCalls.key`: a quantizer replaced, a parameter moved).

The first micro-batch of each shape runs eagerly (its result counts: it is also the warm-up that compiles and
autotunes), then the same call is captured, and every later micro-batch of that shape replays it. Gradients
accumulate into `.grad` tensors kept for the whole update (`PolicyOptimizer.keep_gradients`), which the captured
backward adds into. The graphs and their memory pool are released at the end of the update, before the engine
wakes for the next rollout (their memory is counted in the plan: qarl/memory.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from qarl.config import ConfigError, RecipeConfig
from qarl.quant.mixins import QUANTIZER_CHANGES
from qarl.scoring import MicroBatch, StaticShape

SEQUENCE_LENGTH_STEP = 256  # the attention's longest sequence is rounded up to this, so a run needs few shapes


def graph_refusal(cfg: RecipeConfig, device: str, distilling: bool = False) -> str:
    """Why `trainer.cuda_graphs=on` cannot run with these (decided) settings, as the fix to make; "" if it can."""
    p, t = cfg.policy, cfg.trainer
    off = "set trainer.cuda_graphs=off"
    refusals = (
        (device != "cuda", f"it captures the update on a GPU and this machine has none: {off}"),
        (distilling, f"QAD's update (qarl/distill.py) is not captured, QA-GRPO's is: {off}"),
        (p.backend != "hf", f"it captures the HF backend's update, not policy.backend={p.backend}: {off}"),
        (p.exact_forward, f"the exact forward lays out each micro-batch by rows and is not captured yet: {off}"),
        (t.token_budget <= 0, "it replays packed micro-batches of one token budget: set "
                              "trainer.max_tokens_per_micro_batch (auto, or a number of tokens), or " + off),
        (p.logprob_chunk_tokens <= 0, f"it scores the completion tokens in chunks: set policy.logprob_chunk_tokens "
                                      f"> 0, or {off}"),
        (p.dtype != "bfloat16", f"it captures bfloat16 compute (float16's loss scale changes between replays), not "
                                f"policy.dtype={p.dtype}: {off}"),
        (p.master_dtype == p.dtype, "its gradients accumulate in the compute dtype beside float32 master weights: "
                                    f"set policy.master_dtype=float32, or {off}"),
        (p.lora.mode != "none", f"it captures full training, not policy.lora.mode={p.lora.mode}: {off}"),
        (p.gradient_checkpointing == "on", "it keeps every activation of a micro-batch in its memory pool: set "
                                           f"policy.gradient_checkpointing=off, or {off}"),
    )
    return next((why for refused, why in refusals if refused), "")


def check_cuda_graphs(cfg: RecipeConfig, device: str, distilling: bool = False) -> None:
    """Refuse `trainer.cuda_graphs=on` where it cannot run, naming the setting to change (before anything loads)."""
    if cfg.trainer.cuda_graphs == "on":
        why = graph_refusal(cfg, device, distilling)
        if why:
            raise ConfigError(f"trainer.cuda_graphs=on: {why}")


def static_shape(micro_batches: Sequence[MicroBatch], budget: int, max_new_tokens: int) -> StaticShape:
    """The `StaticShape` every micro-batch of a step is packed into: the token budget (or the longest micro-batch, a
    row longer than the budget going alone), the attention's longest sequence rounded up to `SEQUENCE_LENGTH_STEP`,
    room for every micro-batch's sequences and padding sequences (a power of two), completions of up to
    `max_new_tokens`."""
    used = [sum(len(c.prompt_ids) + len(c.token_ids) for c in mb.completions) for mb in micro_batches]
    tokens = max(budget, *used)
    longest = max(len(c.prompt_ids) + len(c.token_ids) for mb in micro_batches for c in mb.completions)
    longest = min(-(-longest // SEQUENCE_LENGTH_STEP) * SEQUENCE_LENGTH_STEP, tokens)
    sequences = max(len(mb.completions) + -(-(tokens - n) // longest) for mb, n in zip(micro_batches, used))
    return StaticShape(tokens, 1 << (sequences - 1).bit_length(), longest, max_new_tokens)


@dataclass
class Captured:
    """One captured call: its graph, the buffers it reads its inputs from, and the outputs each replay overwrites."""

    graph: torch.cuda.CUDAGraph
    inputs: list[torch.Tensor | None]
    outputs: Any


class CapturedCalls:
    """`fn(*inputs)` captured once per key and replayed. The first call of a key runs `fn` eagerly on the capture
    stream (its result is returned: the call's own work, and the warm-up a capture needs), then captures it; later
    calls copy their inputs into the captured buffers and replay. Every graph shares one memory pool (they replay one
    at a time). A replay's outputs are overwritten by the next replay: copy what you keep."""

    def __init__(self, fn: Callable[..., Any], device: torch.device):
        self.fn, self.device = fn, device
        self.captured: dict[tuple, Captured] = {}
        self.pool: tuple | None = None
        self.stream: torch.cuda.Stream | None = None  # made at the first capture
        self.captures = 0

    def __call__(self, key: tuple, inputs: list[torch.Tensor | None]) -> Any:
        key = (*key, self.state())
        found = self.captured.get(key)
        if found is None:
            return self._capture(key, inputs)
        for buffer, value in zip(found.inputs, inputs):
            if buffer is not None:
                buffer.copy_(value, non_blocking=True)
        found.graph.replay()
        return found.outputs

    @staticmethod
    def state() -> int:
        """What the eager Python decides on and a replay does not look at again: a quantizer replaced or re-set
        (ModelOpt's setters) bumps QUANTIZER_CHANGES. Parameters are written in place (the optimizer, `copy_masters`
        holding each quantized weight), so their addresses stay those the graph reads."""
        return QUANTIZER_CHANGES.value

    def _capture(self, key: tuple, inputs: list[torch.Tensor | None]) -> Any:
        self.stream = self.stream or torch.cuda.Stream(self.device)
        buffers = [None if t is None else torch.empty_like(t, device=self.device) for t in inputs]
        for buffer, value in zip(buffers, inputs):
            if buffer is not None:
                buffer.copy_(value)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            result = self.fn(*buffers)  # this call's own work, eagerly: compiles, autotunes, makes lazy state
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        self.stream.synchronize()
        torch.cuda.empty_cache()  # the eager call's freed blocks, which the graph's own pool cannot reuse
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            outputs = self.fn(*buffers)
        self.pool = graph.pool()
        self.captured[key] = Captured(graph, buffers, outputs)
        self.captures += 1
        return result

    def release(self) -> None:
        """Drop every graph and its pool (before the engine needs the memory back)."""
        self.captured.clear()
        self.pool = None
        torch.cuda.empty_cache()
