"""Quantized linear, embedding and attention forwards without ModelOpt's per-call module machinery.

ModelOpt's QuantLinear forward reaches `F.linear` through a context manager, a dynamic `weight` attribute, an
MRO scan for monkey-patched forwards and calls of disabled quantizers: Python that, on a GPU, can exceed the
matmul it wraps. `lean_forward` makes the same calls in the same order, and nothing else:

    y = output_quantizer(F.linear(input_quantizer(x), weight_quantizer(W), b))

skipping only quantizers that are disabled and neither scale nor rotate (for which ModelOpt returns the tensor
unchanged), so the result and the gradients are ModelOpt's bit for bit (tests/unit/test_weight_cache.py
checks both). Each layer decides that once per change (`LinearPlan`).

A `FastInputMixin` input quantizer (NVFP4 W4A4, FP8 W8A8: called at every forward) calls the one op ModelOpt's
forward ends in (`qarl.quant.ops`, the op the rollout engine runs too; on a GPU the kernel bound to its amax),
with ModelOpt's straight-through gradient; any other state (calibrating, disabled, smoothing, another format)
goes to ModelOpt's own forward. `LeanAttention` calls the model's own attention forward while ModelOpt's four
attention quantizers are all disabled and pass their tensors through (every shipped format): the same
computation. All are installed by mixing into each module's own class (`qarl.quant.mixins`), so deep copies and
state dicts are unchanged; a layer with a patched forward or a non-`TensorQuantizer` quantizer keeps ModelOpt's.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from qarl.quant.fastpath.weight_cache import WeightCacheMixin, single_quantizers
from qarl.quant.kernels.gpu import BoundFakeQuant
from qarl.quant.mixins import QUANTIZER_CHANGES, TracksQuantizerChanges, mix_in, track_changes
from qarl.quant.modelopt_compat import (AMAX_BUFFER, amax_buffer, forward_patched_before_conversion,
                                        managed_attribute_names, pass_through_bwd, pre_quant_scale,
                                        quant_attention_class, quant_embedding_class, quant_linear_class,
                                        quantizer_enabled, quantizing)
from qarl.quant.ops import InputQuant, bound_fake_quant, calibrated_spec, fake_quant_eager
from qarl.quant.packed import PackedWeightMixin, is_placeholder, packed_linear
from qarl.quant.straight_through import StraightThrough
from qarl.torch_compat import compiled_in_place, global_hook_tables, hook_tables, tensor_version


def quantized_linear(layer: nn.Module, input: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """ModelOpt's quantized linear math with `weight` in place of the layer's own parameter (LoRA's
    merged mode serves W + s B A through it). A layer without quantizers is a plain `F.linear`. The
    quantizers are read from `_modules`: attribute access on a ModelOpt layer goes through its slow
    dynamic-module __getattr__."""
    quantizers = layer._modules
    input, weight_quantizer = quantized_input(quantizers.get("input_quantizer"), input), quantizers.get("weight_quantizer")
    if isinstance(weight_quantizer, PackedWeightMixin) and is_placeholder(weight):
        output = packed_linear(input, weight_quantizer, layer._parameters.get("bias"))
    else:
        output = F.linear(input, quantized_weight(weight_quantizer, weight), layer._parameters.get("bias"))
    return quantized_output(quantizers.get("output_quantizer"), output)


def quantized_input(quantizer: nn.Module | None, input: torch.Tensor) -> torch.Tensor:
    """What a layer multiplies: its input through its input `quantizer` (unchanged where it has none). A
    `FastInputMixin` quantizer without hooks is called through its forward, as `Module.__call__` would
    call it, without the call's two Python frames (each of the activation formats' input quantizers is
    called at every layer of every forward)."""
    if quantizer is None:
        return input
    if quantizer_enabled(quantizer):
        if isinstance(quantizer, FastInputMixin) and _no_hooks(quantizer):
            return quantizer.forward(input)
        return quantizer(input)
    return input if _is_identity(quantizer) else quantizer(input)


def quantized_weight(quantizer: nn.Module | None, weight: torch.Tensor) -> torch.Tensor:
    """What a layer multiplies with: `weight` through its weight `quantizer`. A weight that holds its
    quantized value (`WeightCacheMixin.hold`, every step of mixed precision) is returned as it is, the
    call skipped unless a hook waits on it: what the quantizer's call would return, checked in one frame,
    since every layer of every forward asks."""
    if quantizer is None:
        return weight
    held = quantizer.__dict__.get("_qarl_held")
    if held is not None and held.weight is weight and quantizer.holds(weight) and _no_hooks(quantizer):
        return weight
    return weight if _is_identity(quantizer) else quantizer(weight)


def quantized_output(quantizer: nn.Module | None, output: torch.Tensor) -> torch.Tensor:
    """A layer's output through its output `quantizer` (enabled in no shipped format)."""
    return output if quantizer is None or _is_identity(quantizer) else quantizer(output)


