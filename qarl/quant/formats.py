"""Quantization formats: a built-in ModelOpt config name or a YAML file, resolved to one ModelOpt config;
their calibration algorithms, block sizes, and what a format does to a model before any weights load.

`policy.quant_cfg` and `policy.generation.quant_cfg` both go through `resolve_format`, so the two
sides can be compared as resolved configs, not as spellings.
"""

from __future__ import annotations

import copy
import fnmatch
import functools
import json
from dataclasses import dataclass
from typing import Any

from torch import nn

from qarl.config import ConfigError
from qarl.quant import input_variants, modelopt_compat
from qarl.quant_cfg import NO_QUANT, find_quant_yaml, unknown_quant_config


@dataclass(frozen=True)
class QuantFormat:
    """One quantization recipe: a display name and the ModelOpt QuantizeConfig dict it stands for."""

    name: str
    source: str
    modelopt_cfg: dict[str, Any]

    @property
    def quant_cfg(self) -> list[dict[str, Any]]:
        return self.modelopt_cfg["quant_cfg"]

    @property
    def algorithm(self) -> Any:
        return self.modelopt_cfg.get("algorithm", "max")

    def fingerprint(self) -> str:
        """A canonical text of the resolved config: equal fingerprints quantize identically."""
        return json.dumps(_canonical(self.modelopt_cfg))

    @property
    def calibration(self) -> str | None:
        """The name of the calibration algorithm (max, mse, awq_lite, ...), None for none."""
        algorithm = self.algorithm
        return algorithm.get("method") if isinstance(algorithm, dict) else algorithm


def calibration_methods() -> list[str]:
    """ModelOpt's calibration algorithms by name: max, mse, awq_lite, awq_clip, smoothquant, gptq, ..."""
    names = modelopt_compat.calibration_mode_names()
    return sorted(n.removesuffix("_calibrate") for n in names if not n.startswith("_"))


# Calibrations that smooth: an AWQ/SmoothQuant scale rescales the weights and multiplies the layer input.
SMOOTHING_ALGORITHMS = ("awq_lite", "awq_clip", "awq_full", "smoothquant", "svdquant")


def with_calibration(fmt: QuantFormat, method: str) -> QuantFormat:
    """`fmt` calibrated by ModelOpt's algorithm `method` instead of its own: the same quantizers, a
    different PTQ (amax by max or by MSE search; AWQ's activation-aware smoothing scales). "default":
    the format's own algorithm, as shipped (e.g. NVFP4_FOUR_OVER_SIX_CFG's MSE search settings)."""
    if method != "default" and method not in calibration_methods():
        raise ConfigError(f"unknown calibration method {method!r}; use 'default' (the format's own) or one of "
                          f"ModelOpt's: {calibration_methods()}")
    if method in ("default", fmt.algorithm):
        return fmt
    cfg = copy.deepcopy(fmt.modelopt_cfg)
    cfg["algorithm"] = method
    return QuantFormat(name=f"{fmt.name}+{method}", source=f"{fmt.source} (algorithm: {method})", modelopt_cfg=cfg)


def _canonical(obj: Any) -> Any:
    """Dicts as key-sorted pairs (keys may mix int and str, as ModelOpt's block_sizes do)."""
    if isinstance(obj, dict):
        return sorted(([str(k), _canonical(v)] for k, v in obj.items()), key=lambda kv: kv[0])
    if isinstance(obj, (list, tuple)):
        return [_canonical(v) for v in obj]
    return obj if isinstance(obj, (int, float, str, bool, type(None))) else str(obj)


def builtin_names() -> list[str]:
    import modelopt.torch.quantization as mtq

    return sorted(n for n in dir(mtq) if n.endswith("_CFG") and isinstance(getattr(mtq, n), dict))


def resolve_format(spec: str | None) -> QuantFormat | None:
    """`None`/"none" -> no quantization; a ModelOpt config name or a YAML path -> a QuantFormat."""
    if spec is None or str(spec).strip().lower() in NO_QUANT:
        return None
    modelopt_compat.import_modelopt()  # every quantized flow passes here first: its stack is kept off the import
    spec = str(spec).strip()
    path = find_quant_yaml(spec)
    if path is None:
        import modelopt.torch.quantization as mtq

        cfg = getattr(mtq, spec, None)
        if spec.endswith("_CFG") and isinstance(cfg, dict):
            return QuantFormat(name=spec, source=f"modelopt:{spec}", modelopt_cfg=copy.deepcopy(cfg))
        raise unknown_quant_config(spec, builtin_names())
    stat = path.stat()
    cfg = _parsed_yaml(str(path.resolve()), stat.st_mtime_ns, stat.st_size)
    return _with_variants(QuantFormat(name=path.stem, source=str(path), modelopt_cfg=copy.deepcopy(cfg)))


