"""ModelOpt on the policy: insert fake quantizers, calibrate amax, share amax across fused siblings,
fold weights for the rollout engine, and save/restore the quantizer state.

The policy side's ModelOpt calls live here (its fast paths in qarl.quant.fastpath), so the rest of qarl
sees three verbs: `quantize_policy`, `folded_weights`, `quantizer_state`/`load_quantizer_state`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from qarl.config import ConfigError
from qarl.console import progress_bar
from qarl.quant import kernels
from qarl.quant.fastpath.lean_forward import enable_fast_inputs, enable_lean_attention, enable_lean_forward
from qarl.quant.fastpath.weight_cache import cache_kept, enable_weight_cache, invalidate
from qarl.quant.formats import (DECODER_LINEARS, NVFP4, SMOOTHING_ALGORITHMS, QuantFormat, bits_format, block_size,
                                insert_quantizers, quantized_meta_model)
from qarl.models.experts import FUSED as FUSED_EXPERTS
from qarl.models.experts import expert_layers, expert_weights, is_fused_experts
from qarl.quant.modelopt_compat import (expert_weight_quantizers, is_static_block_quantizer, pass_through_bwd,
                                        pre_quant_scale, resmooth_fused, to_static_block_quantizer)
from qarl.quant.packed import PackedWeightMixin

# Hugging Face projections that serving engines (vLLM, TensorRT-LLM) fuse into one matrix. Fused
# siblings must share one per-tensor amax for their weights and one for their inputs: the fused
# matrix has a single global scale. Keys are the fused names vLLM uses (its packed_modules_mapping).
FUSED_SIBLINGS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def _quantizer_modules():
    from modelopt.torch.quantization.nn import TensorQuantizer

    return TensorQuantizer


def quantized_linears(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(name, module) of every module ModelOpt gave a weight quantizer and that holds its own weight (not
    Megatron's output layer when it shares the embedding's)."""
    quantizer_cls = _quantizer_modules()
    for name, module in model.named_modules():
        if isinstance(getattr(module, "weight_quantizer", None), quantizer_cls) and getattr(module, "weight", None) is not None:
            yield name, module


def _fused_experts(model: nn.Module) -> Iterator[tuple[str, str, nn.Module, nn.ModuleList]]:
    """(the experts module's name and a dot, fused parameter name, the module, its per-expert weight quantizers,
    empty where ModelOpt gave it none) of each fused 3-D expert parameter of a Mixture-of-Experts model."""
    for name, module in model.named_modules():
        if is_fused_experts(module):
            for fused in FUSED_EXPERTS:
                yield f"{name}.", fused, module, expert_weight_quantizers(module, fused) or nn.ModuleList()


@dataclass
class QuantizedWeight:
    """One weight a format quantizes, under the name a checkpoint gives its layer (its tensors: `name + ".weight"`,
    ...): a linear layer's weight, or one expert's gate, up or down matrix, whose quantizer (that expert's) applies to
    the expert's whole fused slice (`whole`), of which this weight is `rows`."""

    name: str
    weight_quantizer: nn.Module
    input_quantizer: nn.Module | None
    whole: torch.Tensor
    rows: slice = field(default_factory=lambda: slice(None))

    @property
    def weight(self) -> torch.Tensor:
        """The unquantized weight (a view: writing it writes the model)."""
        return self.whole[self.rows]

    def quantized(self) -> torch.Tensor:
        """Q(W), as the quantized forward computes it."""
        return self.weight_quantizer(self.whole)[self.rows]


