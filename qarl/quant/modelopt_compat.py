"""ModelOpt's private internals that qarl relies on, each behind one named function: the one place to look
when ModelOpt changes them.

qarl reads and writes ModelOpt's TensorQuantizer state directly where its fast paths need a switch without the
public property's cost, overrides two of its kernels' ops, and reuses a few classes and helpers ModelOpt does not
export. Each docstring ends with where its internal was checked: ModelOpt 0.47.0 on CPU (torch 2.13) and/or on an
H100 GPU (torch 2.11). Importing this module refuses another ModelOpt series (QARL_ALLOW_UNTESTED_VERSIONS=1 makes
it a warning).
ModelOpt itself is imported only inside the functions that need it (importing qarl.quant stays light); the
accessors called at every forward are plain attribute reads.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
import threading
import warnings
from collections.abc import Callable

import torch

from qarl.torch_compat import require_tested_version

# Every private ModelOpt name (class, function, op, module global or attribute) used through this module;
# nowhere else in qarl.
PRIVATE_NAMES: frozenset[str] = frozenset({
    # classes and helpers ModelOpt does not export
    "_QuantLinear", "_QuantEmbedding", "_QuantAttention", "StaticBlockScaleQuantizer", "CalibrateModeRegistry",
    "_name2descriptor", "preprocess_linear_fusion", "_get_dm_attribute_manager", "_forward_pre_dm",
    "functionals_to_replace",
    # TensorQuantizer state
    "_disabled", "_if_quant", "_if_calib", "_pass_through_bwd", "_amax", "_pre_quant_scale",
    "_enable_pre_quant_scale", "_dynamic", "_use_constant_amax", "_is_static_block_scale_quantizer", "_get_amax",
    "_amax_setter_helper",
    # the fake-quant ops, their implementations and the switches that choose ModelOpt's kernels
    "dynamic_block_quantize_op", "quantize_op", "_dynamic_block_quantize_impl", "_quantize_impl",
    "_save_for_backward_if_needed", "_fake_quant_backward_function", "static_blockwise_fp4_fake_quant",
    "DISABLE_TRITON_KERNEL", "IS_AVAILABLE", "fp4_fake_quant_block", "get_cuda_ext_fp8",
})

TESTED_VERSIONS = ("0.47",)  # ModelOpt release series these internals were checked against


def _installed_version() -> str | None:
    """`modelopt.__version__` (the installed distribution's version, which ModelOpt reports), read without
    importing ModelOpt; None where it is not installed."""
    try:
        return importlib.metadata.version("nvidia-modelopt")
    except importlib.metadata.PackageNotFoundError:
        return None


_VERSION = _installed_version()
if _VERSION is not None:
    require_tested_version("nvidia-modelopt", _VERSION, ".".join(_VERSION.split(".")[:2]) in TESTED_VERSIONS,
                           ", ".join(f"{v}.x" for v in TESTED_VERSIONS))


def import_modelopt() -> None:
    """Import ModelOpt's quantization package, once, on a thread of its own. Some libraries it imports keep the
    errors of their optional imports with the errors' tracebacks (pulp, ModelOpt's solver: each missing solver's, on
    the solver's class; vLLM's audio module, through ModelOpt's vLLM plugin: torchcodec's), and a traceback holds
    every frame that was on the stack at that import. Imported from a caller's stack, whatever those frames held when
    they returned was never freed: the first quantized policy a process built, where that build imported ModelOpt
    (a benchmark's engines, a notebook's policies). A thread of its own has none of the caller's frames on its stack.
    Checked: ModelOpt 0.47.0 with pulp 3.3.2 and vLLM 0.32.0, CPU."""
    if "modelopt.torch.quantization" in sys.modules:
        return
    failure: list[BaseException] = []

    def run() -> None:
        try:
            importlib.import_module("modelopt.torch.quantization")
        except BaseException as e:  # raised again in the caller's thread
            failure.append(e)

    thread = threading.Thread(target=run, name="qarl: importing ModelOpt")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]


# --- classes and helpers ModelOpt does not export ---------------------------------------------------------


def quant_linear_class() -> type:
    """ModelOpt's quantized-linear base class (`_QuantLinear`), which every quantized nn.Linear derives from.
    Checked: 0.47.0, CPU and H100."""
    from modelopt.torch.quantization.nn.modules.quant_linear import _QuantLinear

    return _QuantLinear


def quant_embedding_class() -> type:
    """ModelOpt's quantized-embedding class (`_QuantEmbedding`). Checked: 0.47.0, CPU and H100."""
    from modelopt.torch.quantization.nn.modules.quant_embedding import _QuantEmbedding

    return _QuantEmbedding