def _is_identity(quantizer: nn.Module) -> bool:
    """ModelOpt's forward of `quantizer` returns its input as it is: disabled, and without the smoothing scale
    (AWQ, SmoothQuant) and rotation that it applies even when disabled. Such a quantizer is skipped."""
    return (not quantizer_enabled(quantizer) and pre_quant_scale(quantizer) is None
            and not getattr(quantizer, "rotate_is_enabled", False))


_GLOBAL_HOOKS = global_hook_tables()  # the process-wide hook tables `Module.__call__` reads (updated in place)


def _no_hooks(module: nn.Module) -> bool:
    """Calling `module` runs no hook (forward or backward, its own or process-wide): `Module.__call__` would
    call its forward and nothing else."""
    return not (any(hook_tables(module)) or any(_GLOBAL_HOOKS))


@dataclass(frozen=True, slots=True)
class LinearPlan:
    """What a lean linear layer's quantizers do to its next call, found once (`plan_linear`) and reused while
    nothing it rests on changed: the same weight tensor at the same version, no quantizer changed anywhere
    (`QUANTIZER_CHANGES`: every write that changes a tracked quantizer counts), a held weight's amax still
    its quantizer's and not written in place (what `WeightCacheMixin.holds` checks at every call), and no
    hook on a quantizer it calls or skips. A layer makes one per change instead of
    asking its three quantizers ~20 questions at every call. It names its weight by a weak reference: a plan outlives
    a weight replaced without a call since (a frozen weight packed to its codes), and must not keep it alive."""

    weight: weakref.ref[torch.Tensor]
    version: int
    changes: int
    amax: torch.Tensor  # a held weight's amax (`_NO_AMAX` otherwise), and its version then
    amax_version: int
    buffers: dict[str, torch.Tensor]  # where `amax` must still be the amax buffer: the weight quantizer's buffers
    hooks: tuple[dict, ...]  # the hook tables whose entries would make this plan wrong
    lean: bool  # False: `quantized_linear` decides at every call (a state the plan does not cover)
    weight_fn: Callable[[torch.Tensor], torch.Tensor] | None  # None: the parameter as it is
    input_fn: Callable[[torch.Tensor], torch.Tensor] | None  # None: the input as it is

    @property
    def plain(self) -> bool:
        """The layer is F.linear of its input and its weight parameter as they are."""
        return self.lean and self.input_fn is None and self.weight_fn is None


with torch.inference_mode(False):  # an inference tensor keeps no version (an import under inference_mode)
    _NO_AMAX = torch.zeros(())  # never written: its version never moves
_NO_BUFFERS = {AMAX_BUFFER: _NO_AMAX}