def quantized_weights(model: nn.Module) -> Iterator[QuantizedWeight]:
    """Every weight of `model` with an enabled weight quantizer: its linear layers' and, of a Mixture-of-Experts
    layer's fused experts, each expert's gate, up and down matrix by its checkpoint name (qarl/models/experts.py)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    for prefix, fused, module, quantizers in _fused_experts(model):
        for expert, quantizer in enumerate(quantizers):
            if quantizer.is_enabled:
                whole = module._parameters[fused][expert]
                inputs = module._modules.get(f"{fused}_input_quantizer")
                for layer, rows in expert_layers(prefix, fused, expert, whole.shape[0], model_type):
                    yield QuantizedWeight(layer, quantizer, inputs, whole, rows)
    for name, module in quantized_linears(model):
        if module.weight_quantizer.is_enabled:
            yield QuantizedWeight(name, module.weight_quantizer, module._modules.get("input_quantizer"),
                                  module._parameters["weight"])


def _blocked_inputs(model: nn.Module) -> Iterator[tuple[str, int, list[nn.Module | None]]]:
    """(name, input width, quantizers) of every quantized layer: linear layers, and each fused experts tensor with
    its experts' weight quantizers."""
    for prefix, fused, module, quantizers in _fused_experts(model):
        yield f"{prefix}{fused}", module._parameters[fused].shape[-1], list(quantizers)
    for name, module in quantized_linears(model):
        yield name, module.weight.shape[-1], [module.weight_quantizer, getattr(module, "input_quantizer", None)]


def check_block_sizes(model: nn.Module, fmt: QuantFormat) -> None:
    """Every quantized layer's input width must be a multiple of the format's block size."""
    bad = []
    for name, width, quantizers in _blocked_inputs(model):
        for quantizer in quantizers:
            block = block_size(quantizer) if quantizer is not None else None
            if block and width % block:
                bad.append(f"{name} (input width {width}, block size {block})")
                break
    if bad:
        example = bad[0].split(" ")[0].split(".")[-1]
        raise ConfigError(
            f"quant config {fmt.source}: the block size does not divide the input width of "
            f"{len(bad)} layer(s): {', '.join(bad)}. Keep such layers in full precision by adding to the "
            f"config's quant_cfg, after the entries that enable quantizers:\n"
            f"  - quantizer_name: '*{example}*'\n    enable: false"
        )


def check_trainable_format(fmt: QuantFormat | None, key: str) -> None:
    """Formats a run can train and serve. A smoothing calibration (AWQ, SmoothQuant) rescales the weights
    and moves a per-channel scale into the input quantizer: master weights, checkpoints and exports would
    disagree about which weights are the model. Those algorithms are post-training quantization only
    (`qarl matrix` PTQ methods, `qarl eval`)."""
    method = fmt.calibration if fmt is not None else None
    if method in SMOOTHING_ALGORITHMS:
        raise ConfigError(f"{key} ({fmt.source}) calibrates with {method}, a smoothing algorithm that rewrites the "
                          "weights: it is for post-training quantization only (qarl matrix, qarl eval). Train with "
                          "max or mse calibration (algorithm: max in the quant config).")


def check_format_fits(model_dir: str, fmt: QuantFormat, trust_remote_code: bool = False) -> None:
    """`fmt`'s block sizes against every layer it would quantize, on the meta device: a format that does
    not apply to a model is refused before any weights load."""
    check_block_sizes(quantized_meta_model(model_dir, fmt, trust_remote_code), fmt)


def share_fused_amax(model: nn.Module) -> int:
    """Give fused siblings (q/k/v, gate/up) the max of their per-tensor amaxes; returns groups merged."""
    merged = 0
    for members in _fused_groups(model):
        for attr in ("weight_quantizer", "input_quantizer"):
            quantizers = [getattr(m, attr, None) for m in members]
            amaxes = [q.amax for q in quantizers if q is not None and q.is_enabled and q.amax is not None]
            if len(amaxes) != len(members) or any(a.numel() != 1 for a in amaxes):
                continue  # disabled, or per-channel amax (concatenates naturally when fused)
            shared = torch.stack([a.reshape(()) for a in amaxes]).max()
            for q in quantizers:
                q.amax = shared.reshape(q.amax.shape)
        merged += 1
    return merged


QUANTIZER_ROLES = ("input_quantizer", "weight_quantizer", "output_quantizer")


def quantizer_spec(quantizer: nn.Module | None) -> tuple | None:
    """What a quantizer computes, apart from its calibrated state; None when it is off (or absent)."""
    if quantizer is None or not quantizer.is_enabled:
        return None
    return (str(quantizer.num_bits), _canonical_blocks(quantizer.block_sizes), quantizer.axis, quantizer.unsigned,
            quantizer.narrow_range, quantizer.fake_quant, pass_through_bwd(quantizer))


def _canonical_blocks(blocks: dict | None) -> str:
    return repr(sorted((str(k), str(v)) for k, v in (blocks or {}).items()))