def quant_attention_class() -> type:
    """ModelOpt's wrapper of Hugging Face attention modules (`plugins.huggingface._QuantAttention`).
    Checked: 0.47.0, CPU and H100."""
    from modelopt.torch.quantization.plugins.huggingface import _QuantAttention

    return _QuantAttention


def expert_weight_quantizers(module: torch.nn.Module, fused: str) -> torch.nn.ModuleList | None:
    """The per-expert weight quantizers ModelOpt's fused-experts wrapper (`_QuantFusedExperts`, transformers 5's
    3-D expert weights) puts beside the fused parameter `fused` (`<fused>_weight_quantizers`, one a expert, each
    applied to that expert's slice), or None for another module. Checked: 0.47.0 (CPU)."""
    found = module._modules.get(f"{fused}_weight_quantizers")
    return found if isinstance(found, torch.nn.ModuleList) else None


def expert_index_of(module: torch.nn.Module, weight: torch.Tensor) -> int:
    """The expert whose slice of the fused gate/up parameter `weight` is, as ModelOpt's fused-experts wrapper reads it
    in the forward to pick that expert's weight quantizer (`_QuantFusedExperts._get_expert_idx_from_first_proj`: the
    slice's storage offset over the parameter's stride along the experts). A packed experts placeholder must keep that
    readable (qarl/quant/packed.py). Checked: 0.47.0 (CPU)."""
    return int(module._get_expert_idx_from_first_proj(weight))


def calibration_mode_names() -> list[str]:
    """The names ModelOpt's calibration algorithms are registered under (`CalibrateModeRegistry._name2descriptor`
    keys: "max_calibrate", "mse_calibrate", ..., and private ones starting with "_"). Checked: 0.47.0, CPU and H100."""
    from modelopt.torch.quantization.mode import CalibrateModeRegistry

    return list(CalibrateModeRegistry._name2descriptor)


def to_static_block_quantizer(quantizer: torch.nn.Module, global_amax: torch.Tensor) -> None:
    """Turn `quantizer` into a static-block quantizer with `global_amax`, in place, as ModelOpt's MSE / 4-over-6
    calibration does (`StaticBlockScaleQuantizer.from_tensor_quantizer`: a class swap).
    Checked: 0.47.0, CPU and H100."""
    from modelopt.torch.quantization.nn.modules.tensor_quantizer import StaticBlockScaleQuantizer

    StaticBlockScaleQuantizer.from_tensor_quantizer(quantizer, global_amax)


def resmooth_fused(members: list[torch.nn.Module]) -> None:
    """Give fused sibling layers one AWQ/SmoothQuant input scale, by ModelOpt's export step
    (`export.quant_utils.preprocess_linear_fusion`, resmooth only): the mean scale, each weight rescaled and its
    amax recollected. Checked: 0.47.0, CPU and H100."""
    from modelopt.torch.export.quant_utils import preprocess_linear_fusion

    preprocess_linear_fusion(members, resmooth_only=True)


def forward_patched_before_conversion(module: torch.nn.Module) -> bool:
    """`module`'s forward was replaced before ModelOpt converted it (ModelOpt keeps it as `_forward_pre_dm`).
    Checked: 0.47.0, CPU and H100."""
    return hasattr(module, "_forward_pre_dm")