def plan_linear(layer: nn.Module, weight: torch.Tensor) -> LinearPlan:
    """What `quantized_linear(layer, x, weight)` would do, decided now: skip a disabled quantizer, take a held
    weight as it is, call a weight's cache or a fast input quantizer's forward directly. Any state whose
    changes the plan could miss (an untracked quantizer: the cache turned off; an enabled output quantizer;
    a slow input quantizer; a disabled one that still scales or rotates; a hook) gets a plan that sends every
    call to `quantized_linear`, until the next change (a removed hook is noticed there, not looked for at every
    call)."""
    quantizers = layer._modules
    weight_quantizer, input_quantizer, output_quantizer = (quantizers.get(name) for name in
                                                           ("weight_quantizer", "input_quantizer", "output_quantizer"))
    key = (weakref.ref(weight), tensor_version(weight), QUANTIZER_CHANGES.value)
    checks_each_call = LinearPlan(*key, _NO_AMAX, 0, _NO_BUFFERS, (), False, None, None)
    if isinstance(weight_quantizer, PackedWeightMixin) or not all(q is None or isinstance(q, TracksQuantizerChanges)
               for q in (weight_quantizer, input_quantizer, output_quantizer)):
        return checks_each_call
    hooks, amax, buffers, weight_fn, input_fn = [*_GLOBAL_HOOKS], _NO_AMAX, _NO_BUFFERS, None, None
    if weight_quantizer is not None:
        if isinstance(weight_quantizer, WeightCacheMixin) and weight_quantizer.holds(weight):
            amax, buffers = weight_quantizer._qarl_held.amax, weight_quantizer._buffers
            hooks += hook_tables(weight_quantizer)
        elif quantizer_enabled(weight_quantizer):
            weight_fn = weight_quantizer.forward
            hooks += hook_tables(weight_quantizer)
        elif not _is_identity(weight_quantizer):
            return checks_each_call
    if input_quantizer is not None:
        if quantizer_enabled(input_quantizer):
            if not isinstance(input_quantizer, FastInputMixin):
                return checks_each_call
            input_fn = input_quantizer.forward
            hooks += hook_tables(input_quantizer)
        elif not _is_identity(input_quantizer):
            return checks_each_call
    if output_quantizer is not None and not _is_identity(output_quantizer) or any(hooks):
        return checks_each_call
    return LinearPlan(*key, amax, tensor_version(amax), buffers, tuple(hooks), True, weight_fn, input_fn)


def current_plan(layer: nn.Module, weight: torch.Tensor) -> LinearPlan:
    """The layer's `LinearPlan`, made again if anything it rests on changed since."""
    plan = layer.__dict__.get("_qarl_plan")
    if (plan is None or plan.weight() is not weight or plan.version != tensor_version(weight)
            or plan.changes != QUANTIZER_CHANGES.value or tensor_version(plan.amax) != plan.amax_version
            or plan.buffers.get(AMAX_BUFFER) is not plan.amax or any(plan.hooks)):
        plan = layer.__dict__["_qarl_plan"] = plan_linear(layer, weight)
    return plan


def lean_forward(self: nn.Module, input: torch.Tensor) -> torch.Tensor:
    """`quantized_linear` through the layer's `LinearPlan`, checked in one frame: this runs at every linear
    layer of every forward. Traced into a compiled graph (`policy.compile_layers`) only where the plan is a plain
    matmul of the weight parameter as it is (a weight that holds its quantized value: mixed precision), as
    `mark_plain_linears` found it before this forward; any other plan runs eagerly between the graphs, so fake
    quantization and its straight-through gradient stay the eager path's and no plan state is guarded."""
    if torch.compiler.is_compiling() and self._qarl_plain:
        return F.linear(input, self._parameters["weight"], self._parameters.get("bias"))
    return planned_linear(self, input)


@torch.compiler.disable
def planned_linear(self: nn.Module, input: torch.Tensor) -> torch.Tensor:
    weight = self._parameters["weight"]
    plan = current_plan(self, weight)
    if not plan.lean:
        return quantized_linear(self, input, weight)
    if plan.input_fn is not None:
        input = plan.input_fn(input)
    if plan.weight_fn is not None:
        weight = plan.weight_fn(weight)
    return F.linear(input, weight, self._parameters.get("bias"))


def linear_weight(layer: nn.Module) -> torch.Tensor | None:
    """The tensor that `layer(x)` is exactly `F.linear(x, tensor)` with, no bias and no hook on the layer: a plain
    nn.Linear's weight; a lean quantized layer's whose plan passes the input as it is and multiplies the weight
    parameter as it is (every quantizer disabled, or a held weight); a layer with ModelOpt's own forward whose
    quantizers all pass their tensor as it is (the weight cache turned off). None for any other layer: it computes
    its own way (callers then call it)."""
    from modelopt.torch.quantization.nn import SequentialQuantizer, TensorQuantizer

    if (not isinstance(layer, nn.Module) or "forward" in layer.__dict__ or compiled_in_place(layer)
            or layer._parameters.get("bias") is not None or not _no_hooks(layer)):
        return None  # a forward of its own on the instance (compiled, patched), a bias or a hook
    weight = layer._parameters.get("weight")
    if weight is None:
        return None
    if type(layer) is nn.Linear:
        return weight
    if has_lean_forward(layer):  # not an adapter's forward over it
        return weight if current_plan(layer, weight).plain else None
    modelopt_linear = quant_linear_class()
    if (isinstance(layer, modelopt_linear) and isinstance(layer, nn.Linear)
            and type(layer).forward is modelopt_linear.forward and not forward_patched_before_conversion(layer)):
        quantizers = [layer._modules.get(name) for name in ("input_quantizer", "weight_quantizer", "output_quantizer")]
        if all(q is None or (isinstance(q, TensorQuantizer) and not isinstance(q, SequentialQuantizer)
                             and _is_identity(q) and _no_hooks(q)) for q in quantizers):
            return weight
    return None


