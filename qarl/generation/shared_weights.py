"""One copy of the rollout weights: the policy's compute weights live in the engine's own tensors.

With mixed precision (bf16/fp16 compute, fp32 masters) the policy's compute weights are derived: after every
optimizer step `qarl.quant.fastpath.weight_cache.copy_masters` rewrites them from the masters, a quantized layer's
weight holding its fake-quantized value. That is exactly what a refit would send the engine, so a compute
weight can be a view into the engine's tensor instead of a second copy: its rows of vLLM's fused q/k/v or
gate/up matrix, the first rows of a padded vocabulary, or the whole tensor. The optimizer's copy then writes
the engine's weights, a refit copies nothing for them, and the rollout phase holds one copy, not two.

Which parameters share: those a refit sends as they are (unquantized, or holding their quantized value),
rewritten from a master, with the engine's dtype and device and a contiguous view of their shape in the
engine; found by name through vLLM's fused-layer mapping and checked equal to what the refit just copied
(a layout qarl misreads is an error, not a silent mix-up). All or nothing: they share only if they then cover
every engine weight, else every weight is copied as before. A parameter that stops qualifying (its
quantizer's amax changed, so it holds the unquantized weight until the next step) gets its own memory back
before the refit sends its folded value, and with it every other; a refit from another model first gives the
linked model all of its memory back.

Sleep: vLLM's sleep takes its weights off the GPU, and the policy now trains with them. While weights are
shared the engine sleeps by releasing only its KV cache (whose content vLLM's level-1 sleep drops too) and
keeps the weights where they are (`release_kv_cache`); vLLM's worker wakes the KV cache up as its own.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterator

import torch
from torch import nn

from qarl.generation import vllm_compat
from qarl.generation.engine_quant import policy_names
from qarl.quant.fastpath.weight_cache import written_from_master


def engine_views(engine_model: nn.Module, shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor] | None:
    """Policy parameter name -> the part of the engine's tensor that holds it: the rows of a fused
    parameter (its parts stacked in vLLM's order, which must add up to the whole), the first rows of a
    padded one, or the whole tensor. None if an engine parameter has no such place in the policy (another
    naming or layout): then nothing is shared."""
    views = {}
    for name, param in engine_model.named_parameters():
        module, _, leaf = name.rpartition(".")
        parts = [f"{part}.{leaf}" for part in policy_names(engine_model, module)]
        if any(part not in shapes or shapes[part][1:] != param.shape[1:] for part in parts):
            return None
        rows = [shapes[part][0] for part in parts]
        if (sum(rows) != param.shape[0]) if len(parts) > 1 else (rows[0] > param.shape[0]):
            return None
        for part, start, count in zip(parts, itertools.accumulate([0, *rows]), rows):
            views[part] = param.data.narrow(0, start, count)
    return views


class SharedWeights:
    """The policy parameters that are views into one engine's weights (`link`), and the refit's view of them
    (`unshared`: what is left to copy). All or nothing: a sleeping engine keeps its weights on the GPU only
    when every one of them is the policy's, so an engine weight the policy cannot share (another format's
    fold, an AWQ-scaled weight) leaves every weight copied and vLLM's own sleep in charge."""

    def __init__(self, engine_model: nn.Module):
        self.engine_model = engine_model
        self.linked: dict[str, torch.Tensor] = {}  # policy parameter name -> the engine view it is
        self.shared_bytes = 0  # what the latest refit did not copy because the engine already holds it
        self._model: weakref.ref | None = None
        self._params: dict[str, nn.Parameter] = {}  # the policy model's (after `link`: only the linked ones)
        self._views: dict[str, torch.Tensor] | None = None
        self._candidates: list[str] = []

    @property
    def model(self) -> nn.Module | None:
        return None if self._model is None else self._model()

    def unshared(self, policy_model: nn.Module, weights: Iterator[tuple[str, torch.Tensor]]
                 ) -> Iterator[tuple[str, torch.Tensor]]:
        """The refit's (name, folded weight) pairs minus those the engine holds already (a linked parameter
        the fold returns as itself). A linked parameter whose fold is another tensor gets its own memory back
        before its folded value goes to the engine; unlinked parameters the fold returns as themselves become
        candidates for `link`. A refit from another model than the linked one unlinks that model first."""
        params = dict(policy_model.named_parameters())
        if self.model is not policy_model:
            self.unlink()
            self._model = weakref.ref(policy_model)  # (weak: a refit does not keep a dropped policy alive)
            self._views = engine_views(self.engine_model, {n: p.shape for n, p in params.items()})
        self._params = params
        self.shared_bytes, self._candidates = 0, []
        for name, tensor in weights:
            param, view = self._params.get(name), self.linked.get(name)
            if view is not None and tensor.data_ptr() == view.data_ptr() and tensor.shape == view.shape:
                self.shared_bytes += tensor.numel() * tensor.element_size()
                continue
            if view is not None:
                self._unlink(name)
            elif (param is not None and tensor.data_ptr() == param.data_ptr() and tensor.shape == param.shape
                  and written_from_master(param)):
                self._candidates.append(name)
            yield name, tensor

    @torch.no_grad()
    def link(self) -> int:
        """Make the candidates of the latest refit (just copied into the engine) views into the engine's
        tensors, if with the parameters linked already they then cover every engine weight, each with its dtype,
        device and shape; else give every linked parameter its own memory back. Returns the bytes linked now."""
        fits = [name for name in self._candidates if self._views is not None and self._fits(name)]
        self._candidates = []
        if self._views is None or set(self._views) - self.linked.keys() - set(fits):
            self.unlink()
            return 0
        linked = 0
        for name in fits:
            param, view = self._params[name], self._views[name]
            if not torch.equal(view, param):
                raise RuntimeError(
                    f"the engine's tensor for {name} does not hold what the refit just copied into it: vLLM lays "
                    "this model's weights out otherwise than qarl reads its fused layers; set "
                    "policy.generation.share_weights=false")
            param.data = view  # the parameter's version counter stays: a held quantized value stays held
            self.linked[name] = view
            linked += view.numel() * view.element_size()
        self._params = {name: self._params[name] for name in self.linked}
        return linked

    def _fits(self, name: str) -> bool:
        param, view = self._params[name], self._views.get(name)
        return (view is not None and view.dtype == param.dtype and view.device == param.device
                and view.shape == param.shape and view.is_contiguous())

    @torch.no_grad()
    def unlink(self) -> None:
        """Give every linked parameter its own memory back (the same values): before another model refits
        the engine, before the engine shuts down, and where not every engine weight can be shared."""
        for name in list(self.linked):
            self._unlink(name)

    def _unlink(self, name: str) -> None:
        view, param = self.linked.pop(name), self._params[name]
        if param.data_ptr() == view.data_ptr():  # (a state load that replaced the tensor already gave it new memory)
            param.data = param.data.clone()


def release_kv_cache() -> None:
    """vLLM's level-1 sleep without its weights: the KV cache's memory in vLLM's sleep-mode pool is unmapped
    and its content dropped, as that sleep drops it; the weights stay on the GPU, in use by the policy. The
    worker's own wake (`vllm_compat.wake_kv_cache`) maps it again and rebuilds what points into it."""
    torch.cuda.synchronize()
    vllm_compat.release_kv_cache()