def _with_variants(fmt: QuantFormat) -> QuantFormat:
    """`fmt`, its entries that name qarl's NVFP4 input backend checked and the backend registered with ModelOpt (any
    of its quantizers may run next)."""
    input_variants.check_config(fmt.quant_cfg, fmt.source)
    input_variants.register()
    return fmt


@functools.lru_cache(maxsize=64)
def _parsed_yaml(path: str, mtime_ns: int, size: int) -> dict[str, Any]:
    """A quant config file through ModelOpt's schema, once per version of the file: a run asks for its formats in
    several places (the checks, the memory plan, the policy, the engine), and each gets its own copy."""
    from modelopt.torch.opt.config_loader import load_config
    from modelopt.torch.quantization.config import QuantizeConfig

    try:
        cfg = load_config(path, schema_type=QuantizeConfig).model_dump(exclude_unset=True)
    except Exception as e:  # ModelOpt's schema names the bad field
        raise _schema_error(path, e) from None
    algorithm = cfg.get("algorithm", "max")
    method = algorithm.get("method") if isinstance(algorithm, dict) else algorithm
    if method is not None and method not in calibration_methods():
        raise ConfigError(f"invalid quant config {path}: algorithm {method!r} is none of ModelOpt's calibration "
                          f"algorithms: {', '.join(calibration_methods())}")
    return cfg


def _schema_error(path: str, e: Exception) -> ConfigError:
    """ModelOpt's schema error as one line: its first fault, where in the file (the keys, without pydantic's names of
    the types it tried) and what the schema says."""
    from pydantic import ValidationError

    cause = e.__cause__
    if not isinstance(cause, ValidationError) or not cause.errors():
        return ConfigError(f"invalid quant config {path}: {str(e).splitlines()[0]}")
    first = cause.errors()[0]
    where = ".".join(str(part) for part in first["loc"] if isinstance(part, int) or str(part).isidentifier())
    return ConfigError(f"invalid quant config {path}: {where}: {first['msg'].removeprefix('Value error, ')} "
                       "(ModelOpt's QuantizeConfig schema)")


def same_format(a: QuantFormat | None, b: QuantFormat | None) -> bool:
    """Whether two formats (None: no quantization) quantize identically."""
    return (a is None and b is None) or (a is not None and b is not None and a.fingerprint() == b.fingerprint())


def check_generation_matches(policy: QuantFormat | None, generation: QuantFormat | None, allow_mismatch: bool) -> None:
    """The engine must quantize exactly as the policy trains, unless the user asked otherwise."""
    if not same_format(policy, generation) and not allow_mismatch:
        p = policy.source if policy else "none"
        g = generation.source if generation else "none"
        raise ConfigError(
            f"policy.generation.quant_cfg ({g}) differs from policy.quant_cfg ({p}): rollouts would be "
            "sampled from a differently quantized model than the one trained. Remove the override, or set "
            "policy.generation.allow_quant_mismatch=true to run that experiment on purpose."
        )


def block_size(quantizer: nn.Module) -> int | None:
    """The block size of an enabled block quantizer along the input dimension (NVFP4: 16), else None."""
    sizes = getattr(quantizer, "block_sizes", None) or {}
    return sizes.get(-1) if quantizer.is_enabled else None


def quantized_meta_model(model_dir: str, fmt: QuantFormat, trust_remote_code: bool = False) -> nn.Module:
    """The model on the meta device (no weights) with `fmt`'s quantizers inserted, uncalibrated: what a
    format does to a model, seen before any weights load."""
    from qarl.models.checks import meta_model  # imports transformers

    model = meta_model(model_dir, trust_remote_code)
    try:
        insert_quantizers(model, fmt)
    except RuntimeError as e:  # e.g. no quantizer_name pattern matches this model's layers: ModelOpt's first line
        raise ConfigError(f"quant config {fmt.source} on {model_dir}: {str(e).splitlines()[0]} (ModelOpt); check its "
                          "quantizer_name patterns against the model's module names") from None
    return model


def insert_quantizers(model: nn.Module, fmt: QuantFormat) -> None:
    """`fmt`'s quantizers into `model`, uncalibrated (`mtq.quantize` with no algorithm). ModelOpt prints what it
    did ("Inserted N quantizers", each attention class it registers) at every call, several times a run: shown
    with -v (`qarl.console.quiet_prints`)."""
    import modelopt.torch.quantization as mtq

    from qarl.console import quiet_prints

    with quiet_prints():
        mtq.quantize(model, {"quant_cfg": fmt.quant_cfg, "algorithm": None})


def _plain(obj: Any) -> Any:
    """Tuples to lists, recursively: YAML-safe, with ModelOpt's int dict keys (block_sizes -1) kept."""
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


def format_to_yaml(fmt: QuantFormat) -> str:
    """The resolved format as YAML, saved next to checkpoints (YAML keeps block_sizes' int keys)."""
    import yaml

    return yaml.safe_dump({"name": fmt.name, "source": fmt.source, "modelopt_cfg": _plain(fmt.modelopt_cfg)})