def match_reference_quantizers(model: nn.Module, reference: nn.Module,
                               counterparts: Callable[[str, str], list[str]]) -> None:
    """Make `model`'s quantizers those the same format gave `reference`, the same weights laid out another way
    (Megatron's fused linear_qkv is Hugging Face's q/k/v_proj: `counterparts(name, role)` lists the quantizers of
    `reference` that quantizer `role` of module `name` stands for). A format's
    patterns name Hugging Face modules ('*lm_head*'), so on another layout they can switch on a quantizer the
    Hugging Face model keeps off: it is switched off here. Anything else that differs is refused by name:
    a fused layer whose parts the format quantizes differently, a quantizer the layout lacks or computes
    differently."""
    reference_modules = dict(reference.named_modules())
    problems = []
    for name, module in model.named_modules():
        if not any(isinstance(getattr(module, r, None), _quantizer_modules()) for r in QUANTIZER_ROLES):
            continue
        for role in QUANTIZER_ROLES:
            parts = counterparts(name, role)
            if not parts or any(p.rpartition(".")[0] not in reference_modules for p in parts):
                problems.append(f"{name}.{role}: no counterpart in the Hugging Face model (looked for {parts})")
                continue
            wanted = {quantizer_spec(reference_modules.get(p)) for p in parts}
            if len(wanted) > 1:
                problems.append(f"{name}.{role}: the format quantizes its parts {parts} differently, "
                                "but this layout fuses them into one layer")
                continue
            want, quantizer = wanted.pop(), getattr(module, role, None)
            if want is None and quantizer_spec(quantizer) is not None:
                quantizer.disable()
            elif want != quantizer_spec(quantizer):
                problems.append(f"{name}.{role}: {quantizer_spec(quantizer)} here, {want} in {parts[0]}")
    if problems:
        raise ConfigError(f"the format does not quantize this layout as it quantizes the Hugging Face model: "
                          f"{'; '.join(problems[:4])}")


def quantize_policy(
    model: nn.Module,
    fmt: QuantFormat,
    calibration_batches: Callable[[], Iterable[dict[str, torch.Tensor]]] | None,
    weight_cache: bool = True,
    align: Callable[[nn.Module], None] | None = None,
) -> nn.Module:
    """Insert `fmt`'s quantizers, check block sizes, calibrate amax on the batches, share fused amax.

    `calibration_batches` is called only after the cheap checks pass. Pass None when the amax will be
    loaded from a saved quantizer state instead. `weight_cache`: quantize each weight once per change
    of the weights instead of at every forward (qarl/quant/fastpath/weight_cache.py), and call the quantizers
    of each linear and attention layer, and each input quantizer's op, without ModelOpt's per-call
    module machinery (fastpath/lean_forward.py); same bits.
    Off, the model runs ModelOpt's own path unchanged. `align`: a backend's step between inserting and
    calibrating that makes its quantizers the Hugging Face model's (`match_reference_quantizers`).
    """
    kernels.install()  # the same bits as ModelOpt's kernels: NVFP4 on CPU, fast on GPUs
    insert_quantizers(model, fmt)
    if align is not None:
        align(model)
    check_block_sizes(model, fmt)
    if weight_cache:
        enable_weight_cache(model)
        enable_lean_forward(model)
        enable_lean_attention(model)
        enable_fast_inputs(model, list(_fused_groups(model)))
    if calibration_batches is not None:
        calibrate(model, fmt, list(calibration_batches()))
    return model


