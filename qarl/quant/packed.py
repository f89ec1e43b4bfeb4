"""Frozen fake-quantized weights kept as their codes: a QLoRA base (or any frozen quantized copy) in about a
quarter of the bytes, computing with the same bits.

A frozen layer's fake-quantized weight W_q = weight_quantizer(W) is exactly its codes times its scales
(qarl/quant/codes.py): NVFP4's E2M1 codes, E4M3 block scales and fp32 global scale (0.5625 bytes a parameter),
or FP8's E4M3 codes and fp32 scale (1 byte). `pack_frozen_weights` encodes each such weight once, checks that the
codes decode to W_q bit for bit, and frees the weight:

* the layer's `weight` parameter becomes a placeholder of the same shape, dtype and device that holds one NaN
  (zero strides: one element of memory), so code that computes with it unpacked gets NaN, never plausible numbers;
* its weight quantizer gains `PackedWeightMixin`, which answers a call with the placeholder by decoding the
  codes. Every reader that asks the quantizer for the weight (the forward, the refit fold, export, parity) gets
  W_q, the same bits as before;
* the layer's forward (`packed_linear`, through the lean forward's `quantized_linear`) decodes the weight again
  in the backward instead of saving it, so a decoded weight lives for one layer's matmul, forward or backward.

A Mixture-of-Experts layer's fused experts (`gate_up_proj` and `down_proj`, [experts, rows, columns]) pack expert by
expert with each expert's own quantizer; the fused parameter's placeholder holds one NaN an expert (stride 1 along the
experts), because ModelOpt's fused-experts forward tells an expert's quantizer by the slice's storage offset
(`modelopt_compat.expert_index_of`, checked at packing). That forward calls F.linear with the decoded weight, so
autograd keeps each routed expert's decoded weight for the backward (gradient checkpointing bounds it to one layer).

Frozen means frozen: the codes cannot be re-quantized with another amax (the wider weight is gone), so a packed
quantizer whose amax changes value, or that is disabled or put into calibration, stops with an error naming
`policy.lora.pack_base`. `unpack_frozen_weights` gives a model (a copy) real parameters back: W_q itself. A packed
model stays on its device and dtype: `.to()` would make each placeholder a tensor of NaNs (nothing in qarl moves a
policy after it is built). The backward decodes again only through `packed_linear`, which the lean forward calls
(`policy.quant_weight_cache`, on by default; `check_lora` refuses a packed base without it).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from qarl.quant.codes import FP8Weight, NVFP4Weight, decode_fp8, decode_nvfp4, encode_fp8, encode_nvfp4
from qarl.quant.formats import QuantFormat, quantizer_settings
from qarl.quant.mixins import TracksQuantizerChanges, mix_in, without_mixin
from qarl.models.experts import FUSED as FUSED_EXPERTS
from qarl.models.experts import is_fused_experts
from qarl.quant.modelopt_compat import amax_buffer, expert_index_of, expert_weight_quantizers, quantizing
from qarl.quant.ops import NVFP4, calibrated_spec
from qarl.torch_compat import tensor_version

CODES, BLOCK_SCALE, SCALE = "packed_codes", "packed_block_scale", "packed_scale"  # the quantizer's buffers


class Placeholder(nn.Parameter):
    """The frozen parameter a packed weight leaves behind: its shape, dtype and device, every element the one NaN
    it stores (fused experts: one an expert). A copy (`copy.deepcopy`) is another placeholder, not a materialized
    tensor of NaNs."""

    def __deepcopy__(self, memo: dict) -> Placeholder:
        memo[id(self)] = copy = placeholder(self.shape, self.dtype, self.device, experts=self.stride(0) != 0)
        return copy


def placeholder(shape: torch.Size, dtype: torch.dtype, device: torch.device, experts: bool = False) -> Placeholder:
    """`experts`: a fused experts parameter's ([experts, rows, columns]), whose slices stay told apart by their
    storage offsets."""
    stored = (shape[0],) + (1,) * (len(shape) - 1) if experts else (1,) * len(shape)
    nan = torch.full(stored, float("nan"), dtype=dtype, device=device)
    return Placeholder(nan.expand(shape), requires_grad=False)


def is_placeholder(tensor: torch.Tensor) -> bool:
    """`tensor` is a placeholder (or a view of one, `.detach()`, an expert's slice): one element behind every index
    (a fused experts placeholder: one an expert)."""
    strides = [s for s, n in zip(tensor.stride(), tensor.shape) if n > 1]  # a size-1 dimension's stride says nothing
    if tensor.dim() == 3 and tensor.shape[0] > 1 and tensor.stride(0) == 1:
        strides = strides[1:]
    return tensor.numel() > 1 and all(s == 0 for s in strides)


class PackedWeightMixin(TracksQuantizerChanges):
    """Mixed into the weight quantizer of a packed frozen layer (see the module docstring). Its codes are
    non-persistent buffers (they move with the model and count as its memory; checkpoints keep no base)."""

    _qarl_packed_kind: str  # NVFP4 or FP8
    _qarl_packed_kernel: str  # FP8: which of ModelOpt's kernels the codes reproduce
    _qarl_packed_dtype: torch.dtype  # the compute dtype W_q is decoded to
    _qarl_packed_amax: torch.Tensor  # a CPU copy of the amax the codes were encoded with
    _qarl_packed_seen: tuple[int, int, int] = (0, -1, -1)  # (id, version, quantizer generation) last checked

    def stored(self) -> NVFP4Weight | FP8Weight:
        """The codes and scales this quantizer decodes (export writes them as they are)."""
        buffers = self._buffers
        if self._qarl_packed_kind == NVFP4:
            return NVFP4Weight(buffers[CODES], buffers[BLOCK_SCALE], buffers[SCALE])
        return FP8Weight(buffers[CODES], buffers[SCALE], self._qarl_packed_kernel)

    def unpacked(self) -> torch.Tensor:
        """W_q, decoded now (bit for bit the weight this quantizer computed before packing)."""
        self._check_unchanged()
        stored = self.stored()
        if isinstance(stored, NVFP4Weight):
            return decode_nvfp4(stored, self._qarl_packed_dtype)
        return decode_fp8(stored, self._qarl_packed_dtype)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        if not is_placeholder(inputs):
            raise RuntimeError("this weight quantizer serves a packed frozen weight and was called with another "
                               "tensor: the layer's weight was replaced after packing. Build the policy with "
                               "policy.lora.pack_base=false to change frozen weights.")
        return self.unpacked()

    def _check_unchanged(self) -> None:
        """The quantizer still computes what the codes hold: quantizing, with the amax they were encoded with."""
        if not quantizing(self):
            raise RuntimeError("a packed frozen weight's quantizer was disabled or put into calibration; the "
                               "unquantized weight is gone. Set policy.lora.pack_base=false to disable or "
                               "recalibrate frozen weights.")
        amax = amax_buffer(self)
        # ModelOpt's amax setter writes through `.data` (no version bump) but is announced: the generation moves
        seen = None if amax is None else (id(amax), tensor_version(amax), self._qarl_generation)
        if seen is not None and seen == self._qarl_packed_seen:
            return
        if amax is None or not torch.equal(amax.detach().float().cpu(), self._qarl_packed_amax):
            raise RuntimeError("a packed frozen weight's amax was changed; its codes cannot be re-quantized (the "
                               "unquantized weight is gone). Set policy.lora.pack_base=false to change it.")
        self._qarl_packed_seen = seen


def stored_codes(quantizer: nn.Module) -> NVFP4Weight | FP8Weight | None:
    """A packed quantizer's codes; None for any other quantizer."""
    return quantizer.stored() if isinstance(quantizer, PackedWeightMixin) else None


class PackedLinear(torch.autograd.Function):
    """y = x W_q^T + b with W_q decoded from the codes in the forward and again in the backward: nothing of
    the weight is saved. The weight is frozen (no gradient); the input's gradient is F.linear's, the same bits."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, bias: torch.Tensor | None, quantizer: PackedWeightMixin) -> torch.Tensor:
        ctx.quantizer = quantizer
        ctx.bias_shape = None if bias is None else bias.shape
        return F.linear(x, quantizer.unpacked(), bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        grad_x = grad.matmul(ctx.quantizer.unpacked()) if ctx.needs_input_grad[0] else None
        grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.needs_input_grad[1] else None
        return grad_x, grad_bias, None


def packed_linear(x: torch.Tensor, quantizer: PackedWeightMixin, bias: torch.Tensor | None) -> torch.Tensor:
    """The linear layer of a packed weight (`x`: its input after its input quantizer)."""
    if torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)):
        return PackedLinear.apply(x, bias, quantizer)
    return F.linear(x, quantizer.unpacked(), bias)


NVFP4_SETTINGS = {"num_bits": [2, 1], "block_sizes": {"-1": 16, "type": "dynamic", "scale_bits": [4, 3]}}
FP8_SETTINGS = {"num_bits": [4, 3]}


def packed_bytes_per_weight(fmt: QuantFormat | None) -> float | None:
    """Bytes a linear layer's weight takes a parameter once packed under `fmt`, read from its config (the memory
    plan, before anything loads); None where the format's weights have no packed form."""
    settings = quantizer_settings(fmt).get("weight")  # (mixed formats: none packed)
    if settings == NVFP4_SETTINGS:
        return 0.5 + 1 / 16  # two E2M1 codes a byte, one E4M3 scale per 16
    if settings == FP8_SETTINGS:
        return 1.0
    return None


