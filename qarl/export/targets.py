"""Export targets: which quantization format an export expects and which on-disk format it writes.

A target is a small YAML file in the top-level `export/` folder:

    name: nvfp4_w4a16_modelopt
    quant_format: nvfp4_a16        # a quant_configs/ name: what the model must have been trained with
    disk_format: modelopt_hf       # modelopt_hf | compressed_tensors
    settings:                      # optional
      max_shard_size: 5GB

The checkpoint's trained format and the target's `quant_format` are compared by the quantizer
settings they give a linear layer's weight and input quantizers (not by spelling), so a model
trained with ModelOpt's built-in `W4A16_NVFP4_CFG` exports with the `nvfp4_a16` targets.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qarl.config import REPO_ROOT, ConfigError

if TYPE_CHECKING:
    from qarl.quant import QuantFormat

DISK_FORMATS = ("modelopt_hf", "compressed_tensors")
TARGET_DIR = REPO_ROOT / "export"
_SETTINGS = {"max_shard_size": "5GB"}


@dataclass(frozen=True)
class ExportTarget:
    name: str
    quant_format: str
    disk_format: str
    source: str
    settings: dict[str, Any] = field(default_factory=dict)

    def resolved_format(self) -> QuantFormat:
        from qarl.quant import resolve_format  # (this module loads without torch: the CLI checks a target name)

        fmt = resolve_format(self.quant_format)
        if fmt is None:
            raise ConfigError(f"export target {self.source}: quant_format must name a quantization format, not "
                              f"{self.quant_format!r} (there is nothing to export unquantized)")
        return fmt

    @property
    def max_shard_bytes(self) -> int:
        return parse_size(self.settings["max_shard_size"])


def shipped_targets() -> list[str]:
    return sorted(p.stem for p in TARGET_DIR.glob("*.yaml"))


def load_target(spec: str | Path) -> ExportTarget:
    """A target YAML path, or the name of one in export/."""
    import yaml

    path = Path(spec)
    for candidate in (path, REPO_ROOT / path, TARGET_DIR / path, TARGET_DIR / f"{spec}.yaml"):
        if candidate.is_file():
            path = candidate
            break
    else:
        raise ConfigError(f"export target {str(spec)!r} not found: give a YAML path or one of {shipped_targets()}")
    record = yaml.safe_load(path.read_text()) or {}
    allowed = {"name", "quant_format", "disk_format", "settings"}
    unknown = sorted(set(record) - allowed)
    missing = sorted({"quant_format", "disk_format"} - set(record))
    if unknown or missing:
        raise ConfigError(f"export target {path}: unknown keys {unknown}, missing keys {missing} "
                          f"(a target has {sorted(allowed)})")
    if record["disk_format"] not in DISK_FORMATS:
        raise ConfigError(f"export target {path}: disk_format {record['disk_format']!r} is not one of "
                          f"{list(DISK_FORMATS)}")
    settings = dict(record.get("settings") or {})
    bad = sorted(set(settings) - set(_SETTINGS))
    if bad:
        raise ConfigError(f"export target {path}: unknown settings {bad} (known: {sorted(_SETTINGS)})")
    target = ExportTarget(
        name=str(record.get("name", path.stem)),
        quant_format=str(record["quant_format"]),
        disk_format=record["disk_format"],
        source=str(path),
        settings={**_SETTINGS, **settings},
    )
    parse_size(target.settings["max_shard_size"])
    return target


def parse_size(size: str | int) -> int:
    """'5GB', '500MB', '2GiB' or a byte count -> bytes."""
    if isinstance(size, int):
        return size
    text = str(size).strip().upper()
    units = {"GIB": 2**30, "MIB": 2**20, "KIB": 2**10, "GB": 10**9, "MB": 10**6, "KB": 10**3, "B": 1}
    for unit, factor in units.items():
        if text.endswith(unit):
            try:
                return int(float(text[: -len(unit)]) * factor)
            except ValueError:
                break
    if text.isdigit():
        return int(text)
    raise ConfigError(f"max_shard_size {size!r}: expected a size like 5GB, 500MB or a byte count")


def _bits(settings: dict | None) -> str:
    """A quantizer's settings (`quantizer_settings`) in a word: NVFP4, FP8, or unquantized."""
    from qarl.quant.formats import bits_format

    if settings is None:
        return "unquantized"
    return (bits_format(settings.get("num_bits")) or str(settings.get("num_bits"))).upper()


def _input_variants(settings: dict) -> list[str]:
    """The NVFP4 input variants (`qarl.quant.input_variants`: per-token scales, 4-over-6 block scales, Hadamard) that
    `quantizer_settings` lists for any decoder linear layer, by name."""
    from qarl.quant.formats import MIXED
    from qarl.quant.input_variants import BACKEND, OPTIONS

    layers = settings[MIXED].values() if MIXED in settings else [settings]
    on = {option for layer in layers if (layer["input"] or {}).get("backend") == BACKEND
          for option in OPTIONS if (layer["input"].get("backend_extra_args") or {}).get(option)}
    names = {"per_token": "per-token scales", "four_over_six": "4-over-6 block scales",
             "hadamard": "Hadamard-rotated blocks"}
    return [names[option] for option in OPTIONS if option in on]