def calibrate(model: nn.Module, fmt: QuantFormat, batches: list[dict[str, torch.Tensor]]) -> None:
    """Calibrate every enabled quantizer's amax from scratch on `batches` (`fmt`'s algorithm), then give
    fused siblings their shared amax. Calling it again recalibrates for the model's current weights,
    except after a smoothing algorithm (AWQ), which rescales the weights: those are PTQ-only formats
    (`check_trainable_format`) and calibrate once."""
    import modelopt.torch.quantization as mtq

    for _, quantizer in _enabled_quantizers(model):
        if quantizer.amax is not None:
            quantizer.reset_amax()

    def forward_loop(m: nn.Module) -> None:
        with torch.no_grad():
            for batch in progress_bar(batches, desc=f"calibrating {fmt.name} amax ({fmt.calibration})", unit="batch"):
                m(**batch)

    with cache_kept(model):  # MSE / 4-over-6 calibration turns weight quantizers into static-block ones
        mtq.calibrate(model, algorithm=fmt.algorithm, forward_loop=forward_loop)
    missing = [n for n, q in _enabled_quantizers(model) if q.amax is None and not getattr(q, "is_mx_format", False)]
    if missing:
        raise ConfigError(f"calibration left {len(missing)} quantizer(s) without amax (no data reached them): {missing[:5]}")
    share_fused_smoothing(model)
    share_fused_amax(model)
    invalidate(model)  # AWQ rescales weights through `.data`, which version counters do not see


def _fused_groups(model: nn.Module) -> Iterator[list[nn.Module]]:
    """The quantized sibling layers (q/k/v, gate/up) that serving engines fuse into one matrix."""
    modules = dict(model.named_modules())
    for name in modules:
        for siblings in FUSED_SIBLINGS.values():
            members = [modules.get(f"{name}.{s}") for s in siblings]
            if all(m is not None and hasattr(m, "weight_quantizer") for m in members):
                yield members


def share_fused_smoothing(model: nn.Module) -> int:
    """Give fused siblings one AWQ/SmoothQuant input scale (they read one input): the mean of theirs,
    each weight rescaled to keep its product with the input and its amax recollected, by ModelOpt's
    own export step (`modelopt_compat.resmooth_fused`). Returns the groups changed."""
    changed = 0
    for members in _fused_groups(model):
        scales = [getattr(m, "input_quantizer", None) for m in members]
        if all(q is not None and q.pre_quant_scale is not None for q in scales):
            resmooth_fused(members)
            changed += 1
    return changed


def w4a4_share(model: nn.Module) -> float | None:
    """The share of the linear layers' multiply-adds (each layer's in x out a token) whose weights and inputs are
    both NVFP4, over the quantized layers and the decoder's linear layers a mixed format leaves unquantized
    (`quant_configs/nvfp4_w4a4_down_bf16.yaml`): how much of a mixed-format model runs W4A4, 1.0 in plain W4A4; None
    where no layer's inputs are NVFP4."""
    total = four_bit = 0
    for name, module in model.named_modules():
        weight_quantizer = module._modules.get("weight_quantizer")
        input_quantizer = module._modules.get("input_quantizer")
        weight = module._parameters.get("weight")
        quantized = weight_quantizer is not None and weight_quantizer.is_enabled
        if weight is None or weight.dim() != 2 or not (quantized or name.endswith(DECODER_LINEARS)):
            continue
        total += weight.numel()
        if quantized and bits_format(weight_quantizer.num_bits) == NVFP4 and input_quantizer is not None \
                and input_quantizer.is_enabled and bits_format(input_quantizer.num_bits) == NVFP4:
            four_bit += weight.numel()
    return four_bit / total if four_bit else None


def _enabled_quantizers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    quantizer_cls = _quantizer_modules()
    for name, module in model.named_modules():
        if isinstance(module, quantizer_cls) and module.is_enabled:
            yield name, module