def has_lean_forward(module: nn.Module) -> bool:
    """`module` is a lean linear layer that runs `lean_forward` (no adapter's forward over it, none of its own)."""
    return isinstance(module, LeanLinear) and type(module).forward is lean_forward and "forward" not in module.__dict__


class LeanLinear:
    """Mixed into a quantized linear layer's class (see `enable_lean_forward`)."""

    forward = lean_forward
    _qarl_plain = False  # its plan was a plain matmul of the weight parameter at the decoder's last call

    def __setattr__(self, name: str, value) -> None:
        if isinstance(value, nn.Module) or name in self._modules:  # a quantizer replaced: plan again
            self.__dict__.pop("_qarl_plan", None)
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        self.__dict__.pop("_qarl_plan", None)
        super().__delattr__(name)

    def add_module(self, name: str, module: nn.Module | None) -> None:
        self.__dict__.pop("_qarl_plan", None)  # `register_module` too; `_modules[name] = q` is not seen
        super().add_module(name, module)

    def __getstate__(self) -> dict:
        """A copy plans anew: a plan names this layer's tensors and the process's hook tables."""
        state = dict(super().__getstate__())
        state.pop("_qarl_plan", None)
        return state


class LeanEmbedding:
    """Mixed into ModelOpt's quantized embedding class (see `enable_lean_forward`): its lookup from the
    table through the weight quantizer, then the output quantizer, as ModelOpt's forward computes it
    (without its dynamic `weight` attribute and context manager, for quantizers that every shipped format
    leaves disabled)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        quantizers = self._modules
        weight = quantized_weight(quantizers.get("weight_quantizer"), self._parameters["weight"])
        output = F.embedding(input, weight, self.padding_idx, None, self.norm_type, self.scale_grad_by_freq, self.sparse)
        return quantized_output(quantizers.get("output_quantizer"), output)


def enable_lean_forward(model: nn.Module) -> int:
    """Give every plain quantized linear and embedding layer of `model` the lean forward; returns how many.
    A layer whose forward something else replaced, whose quantizer is a sequence of them, or an embedding
    that renormalizes its table in place (`max_norm`), keeps ModelOpt's forward."""
    from modelopt.torch.quantization.nn import SequentialQuantizer, TensorQuantizer

    kinds = ((quant_linear_class(), nn.Linear, LeanLinear), (quant_embedding_class(), nn.Embedding, LeanEmbedding))
    count = 0
    for module in model.modules():
        quantizers = [getattr(module, q, None) for q in ("input_quantizer", "weight_quantizer", "output_quantizer")]
        for quant_cls, torch_cls, lean in kinds:
            plain = (isinstance(module, quant_cls) and isinstance(module, torch_cls)
                     and type(module).forward in (quant_cls.forward, lean.forward)
                     and not forward_patched_before_conversion(module) and getattr(module, "max_norm", None) is None
                     and all(isinstance(q, TensorQuantizer) and not isinstance(q, SequentialQuantizer) for q in quantizers))
            if plain:
                mix_in(module, lean, "Lean", globals())
                if lean is LeanLinear and quantizers[2] is not None:
                    track_changes(quantizers[2])  # its plans skip the (disabled) output quantizer
                count += 1
    return count