def format_from_yaml(text: str) -> QuantFormat:
    """Inverse of `format_to_yaml`; ModelOpt's schema turns the lists back into its tuples."""
    import yaml
    from modelopt.torch.quantization.config import QuantizeConfig

    record = yaml.safe_load(text)
    cfg = QuantizeConfig.model_validate(record["modelopt_cfg"]).model_dump(exclude_unset=True)
    return _with_variants(QuantFormat(name=record["name"], source=record["source"], modelopt_cfg=cfg))


_NUMERIC_FIELDS = ("num_bits", "axis", "block_sizes", "backend", "backend_extra_args")


def _probe(fmt: QuantFormat, quantizer: str, module: str = "model.layers.0.mlp.down_proj") -> dict[str, Any] | None:
    """The settings `fmt` gives the named quantizer of a plain decoder nn.Linear (None = disabled), or of another
    `module` (an attention module's k_bmm_quantizer).

    Follows ModelOpt's list semantics: entries apply in order; a `cfg` entry sets and enables, an
    `enable`-only entry toggles; entries scoped to another `parent_class` do not apply.
    """
    name = f"{module}.{quantizer}"
    cfg, enabled = None, False
    for entry in fmt.quant_cfg:
        parent = entry.get("parent_class")
        if parent not in (None, "nn.Linear") or not fnmatch.fnmatch(name, entry["quantizer_name"]):
            continue
        if entry.get("cfg") is not None:
            cfg, enabled = entry["cfg"], entry.get("enable", True) is not False
        elif "enable" in entry:
            enabled = bool(entry["enable"])
    if not enabled or cfg is None:
        return None
    cfg = cfg if isinstance(cfg, dict) else dict(cfg)
    return {k: _comparable(cfg.get(k)) for k in _NUMERIC_FIELDS if cfg.get(k) is not None}


def _comparable(value: Any) -> Any:
    """JSON-comparable: tuples -> lists, dict keys -> str (ModelOpt mixes int and str keys)."""
    if isinstance(value, dict):
        return {str(k): _comparable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_comparable(v) for v in value]
    return value


NVFP4, FP8 = "nvfp4", "fp8"
FORMAT_OF_BITS = {(2, 1): NVFP4, (4, 3): FP8}  # ModelOpt's num_bits (E2M1, E4M3) -> the format it quantizes in


def bits_format(num_bits: Any) -> str | None:
    """NVFP4, FP8 or None (another width) for a quantizer's `num_bits`, as ModelOpt holds it or as a settings dict
    (`quantizer_settings`) lists it."""
    return FORMAT_OF_BITS.get(tuple(num_bits) if isinstance(num_bits, (list, tuple)) else num_bits)


# the linear layers of a decoder layer, by the names transformers' Llama-style families give them
DECODER_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                   "mlp.up_proj", "mlp.down_proj")
MIXED = "mixed"  # quantizer_settings' key for a format that quantizes a decoder's linear layers differently


def quantizer_settings(fmt: QuantFormat | None) -> dict[str, Any]:
    """{'weight': settings or None, 'input': settings or None} of the decoder's linear layers under `fmt`, read from
    the config without quantizing anything (the export's target check, the packed base, the memory plan). A format
    that quantizes some of them otherwise (mixed formats: down_proj's input kept unquantized) gives {MIXED: {layer:
    its settings}}, which equals no uniform format's."""
    if fmt is None:
        return {"weight": None, "input": None}
    by_layer = {layer: layer_settings(fmt, f"model.layers.0.{layer}") for layer in DECODER_LINEARS}
    first = by_layer[DECODER_LINEARS[0]]
    return first if all(settings == first for settings in by_layer.values()) else {MIXED: by_layer}


def layer_settings(fmt: QuantFormat, module: str) -> dict[str, Any]:
    """{'weight': settings or None, 'input': settings or None} that `fmt` gives the linear layer named `module` (a
    checkpoint name, e.g. model.layers.3.mlp.down_proj), by ModelOpt's list semantics."""
    return {"weight": _probe(fmt, "weight_quantizer", module), "input": _probe(fmt, "input_quantizer", module)}


def quantizes_kv_cache(fmt: QuantFormat | None) -> bool:
    """Whether `fmt` quantizes the attention's keys (ModelOpt's k_bmm_quantizer: the engine's FP8 KV cache), read
    from the config without a model (the memory plan; the engine reads the model's quantizers, `input_quant_plan`)."""
    return fmt is not None and _probe(fmt, "k_bmm_quantizer", "model.layers.0.self_attn") is not None


def is_quantizer_key(key: str) -> bool:
    """A state-dict key of a ModelOpt quantizer's buffer (`<layer>.<role>_quantizer.<buffer>`, or a MoE layer's
    per-expert `<experts>.<fused>_weight_quantizers.<e>.<buffer>`), not a model tensor."""
    return "_quantizer." in key or "_quantizers." in key