@dataclass
class PackReport:
    """What `pack_frozen_weights` did: weights packed, quantized frozen weights left as they were (a format
    without a packed form), and the bytes of the packed weights before and after."""

    packed: int = 0
    kept: list[str] = field(default_factory=list)
    bytes_before: int = 0
    bytes_after: int = 0

    def summary(self) -> str:
        line = (f"packed {self.packed} frozen quantized weights: {self.bytes_before / 2**20:.1f} MiB -> "
                f"{self.bytes_after / 2**20:.1f} MiB")
        if self.kept:
            line += (f"; {len(self.kept)} kept in the compute dtype (no packed form for their format, or an expert "
                     f"left unquantized: {self.kept[:3]})")
        return line


@dataclass
class _FrozenWeight:
    """A frozen parameter whose matrices quantizers quantize: a linear layer's weight (one quantizer), or a MoE layer's
    fused experts parameter (each expert's slice by that expert's quantizer)."""

    name: str
    module: nn.Module
    key: str  # the parameter's name in `module`
    quantizers: list[nn.Module]  # one a matrix

    @property
    def experts(self) -> bool:
        return self.key in FUSED_EXPERTS

    def matrices(self) -> list[torch.Tensor]:
        weight = self.module._parameters[self.key]
        return list(weight) if self.experts else [weight]


