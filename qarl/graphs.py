"""The update's micro-batches under CUDA graphs (`trainer.cuda_graphs`): launched by one replay instead of by the host.

An update is host-bound (issue 74): the host spends about as long launching a micro-batch's kernels as the GPU
spends running them. A CUDA graph records those launches once and replays them with none. It replays the same
kernels on the same memory, so every micro-batch of a step is packed into one `StaticShape` (the token budget,
padding sequences filling the slack; `static_shape`), its inputs copied into the graph's own buffers before each
replay (`CapturedCalls`). What a replay does not redo is the host's Python: the graphs are captured again whenever
what that Python decided may have changed (`CapturedCalls.state`: a quantizer replaced, an optimizer step).

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
from qarl.quant.fastpath.weight_cache import optimizer_steps
from qarl.quant.mixins import QUANTIZER_CHANGES
from qarl.scoring import MicroBatch, StaticShape

DYNAMIC_ROPE = ("dynamic", "longrope")  # transformers reads the longest position back to the host at each forward
OFF = "set trainer.cuda_graphs=off"


Refusal = tuple[str, str]  # (a short reason, for `auto`'s start-up line; the fix, for `on`'s error)


def graph_refusals(cfg: RecipeConfig, device: str, distilling: bool = False) -> list[Refusal]:
    """What in these settings refuses `trainer.cuda_graphs`: `on` raises the first fix, `auto` is off for the first
    reason (qarl/run.py decide_fast_settings). A token budget left to `auto` is judged once decided."""
    p, t = cfg.policy, cfg.trainer
    refusals = (
        (device != "cuda", "the CPU", f"it captures the update on a GPU and this machine has none: {OFF}"),
        (distilling, "QAD's update is not captured", f"QAD's update (qarl/distill.py) is not captured, QA-GRPO's is: "
                                                     f"{OFF}"),
        (p.backend != "hf", f"policy.backend={p.backend}", f"it captures the HF backend's update, not "
                                                           f"policy.backend={p.backend}: {OFF}"),
        (t.max_tokens_per_micro_batch == 0, "micro-batches by rows", "it replays packed micro-batches of one token "
                                                                     "budget: set trainer.max_tokens_per_micro_batch "
                                                                     f"(auto, or a number of tokens), or {OFF}"),
        (p.logprob_chunk_tokens <= 0, "policy.logprob_chunk_tokens=0", "it scores the completion tokens in chunks: set "
                                                                       f"policy.logprob_chunk_tokens > 0, or {OFF}"),
        (p.dtype != "bfloat16", f"policy.dtype={p.dtype}", "it captures bfloat16 compute (float16's loss scale changes "
                                                           f"between replays), not policy.dtype={p.dtype}: {OFF}"),
        (p.master_dtype == p.dtype, f"policy.master_dtype={p.master_dtype}", "its gradients accumulate in the compute "
                                                                             "dtype beside float32 master weights: set "
                                                                             f"policy.master_dtype=float32, or {OFF}"),
        (p.lora.mode != "none", f"policy.lora.mode={p.lora.mode}", f"it captures full training, not "
                                                                   f"policy.lora.mode={p.lora.mode}: {OFF}"),
        (p.gradient_checkpointing == "on", "gradient checkpointing on", "it keeps every activation of a micro-batch "
                                                                        "in its memory pool: set "
                                                                        "policy.gradient_checkpointing=off or auto, "
                                                                        f"or {OFF}"),
    )
    return [(short, fix) for refused, short, fix in refusals if refused]


def model_refusal(model_dir: str, trust_remote_code: bool = False) -> Refusal | None:
    """Why the model's forward cannot be captured (it asks the GPU for a value mid-forward, or is scored whole), or
    None if it can. Read from its config and its architecture on the meta device."""
    from transformers import AutoConfig

    from qarl.models.checks import load_pretrained, meta_model
    from qarl.models.experts import config_has_experts
    from qarl.scoring import body_and_head

    config = load_pretrained(AutoConfig, model_dir, trust_remote_code).get_text_config()
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type"))
    if config_has_experts(config):
        return ("a Mixture-of-Experts model",
                f"a Mixture-of-Experts layer asks the GPU which experts its tokens chose: {OFF}")
    if rope_type in DYNAMIC_ROPE:
        return (f"a {rope_type} rotary embedding", f"its {rope_type} rotary embedding reads the longest position "
                                                   f"back: {OFF}")
    if body_and_head(meta_model(model_dir, trust_remote_code)) is None:
        return ("the model's logits are scored whole", "its logits are changed after the head (soft-capping, logit "
                                                       f"scaling) and are scored whole: {OFF}")
    return None


def exact_refusal(cfg: RecipeConfig, model_dir: str) -> Refusal | None:
    """Why the exact forward's static layout cannot hold this model, or None if it can: it computes every token as a
    prefill, so the engine must decode the model's attention shape with the prefill's bits (a probe on the GPU)."""
    from transformers import AutoConfig

    from qarl.backends.exact_forward import check_exact_forward, decodes_as_prefill
    from qarl.models.checks import load_pretrained
    from qarl.quant import resolve_format
    from qarl.quant.formats import quantizes_kv_cache

    check_exact_forward(load_pretrained(AutoConfig, model_dir, cfg.policy.trust_remote_code))  # its own refusals first
    fp8_cache = quantizes_kv_cache(resolve_format(cfg.policy.quant_cfg))
    if decodes_as_prefill(model_dir, cfg.policy.trust_remote_code, cfg.policy.dtype, fp8_cache):
        return None
    return ("the engine decodes this attention shape with other tiles than it prefills",
            "with policy.exact_forward the engine decodes this model's attention shape with other FlashAttention "
            f"tiles than it prefills, which the static layout does not lay out: {OFF}")


def model_graph_refusal(cfg: RecipeConfig, model_dir: str) -> Refusal | None:
    """What in the model refuses `trainer.cuda_graphs` (its forward, then the exact forward's layout), or None."""
    found = model_refusal(model_dir, cfg.policy.trust_remote_code)
    if found is None and cfg.policy.exact_forward:
        found = exact_refusal(cfg, model_dir)
    return found


def check_graph_settings(cfg: RecipeConfig, device: str, distilling: bool = False) -> None:
    """Refuse `trainer.cuda_graphs=on` where the settings cannot be captured, naming what to change (as the run
    starts, before its model is resolved)."""
    found = graph_refusals(cfg, device, distilling) if cfg.trainer.cuda_graphs == "on" else []
    if found:
        raise ConfigError(f"trainer.cuda_graphs=on: {found[0][1]}")


def check_graph_model(cfg: RecipeConfig, model_dir: str) -> None:
    """Refuse `trainer.cuda_graphs=on` where the model's forward cannot be captured (before the memory plan and
    before anything loads)."""
    found = model_graph_refusal(cfg, model_dir) if cfg.trainer.cuda_graphs == "on" else None
    if found is not None:
        raise ConfigError(f"trainer.cuda_graphs=on: {found[1]}")


def check_graph_budget(cfg: RecipeConfig, decided: str) -> None:
    """After the fast settings (`decided`: why the token budget is what it is): graphs need a token budget."""
    if cfg.trainer.cuda_graphs == "on" and cfg.trainer.token_budget <= 0:
        raise ConfigError(f"trainer.cuda_graphs=on replays packed micro-batches of one token budget, and "
                          f"trainer.max_tokens_per_micro_batch is 0 here ({decided}): set it to a number of tokens, "
                          f"or {OFF}")


def static_shape(micro_batches: Sequence[MicroBatch], budget: int, max_new_tokens: int) -> StaticShape:
    """The `StaticShape` every micro-batch of a step is packed into, as tight as the step allows (the graphs are
    captured again each step): the token budget (or the longest micro-batch, a row longer than the budget going
    alone), the step's longest sequence, the most sequences a micro-batch needs with its padding sequences, and the
    most completion tokens a micro-batch scores; completions of up to `max_new_tokens`."""
    used = [sum(len(c.prompt_ids) + len(c.token_ids) for c in mb.completions) for mb in micro_batches]
    tokens = max(budget, *used)
    longest = max(len(c.prompt_ids) + len(c.token_ids) for mb in micro_batches for c in mb.completions)
    sequences = max(len(mb.completions) + -(-(tokens - n) // longest) for mb, n in zip(micro_batches, used))
    picks = max(sum(len(c.token_ids) for c in mb.completions) for mb in micro_batches)
    return StaticShape(tokens, sequences, longest, max_new_tokens, picks)


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
    at a time); all are dropped when `state` changes. A replay's outputs are overwritten by the next replay: copy what
    you keep."""

    def __init__(self, fn: Callable[..., Any], device: torch.device):
        self.fn, self.device = fn, device
        self.captured: dict[tuple, Captured] = {}
        self.captured_in: tuple | None = None  # the `state` the graphs were captured in
        self.pool: tuple | None = None
        self.stream: torch.cuda.Stream | None = None  # made at the first capture
        self.captures = 0

    def __call__(self, key: tuple, inputs: list[torch.Tensor | None]) -> Any:
        if self.state() != self.captured_in:
            self.captured.clear()  # (their pool's memory goes back to it for the new captures)
        found = self.captured.get(key)
        if found is None:
            return self._capture(key, inputs)
        for buffer, value in zip(found.inputs, inputs):
            if buffer is not None:
                buffer.copy_(value, non_blocking=True)
        found.graph.replay()
        return found.outputs

    @staticmethod
    def state() -> tuple[int, int]:
        """What the eager Python decided on and a replay does not look at again: a quantizer replaced or re-set
        (ModelOpt's setters bump QUANTIZER_CHANGES), and the optimizer steps (a weight the cache quantizes into a
        new tensor after each step, rather than holding it in place, is read from the tensor of the capture).
        Parameters and amax are written in place, so their addresses stay those the graph reads."""
        return QUANTIZER_CHANGES.value, optimizer_steps()

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
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
                outputs = self.fn(*buffers)
        except RuntimeError as error:
            raise RuntimeError(f"the update's micro-batch could not be captured as a CUDA graph ({error}); "
                               f"{OFF} and report it with the model and settings") from error
        self.pool = graph.pool()
        self.captured[key] = Captured(graph, buffers, outputs)
        self.captured_in = self.state()  # after the eager call and the capture, which may have set lazy state
        self.captures += 1
        return result

    def release(self) -> None:
        """Drop every graph and its pool (before the engine needs the memory back)."""
        self.captured.clear()
        self.captured_in = self.pool = None
        torch.cuda.empty_cache()