class SharedInput:
    """The quantized input of fused siblings: q/k/v (and gate/up) read one tensor and, once calibrated,
    hold one amax (`share_fused_amax`), so the first of them to run computes what the others would, and
    they take it. The output is reused only while the tensor is the same object at the same version, for
    the same grad mode, and every sibling's amax is verified equal (compared by value once after each
    change of any of them, read through versions and generations in between)."""

    def __init__(self, members: list[FastInputMixin]):
        self.members = members
        self._verified: tuple | None = None
        self._forget()

    def _forget(self) -> None:
        self.source: torch.Tensor | None = None
        self.output: torch.Tensor | None = None
        self.left = 0

    def _amax_equal(self) -> bool:
        """Every sibling holds an amax of the same value and quantizes the same way, gradient included."""
        key = []  # (generation, amax address, amax version) of each sibling: read at every take
        for member in self.members:
            amax = amax_buffer(member)
            if amax is None:
                return False  # a sibling never calibrated (or disabled before calibration): nothing to share
            key.append((member._qarl_generation, amax.data_ptr(), tensor_version(amax)))
        verified = self._verified
        if verified is None or verified[0] != key:
            first, amax = self.members[0], amax_buffer(self.members[0])
            same = all(m._qarl_plan()[0] == first._qarl_plan()[0] and pass_through_bwd(m) == pass_through_bwd(first)
                       and torch.equal(amax_buffer(m), amax) for m in self.members[1:])
            verified = self._verified = (key, same)
        return verified[1]

    def take(self, inputs: torch.Tensor, grad: bool) -> torch.Tensor | None:
        if self.left == 0 or self.source is not inputs or self.version != tensor_version(inputs) or self.grad != grad \
                or not self._amax_equal():
            return None
        output = self.output
        self.left -= 1
        if self.left == 0:
            self._forget()  # every sibling has it: hold no activation past this forward
        return output

    def give(self, inputs: torch.Tensor, grad: bool, output: torch.Tensor) -> None:
        self.source, self.version, self.grad, self.output = inputs, tensor_version(inputs), grad, output
        self.left = len(self.members) - 1


class FastInputMixin(TracksQuantizerChanges):
    """Mixed into an input quantizer's class (see `enable_fast_inputs`): ModelOpt's forward as its one op."""

    # (generation, amax tensor, its InputQuant, the GPU kernel bound to it): what `_qarl_plan` last found
    _qarl_fast: tuple[int, torch.Tensor | None, InputQuant | None, BoundFakeQuant | None] = (-1, None, None, None)
    _qarl_shared: SharedInput | None = None

    def _qarl_plan(self) -> tuple[InputQuant | None, BoundFakeQuant | None]:
        """How this quantizer fake-quantizes once calibrated (None: not a plain NVFP4 / FP8 per-tensor
        one) and, with its amax on a GPU, the kernel bound to that amax; found again after any change
        of the quantizer (its generation) or of its amax tensor (`module.to(device)` replaces buffers)."""
        generation, held, spec, bound = self._qarl_fast
        amax = amax_buffer(self)
        if generation != self._qarl_generation or held is not amax:
            spec = calibrated_spec(self)
            bound = bound_fake_quant(amax, spec) if spec is not None else None
            self._qarl_fast = (self._qarl_generation, amax, spec, bound)
        return spec, bound

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        spec, bound = self._qarl_plan()
        if (spec is None or not quantizing(self) or type(inputs) is not torch.Tensor
                or pre_quant_scale(self) is not None or torch.compiler.is_compiling()):
            return super().forward(inputs)
        grad = torch.is_grad_enabled() and inputs.requires_grad
        shared = self._qarl_shared
        if shared is not None and (output := shared.take(inputs, grad)) is not None:
            return output
        quantized = bound(inputs) if bound is not None else None  # the kernel reads x's memory, outside autograd
        if quantized is None:
            quantized = fake_quant_eager(inputs.detach(), amax_buffer(self).to(inputs.device), spec)
        output = quantized
        if grad:
            amax = None if pass_through_bwd(self) else amax_buffer(self).to(inputs.device)
            output = StraightThrough.apply(inputs, quantized, amax)
        if shared is not None:
            shared.give(inputs, grad, output)
        return output