def _weight_quantizers(module: nn.Module) -> list[tuple[str, list[nn.Module | None]]]:
    """(parameter name, the quantizers of its matrices) of a module: fused experts' two parameters, one quantizer an
    expert; any other module's `weight` and its `weight_quantizer`."""
    if is_fused_experts(module):
        return [(fused, list(expert_weight_quantizers(module, fused) or [])) for fused in FUSED_EXPERTS]
    return [("weight", [module._modules.get("weight_quantizer")])]


def _frozen_quantized(model: nn.Module) -> Iterator[_FrozenWeight]:
    """Every frozen parameter of its own module that a quantizer quantizes (a fused experts parameter: one of its
    experts' at least; none packed yet)."""
    from modelopt.torch.quantization.nn import SequentialQuantizer, TensorQuantizer

    users: dict[int, int] = {}
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None:
                users[id(p)] = users.get(id(p), 0) + 1
    def plain(quantizer: nn.Module | None) -> bool:
        return (isinstance(quantizer, TensorQuantizer)
                and not isinstance(quantizer, (SequentialQuantizer, PackedWeightMixin)))

    for name, module in model.named_modules():
        for key, quantizers in _weight_quantizers(module):
            weight = module._parameters.get(key)
            frozen = isinstance(weight, nn.Parameter) and not weight.requires_grad and users[id(weight)] == 1
            if frozen and quantizers and all(map(plain, quantizers)) and any(map(quantizing, quantizers)):
                yield _FrozenWeight(f"{name}.{key}" if key in FUSED_EXPERTS else name, module, key, quantizers)


def _packable(quantizer: nn.Module, matrix: torch.Tensor) -> bool:
    """A matrix whose quantizer quantizes it in a format with a packed form (an expert left unquantized is not)."""
    if not quantizing(quantizer):
        return False
    spec = calibrated_spec(quantizer)
    return spec is not None and not (spec.kind == NVFP4 and spec.block_size != 16) and matrix.ndim == 2


def _pack_matrix(quantizer: nn.Module, matrix: torch.Tensor, name: str) -> int:
    """Encode W_q = quantizer(matrix) into `quantizer`'s buffers and make it answer with them; returns their bytes."""
    kind = calibrated_spec(quantizer).kind
    w_q = quantizer(matrix).detach()
    amax = amax_buffer(quantizer)
    stored = encode_nvfp4(w_q, matrix, amax, name) if kind == NVFP4 else encode_fp8(w_q, amax, name)
    mix_in(quantizer, PackedWeightMixin, "Packed", globals())
    if hasattr(quantizer, "qarl_invalidate"):
        quantizer.qarl_invalidate()  # the weight cache's copy of W_q goes
    if isinstance(stored, NVFP4Weight):
        tensors = {CODES: stored.packed, BLOCK_SCALE: stored.block_scale, SCALE: stored.global_scale}
    else:
        tensors = {CODES: stored.codes, SCALE: stored.scale}
        quantizer._qarl_packed_kernel = stored.kernel
    for key, value in tensors.items():
        quantizer.register_buffer(key, value.contiguous(), persistent=False)
    quantizer._qarl_packed_kind, quantizer._qarl_packed_dtype = kind, matrix.dtype
    quantizer._qarl_packed_amax = amax.detach().float().cpu().clone()
    return sum(t.numel() * t.element_size() for t in tensors.values())