@torch.no_grad()
def folded_weights(model: nn.Module, only: set[str] | None = None,
                   merge_adapters: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Every weight the engine holds, by its Hugging Face name (a layer's fused experts by each expert's checkpoint
    names: qarl/models/experts.py); quantized weights come quantized-dequantized.

    This is what the rollout engine loads: its weight quantizers stay off, so it computes with exactly
    the tensors the policy's forward computes with. A layer may serve a weight other than its parameter
    (`served_weight()`: LoRA's merged W + s B A) and hold parameters that are not engine weights
    (`adapter_param_names`: a qlora adapter, which the engine receives separately). `only`: just these
    names (a refit that skips weights it already holds); each weight is folded when it is yielded.
    `merge_adapters`: a qlora layer's weight comes as Q(W) + s B A (an engine that runs no LoRA).
    """
    owners, skipped = {}, set()
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    experts = {prefix + fused: (prefix, fused, quantizers if any(q.is_enabled for q in quantizers) else None)
               for prefix, fused, _, quantizers in _fused_experts(model)}
    for name, module in model.named_modules():  # class-level and _modules lookups: ModelOpt's layers answer
        prefix = f"{name}." if name else ""      # instance attributes through a slow dynamic __getattr__
        skipped.update(prefix + p for p in getattr(type(module), "adapter_param_names", ()))
        quantizer = module._modules.get("weight_quantizer")
        # a packed weight exists only as its quantizer's codes (which refuse to serve a disabled quantizer)
        quantized = isinstance(quantizer, PackedWeightMixin) or (isinstance(quantizer, _quantizer_modules())
                                                                 and quantizer.is_enabled)
        if hasattr(type(module), "served_weight") or quantized:
            owners[f"{prefix}weight"] = (module, quantizer if quantized else None)
    for name, param in model.named_parameters():
        if name in skipped or (only is not None and name not in only):
            continue
        if name in experts:  # one fused tensor of a layer's experts: each expert's weights by its checkpoint name
            prefix, fused, quantizers = experts[name]
            yield from expert_weights(prefix, fused, param.detach(), model_type, quantizers)
            continue
        if name not in owners:
            yield name, param.detach()
            continue
        module, quantizer = owners[name]
        weight = module.served_weight() if hasattr(type(module), "served_weight") else module._parameters["weight"]
        weight = (quantizer(weight) if quantizer is not None else weight).detach()
        scale = _weight_only_smoothing(module)
        if scale is not None:
            weight = weight * scale.to(weight.dtype)
        if merge_adapters and getattr(module, "serves_adapter", False):  # after the scale: the adapter sees x itself
            weight = module.with_adapter(weight)
        yield name, weight


def _weight_only_smoothing(module: nn.Module) -> torch.Tensor | None:
    """The AWQ scale s of a layer whose input is not quantized (W4A16 AWQ): y = (x * s) Q(W)^T, which the
    engine computes as x (Q(W) * s)^T, the scale folded into the served weight (as deployment folds it
    into the layer before). A quantized input keeps its scale: the engine applies it (refit syncs it)."""
    quantizer = module._modules.get("input_quantizer")
    if quantizer is None or quantizer.is_enabled:
        return None
    return pre_quant_scale(quantizer)


GLOBAL_AMAX = ".global_amax"  # quantizer-state key suffix of a static-block quantizer's global amax


def quantizer_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """{quantizer name: amax} of every quantizer that has one, and {name + GLOBAL_AMAX: global amax} of
    every static-block weight quantizer (ModelOpt's MSE / 4-over-6 NVFP4, whose per-block amax is
    calibrated): the calibrated state a checkpoint keeps."""
    state = {}
    for name, module in model.named_modules():
        if not isinstance(module, _quantizer_modules()):
            continue
        if module.amax is not None:
            state[name] = module.amax.detach().clone().contiguous()
        if is_static_block_quantizer(module) and module.global_amax is not None:
            state[name + GLOBAL_AMAX] = module.global_amax.detach().clone().contiguous()
    return state


def load_quantizer_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Restore the state saved by `quantizer_state` into a model quantized with the same format (a
    static-block quantizer becomes one again, as ModelOpt's calibration made it)."""
    quantizers = dict(model.named_modules())
    unknown = [n for n in state if n.removesuffix(GLOBAL_AMAX) not in quantizers]
    if unknown:
        raise ConfigError(f"quantizer state does not fit this model: no quantizer named {unknown[:3]}")
    with cache_kept(model):
        for name, value in state.items():
            if name.endswith(GLOBAL_AMAX):
                to_static_block_quantizer(quantizers[name.removesuffix(GLOBAL_AMAX)], value)
            else:
                quantizers[name].amax = value
    static = [n for n, q in _enabled_quantizers(model) if (q.block_sizes or {}).get("type") == "static"
              and not is_static_block_quantizer(q)]
    if static:
        raise ConfigError(f"quantizer state has no global amax for the static-block quantizers {static[:3]}: it was "
                          "saved without one (by a qarl older than static NVFP4 support); recalibrate or retrain")
    missing = [n for n, q in _enabled_quantizers(model) if q.amax is None and not getattr(q, "is_mx_format", False)]
    if missing:
        raise ConfigError(f"quantizer state has no amax for enabled quantizers {missing[:5]}")