def check_target_matches(trained: QuantFormat, target: ExportTarget) -> None:
    """The export writes the format the model was trained in, or stops and names both."""
    from qarl.quant.formats import MIXED, quantizer_settings

    expected = target.resolved_format()
    have, want = quantizer_settings(trained), quantizer_settings(expected)
    variants = _input_variants(have)
    if variants:
        raise ConfigError(
            f"the checkpoint was trained with {trained.source}, whose NVFP4 layer inputs use {' and '.join(variants)} "
            "(qarl's backend qarl_nvfp4); no engine's real W4A4 kernel computes them (vLLM's takes one input scale "
            "per layer and max-mapped block scales), so this model is a training-time result: evaluate it as trained "
            "(`qarl eval`, the fake-quantized policy and qarl's engine), or train with nvfp4_w4a4 to export")
    if MIXED in have and have != want:
        mixed, have = have, _uniform_but_unquantized(have[MIXED])
        if MIXED in have:
            fitting = _fitting_targets(mixed)
            kinds = {layer.split(".")[-1]: f"weights {_bits(s['weight'])}, inputs {_bits(s['input'])}"
                     for layer, s in mixed[MIXED].items()}
            raise ConfigError(
                f"the checkpoint was trained with {trained.source}, which quantizes its linear layers in mixed formats "
                f"({'; '.join(f'{k}: {v}' for k, v in kinds.items())}); target {target.name} writes "
                f"{expected.source}. " + (f"Targets that fit this checkpoint: {fitting}." if fitting else
                "No shipped target writes this mix, so this model is a training-time result: evaluate it as trained "
                "(`qarl eval`, the fake-quantized policy and qarl's engine), or train with a format a target writes "
                "to export (a uniform one; W4A4 with down_proj wholly unquantized, "
                "quant_configs/nvfp4_w4a4_down_bf16.yaml, or in FP8, quant_configs/nvfp4_w4a4_down_fp8.yaml)"))
    if have != want:
        fitting = _fitting_targets(have)
        raise ConfigError(
            f"export target {target.name} ({target.source}) expects a model trained with {expected.source}: "
            f"linear layers {json.dumps(want)}; the checkpoint was trained with {trained.source}: "
            f"{json.dumps(have)}. Exporting would change the numbers the policy was trained with. Targets that fit "
            f"this checkpoint: {fitting or 'none shipped; write one (see export/README.md)'}."
        )


def _fitting_targets(settings: dict[str, Any]) -> list[str]:
    """The shipped targets whose format quantizes the linear layers with these settings (`quantizer_settings`)."""
    from qarl.quant.formats import quantizer_settings

    return [n for n in shipped_targets() if quantizer_settings(load_target(n).resolved_format()) == settings]


def _uniform_but_unquantized(by_layer: dict[str, dict]) -> dict[str, Any]:
    """The one format of a mixed format's quantized layers where every other layer is wholly unquantized (weights and
    inputs: exported in the model's dtype, like lm_head, and listed as such in the export's config); else the mixed
    settings as they are."""
    from qarl.quant.formats import MIXED, quantizer_settings

    unquantized = quantizer_settings(None)  # a layer's settings with neither quantizer on
    quantized = [s for s in by_layer.values() if s != unquantized]
    if quantized and all(s == quantized[0] for s in quantized):
        return quantized[0]
    return {MIXED: by_layer}


# (weight kind, input kind) of a quantized linear layer -> its scheme, the name the format modules write it under
SCHEMES = {("nvfp4", None): "nvfp4_w4a16", ("nvfp4", "nvfp4"): "nvfp4_w4a4", ("fp8", "fp8"): "fp8_w8a8"}
MIXED_SCHEME = "+"  # joins a mixed export's schemes, in the decoder's layer order: nvfp4_w4a4+fp8_w8a8


def layer_scheme(settings: dict[str, Any]) -> str | None:
    """The scheme of a linear layer whose quantizers have these settings (`layer_settings`); None: no scheme's."""
    from qarl.quant.formats import bits_format

    kinds = tuple(bits_format(s["num_bits"]) if s else None for s in (settings["weight"], settings["input"]))
    return SCHEMES.get(kinds)


def scheme_parts(scheme: str | None) -> list[str]:
    """The schemes of an export's layers: [scheme] for a uniform export, each of a mixed one's; [] for None."""
    return scheme.split(MIXED_SCHEME) if scheme else []


def config_scheme(config: dict) -> str | None:
    """nvfp4_w4a16 / nvfp4_w4a4 / fp8_w8a8 (or a mixed compressed-tensors export's schemes, group by group, joined:
    nvfp4_w4a4+fp8_w8a8) from a checkpoint's config.json alone (exports without a manifest, exports written by other
    tools); None for a model without a quantization_config or quantized otherwise (INT4, GPTQ, ...)."""
    q = config.get("quantization_config") or {}
    if q.get("quant_method") == "modelopt":
        return {"W4A16_NVFP4": "nvfp4_w4a16", "NVFP4": "nvfp4_w4a4", "FP8": "fp8_w8a8"}.get(q.get("quant_algo"))
    if q.get("quant_method") != "compressed-tensors":
        return None

    def kind(args: dict) -> str | None:  # NVFP4: E2M1 in blocks of 16; FP8: E4M3
        if args.get("type") == "float" and args.get("num_bits") == 4 and args.get("group_size") == 16:
            return "nvfp4"
        return "fp8" if args.get("type") == "float" and args.get("num_bits") == 8 else None

    schemes = []
    for group in q.get("config_groups", {}).values():
        weights, inputs = group.get("weights") or {}, group.get("input_activations") or {}
        scheme = SCHEMES.get((kind(weights), kind(inputs) if inputs else None))
        if scheme is None:
            return None
        schemes.append(scheme)
    return MIXED_SCHEME.join(dict.fromkeys(schemes)) or None