@torch.no_grad()
def pack_frozen_weights(model: nn.Module) -> PackReport:
    """Store every frozen weight that a quantizer quantizes in a format with a packed form (NVFP4 with dynamic
    16-element blocks, FP8 per tensor) as its codes (see the module docstring), fused experts expert by expert;
    others are kept and named."""
    report = PackReport()
    staged: list[tuple[nn.Module, torch.device]] = []  # on a GPU: quantizers whose codes wait in host memory
    try:
        for frozen in list(_frozen_quantized(model)):
            _pack_frozen(frozen, report, staged)
    finally:  # (on an error too: no layer is left with its codes off its device)
        if staged:  # the freed weights' blocks go back to the device first; the codes then take fresh ones
            torch.cuda.empty_cache()
            for quantizer, device in staged:
                _move_codes(quantizer, device)
    return report


def _pack_frozen(frozen: _FrozenWeight, report: PackReport, staged: list[tuple[nn.Module, torch.device]]) -> None:
    """Pack one frozen parameter's matrices (or keep it, named in `report`) and free it; its own function so that no
    reference to the freed weight outlives it."""
    matrices = frozen.matrices()
    if not all(_packable(q, m) for q, m in zip(frozen.quantizers, matrices, strict=True)):
        report.kept.append(frozen.name)
        return
    for expert, (quantizer, matrix) in enumerate(zip(frozen.quantizers, matrices, strict=True)):
        report.bytes_after += _pack_matrix(quantizer, matrix, f"{frozen.name}[{expert}]" if frozen.experts
                                           else frozen.name)
        if matrix.is_cuda:
            staged.append((quantizer, matrix.device))
            _move_codes(quantizer, torch.device("cpu"))
    weight = frozen.module._parameters[frozen.key]
    frozen.module._parameters[frozen.key] = placeholder(weight.shape, weight.dtype, weight.device, frozen.experts)
    if frozen.key == FUSED_EXPERTS[0]:
        _check_experts_told_apart(frozen)
    report.packed += len(matrices)
    report.bytes_before += weight.numel() * weight.element_size()


def _move_codes(quantizer: nn.Module, device: torch.device) -> None:
    """A packed quantizer's codes and scales to `device`. On a GPU they wait in host memory until every weight is
    packed and the cache emptied: encoded in place, they would be carved out of blocks the caching allocator holds
    freed (calibration's activations, the weights packed before), and a block holding any of them never goes back to
    the device."""
    for key in (CODES, BLOCK_SCALE, SCALE):
        if key in quantizer._buffers:
            quantizer._buffers[key] = quantizer._buffers[key].to(device)


def _check_experts_told_apart(frozen: _FrozenWeight) -> None:
    """ModelOpt's fused-experts forward must still find each expert's quantizer from its placeholder slice."""
    for expert in {0, len(frozen.quantizers) - 1}:
        read = expert_index_of(frozen.module, frozen.module._parameters[frozen.key][expert])
        if read != expert:
            raise RuntimeError(f"{frozen.name}: ModelOpt reads expert {read} from the packed placeholder's slice of "
                               f"expert {expert}; this ModelOpt tells experts apart differently than the version "
                               "qarl was checked with (modelopt_compat.expert_index_of). Set "
                               "policy.lora.pack_base=false.")


def _unpack(quantizer: nn.Module) -> torch.Tensor:
    """W_q decoded, and `quantizer` a plain quantizer again."""
    weight = quantizer.unpacked()
    for key in (CODES, BLOCK_SCALE, SCALE):
        quantizer._buffers.pop(key, None)
    quantizer.__class__ = without_mixin(type(quantizer))
    return weight


@torch.no_grad()
def unpack_frozen_weights(model: nn.Module) -> int:
    """Give every packed layer of `model` a real weight again (W_q, decoded) and its quantizer its class back;
    returns how many matrices (an expert's fused gate/up counts one). For a copy that must change weights (a merged
    export, a decoded comparison)."""
    count = 0
    for module in model.modules():
        for key, quantizers in _weight_quantizers(module):
            if quantizers and all(isinstance(q, PackedWeightMixin) for q in quantizers):
                matrices = [_unpack(q) for q in quantizers]
                weight = torch.stack(matrices) if key in FUSED_EXPERTS else matrices[0]
                module._parameters[key] = nn.Parameter(weight, requires_grad=False)
                count += len(matrices)
    return count