def swaps_functions_in_forward(model: torch.nn.Module) -> bool:
    """A module of `model` replaces a torch function while its forward runs (its `functionals_to_replace`: the
    fused experts' `F.linear`, which they call once per expert). ModelOpt's `replace_function` puts the function
    back after the forward returns, not when it raises, so an exception inside such a forward leaves the function
    replaced for the rest of the process. (Some classes give a generator: each is iterated, not tested for truth.)
    Checked: 0.47.0 on CPU and on an H200 (a checkpointed qlora run of a Qwen3-MoE shape, before and after)."""
    return any(any(True for _ in getattr(module, "functionals_to_replace", None) or ()) for module in model.modules())


def managed_attribute_names(module: torch.nn.Module) -> set[str]:
    """The attribute names a ModelOpt dynamic module answers itself (its attribute manager's hyperparameter,
    dynamic-attribute and attribute keys, `_get_dm_attribute_manager()`). Checked: 0.47.0, CPU and H100."""
    manager = module._get_dm_attribute_manager()
    return manager.hp_keys() | manager.da_keys() | manager.attr_keys()


# --- TensorQuantizer state, read where qarl's fast paths need it at every forward ------------------------


def quantizer_enabled(quantizer: torch.nn.Module) -> bool:
    """`quantizer.is_enabled`, read from the instance's `_disabled` switch where a TensorQuantizer keeps it (a
    container of quantizers answers through its property). Checked: 0.47.0, CPU and H100."""
    disabled = quantizer.__dict__.get("_disabled")
    return quantizer.is_enabled if disabled is None else not disabled


def quantizing(quantizer: torch.nn.Module) -> bool:
    """The quantizer is enabled, quantizes and is not collecting calibration statistics (its `_disabled`,
    `_if_quant` and `_if_calib` switches, which ModelOpt also writes directly). Checked: 0.47.0, CPU and H100."""
    return not quantizer._disabled and quantizer._if_quant and not quantizer._if_calib


def pass_through_bwd(quantizer: torch.nn.Module) -> bool | None:
    """Its straight-through backward passes every gradient (`_pass_through_bwd`) rather than zeroing it where
    |x| > amax; None for an object without the setting. Checked: 0.47.0, CPU and H100."""
    return getattr(quantizer, "_pass_through_bwd", None)