def enable_fast_inputs(model: nn.Module, fused_groups: Iterable[list[nn.Module]] = ()) -> int:
    """Give every (single) input quantizer of `model` the fast path, and the input quantizers of each
    group of fused sibling layers (`fused_groups`: q/k/v, gate/up) one `SharedInput`; returns how many."""
    count = 0
    for quantizer in single_quantizers(model, "input_quantizer"):
        mix_in(quantizer, FastInputMixin, "Fast", globals())
        count += 1
    for members in fused_groups:
        quantizers = [getattr(m, "input_quantizer", None) for m in members]
        if all(isinstance(q, FastInputMixin) for q in quantizers):
            shared = SharedInput(quantizers)
            for quantizer in quantizers:
                quantizer._qarl_shared = shared
    return count


_ATTENTION_QUANTIZERS = ("q_bmm_quantizer", "k_bmm_quantizer", "v_bmm_quantizer", "p_bmm_quantizer")


class LeanAttention:
    """Mixed into ModelOpt's quantized attention class (see `enable_lean_attention`)."""

    _qarl_attention_cls: type

    def forward(self, *args, **kwargs):
        quantizers = self._modules
        for name in _ATTENTION_QUANTIZERS:  # a loop, not any(): this runs at every layer of every forward
            quantizer = quantizers.get(name)
            if quantizer is not None and not _is_identity(quantizer):
                return super().forward(*args, **kwargs)
        return self._qarl_attention_cls.forward(self, *args, **kwargs)

    def __getattr__(self, name: str):
        """A submodule (`self.q_proj` in the attention's forward) straight from `_modules`: ModelOpt's
        dynamic-module lookup builds a set of its hyperparameter names at every access, and
        has no dynamic attribute of these names (checked where this is installed)."""
        module = self.__dict__.get("_modules", {}).get(name)
        return module if module is not None else super().__getattr__(name)


def mark_plain_linears(decoder: nn.Module) -> int:
    """Before each call of `decoder` whose layers are compiled: note on each lean linear layer whether its plan is a
    plain matmul of its weight parameter (`_qarl_plain`, read where `lean_forward` is traced). The compiler guards
    on the note, so a layer whose plan changes (a hold ended, a quantizer switched) gets a graph that calls it
    eagerly. Returns how many layers are noted (none: no hook)."""
    count = sum(has_lean_forward(m) for m in decoder.modules())
    if count:
        decoder.register_forward_pre_hook(_mark_plain_linears)
    return count


def _mark_plain_linears(decoder: nn.Module, args: tuple) -> None:
    for layer in decoder.modules():
        if has_lean_forward(layer):
            plain = current_plan(layer, layer._parameters["weight"]).plain
            if layer.__dict__.get("_qarl_plain", False) != plain:  # written on a change only: no guard churn
                layer.__dict__["_qarl_plain"] = plain


def traced_quantized_modules(module: nn.Module) -> list[str]:
    """The quantized submodules of `module` whose forward torch.compile would trace into a compiled graph: every one
    but the lean linear layers (eager between the graphs, or a plain matmul: `lean_forward`) and lean attention whose
    quantizers all pass their tensors through (it then runs the model's own attention). ModelOpt's own forwards (the
    weight cache off, a quantizer sequence, enabled attention quantizers) and forwards patched onto a layer are among
    them: compiled, their fake quantization could round otherwise than the rollout engine's."""
    from modelopt.torch.quantization.nn import TensorQuantizer

    traced = []
    for name, sub in module.named_modules():
        if isinstance(sub, TensorQuantizer) or not any(isinstance(q, TensorQuantizer) for q in sub.children()):
            continue
        if has_lean_forward(sub):
            continue
        if isinstance(sub, LeanAttention) and all(
                _is_identity(q) for q in (sub._modules.get(n) for n in _ATTENTION_QUANTIZERS) if q is not None):
            continue
        traced.append(name)
    return traced


def enable_lean_attention(model: nn.Module) -> int:
    """Give every ModelOpt-wrapped Hugging Face attention module the lean forward; returns how many."""
    attention_cls = quant_attention_class()
    count = 0
    for module in model.modules():
        if isinstance(module, attention_cls) and type(module).forward in (attention_cls.forward, LeanAttention.forward):
            if set(module._modules) & managed_attribute_names(module):
                continue  # a submodule name ModelOpt also manages: leave its lookup alone
            original = module.get_original_cls_by_level(level=0)
            mix_in(module, LeanAttention, "Lean", globals())
            module.__dict__["_qarl_attention_cls"] = original
            count += 1
    return count