def clipping_amax(quantizer: torch.nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    """The amax ModelOpt's forward uses for `inputs` (`_get_amax`), where its clipping backward zeroes gradients.
    Checked: 0.47.0, CPU and H100."""
    return quantizer._get_amax(inputs)


AMAX_BUFFER = "_amax"  # the name of a TensorQuantizer's amax buffer among its module buffers


def amax_buffer(quantizer: torch.nn.Module) -> torch.Tensor | None:
    """The registered amax buffer (`AMAX_BUFFER`), None without one. Calibration and state loads write it
    through `.data`; `module.to` replaces it. Checked: 0.47.0, CPU and H100."""
    return quantizer._buffers.get(AMAX_BUFFER)


def amax_tensor(quantizer: torch.nn.Module) -> torch.Tensor | None:
    """The amax ModelOpt's forward reads (`_amax`: the buffer, or a parameter where ModelOpt learns it).
    Checked: 0.47.0, CPU and H100."""
    return getattr(quantizer, "_amax", None)


def pre_quant_scale(quantizer: torch.nn.Module) -> torch.Tensor | None:
    """ModelOpt's `quantizer.pre_quant_scale` (AWQ / SmoothQuant's input scale), read from the module's buffers
    (`_pre_quant_scale`, `_enable_pre_quant_scale`): the property's `hasattr` costs an AttributeError through
    nn.Module's __getattr__ on every quantizer without one, at every forward. Checked: 0.47.0, CPU and H100."""
    scale = quantizer._buffers.get("_pre_quant_scale")
    return scale if scale is not None and quantizer._enable_pre_quant_scale else None


def has_pre_quant_scale_buffer(quantizer: torch.nn.Module) -> bool:
    """A smoothing scale buffer is registered (`_pre_quant_scale`), applied or not. Checked: 0.47.0, CPU and H100."""
    return "_pre_quant_scale" in quantizer._buffers


def is_dynamic(quantizer: torch.nn.Module) -> bool:
    """Its amax is computed from each input (`_dynamic`), not calibrated. Checked: 0.47.0, CPU and H100."""
    return quantizer._dynamic


def uses_constant_amax(quantizer: torch.nn.Module) -> bool:
    """Its amax is pinned to a configured constant (`_use_constant_amax`). Checked: 0.47.0, CPU and H100."""
    return getattr(quantizer, "_use_constant_amax", False)


def is_static_block_quantizer(quantizer: torch.nn.Module) -> bool:
    """ModelOpt made it a static-block quantizer (`_is_static_block_scale_quantizer`): per-block amax
    calibrated, and a global amax. Checked: 0.47.0, CPU and H100."""
    return getattr(quantizer, "_is_static_block_scale_quantizer", False)


class AnnouncesAmaxWrites:
    """Base of a TensorQuantizer mixin that must hear of ModelOpt's amax writes: the `amax` setter's body
    (`_amax_setter_helper`) registers the buffer or writes it through `.data` (no version bump). Calls
    `self._qarl_bump()` (the mixin's change announcement) after ModelOpt's own. Checked: 0.47.0, CPU and H100."""

    def _amax_setter_helper(self, value) -> None:
        super()._amax_setter_helper(value)
        self._qarl_bump()


# --- the fake-quant ops and their kernels -----------------------------------------------------------------

NVFP4_OP_ARGS = (4, 2, 8, 4)  # the NVFP4 op's num_bits, exponent_bits, scale_num_bits, scale_exponent_bits


def dynamic_block_quantize(x: torch.Tensor, block_size: int, amax: torch.Tensor, num_bits: int, exponent_bits: int,
                           scale_num_bits: int, scale_exponent_bits: int) -> torch.Tensor:
    """ModelOpt's block fake-quant op `tensorrt::dynamic_block_quantize_op` (NVFP4 with `NVFP4_OP_ARGS`): what
    TensorQuantizer.forward of a dynamic-block quantizer ends in. A registered op: it traces into compiled graphs.
    Checked: 0.47.0, CPU and H100."""
    return torch.ops.tensorrt.dynamic_block_quantize_op(x, block_size, amax, num_bits, exponent_bits,
                                                        scale_num_bits, scale_exponent_bits)


def scaled_quantize(x: torch.Tensor, amax: torch.Tensor, num_bits: int, exponent_bits: int, unsigned: bool,
                    narrow_range: bool) -> torch.Tensor:
    """ModelOpt's fake-quant op `tensorrt::quantize_op` (FP8 E4M3 with num_bits 8, exponent_bits 4).
    Checked: 0.47.0, CPU and H100."""
    return torch.ops.tensorrt.quantize_op(x, amax, num_bits, exponent_bits, unsigned, narrow_range)


_MODULES: tuple | None = None  # (modelopt.torch.quantization.tensor_quant, modelopt.torch.kernels.quantization.gemm)


def _modules() -> tuple:
    """ModelOpt's tensor_quant module (importing it registers the ops and their kernels) and its Triton kernel
    module, imported at the first call."""
    global _MODULES
    if _MODULES is None:
        import modelopt.torch.kernels.quantization.gemm as gemm
        from modelopt.torch.quantization import tensor_quant

        _MODULES = (tensor_quant, gemm)
    return _MODULES


def modelopt_dynamic_block_quantize(x: torch.Tensor, block_size: int, amax: torch.Tensor,
                                    *args: int) -> torch.Tensor:
    """ModelOpt's own implementation of the block op (`tensor_quant._dynamic_block_quantize_impl`, looked up at
    each call), for operands qarl's kernels leave to it. Checked: 0.47.0, CPU and H100."""
    return _modules()[0]._dynamic_block_quantize_impl(x, block_size, amax, *args)


def modelopt_scaled_quantize(x: torch.Tensor, amax: torch.Tensor, num_bits: int, exponent_bits: int, unsigned: bool,
                             narrow_range: bool) -> torch.Tensor:
    """ModelOpt's own implementation of `tensorrt::quantize_op` (`tensor_quant._quantize_impl`, looked up at each
    call), for operands qarl's kernels leave to it. Checked: 0.47.0, CPU and H100."""
    return _modules()[0]._quantize_impl(x, amax, num_bits, exponent_bits, unsigned, narrow_range)


def override_op_kernels(dispatch_key: str, dynamic_block_quantize=None, quantize=None) -> torch.library.Library:
    """Register `dynamic_block_quantize` and `quantize` as the `dispatch_key` ("CPU", "CUDA") kernels of ModelOpt's
    two ops (`tensorrt::dynamic_block_quantize_op`, `tensorrt::quantize_op`; None: keep ModelOpt's), over the
    kernels ModelOpt registered; returns the library holding them (`qarl.torch_compat.destroy_library` gives
    ModelOpt's back). Checked: 0.47.0, CPU and H100."""
    _modules()  # defines the ops and their kernels
    library = torch.library.Library("tensorrt", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Overriding a previously registered kernel": intended
        if dynamic_block_quantize is not None:
            library.impl("dynamic_block_quantize_op", dynamic_block_quantize, dispatch_key, allow_override=True)
        if quantize is not None:
            library.impl("quantize_op", quantize, dispatch_key, allow_override=True)
    return library


def runs_triton_nvfp4() -> bool:
    """ModelOpt's NVFP4 fake quant on CUDA runs its Triton kernel (`gemm.fp4_fake_quant_block`, where
    `gemm.IS_AVAILABLE` and not `tensor_quant.DISABLE_TRITON_KERNEL`) rather than its CUDA extension: read at
    every call, as ModelOpt reads it. Only where triton is installed. Checked: 0.47.0, H100."""
    tensor_quant, gemm = _MODULES or _modules()
    return gemm.IS_AVAILABLE and hasattr(gemm, "fp4_fake_quant_block") and not tensor_quant.DISABLE_TRITON_KERNEL


def fp8_extension_missing() -> bool:
    """ModelOpt's FP8 fake quant runs its eager fallback, its CUDA extension not built here
    (`tensor_quant.get_cuda_ext_fp8`). Checked: 0.47.0, H100."""
    return (_MODULES or _modules())[0].get_cuda_ext_fp8(raise_if_failed=False) is None


def save_for_backward_if_needed(ctx, pass_through_bwd: bool, x: torch.Tensor, amax: torch.Tensor) -> None:
    """What ModelOpt's fake-quant autograd Functions save for their straight-through backward
    (`tensor_quant._save_for_backward_if_needed`). Checked: 0.47.0, CPU."""
    _modules()[0]._save_for_backward_if_needed(ctx, pass_through_bwd, x, amax)


def fake_quant_backward(ctx, grad: torch.Tensor, num_args: int) -> tuple:
    """ModelOpt's straight-through backward of its fake-quant Functions (`tensor_quant._fake_quant_backward_function`),
    for a forward of `num_args` arguments. Checked: 0.47.0, CPU."""
    return _modules()[0]._fake_quant_backward_function(ctx, grad, num_args=num_args)


def route_static_nvfp4(cpu: Callable[..., torch.Tensor]) -> None:
    """Send static-scale NVFP4 (ModelOpt's MSE / 4-over-6 weight formats) of CPU tensors to `cpu(x, *args)`:
    ModelOpt's quantizer calls a Triton-only function (`tensor_quantizer.static_blockwise_fp4_fake_quant`), kept
    for CUDA tensors. Checked: 0.47.0, CPU."""
    from modelopt.torch.quantization.nn.modules import tensor_quantizer

    triton_only = tensor_quantizer.static_blockwise_fp4_fake_quant

    def static_blockwise_fp4_fake_quant(x, *args):
        return (triton_only if x.is_cuda else cpu)(x, *args)

    tensor_quantizer.static_blockwise_fp4_fake_quant = static_blockwise_fp4_fake_quant
