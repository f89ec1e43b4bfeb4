"""Quantization formats: a built-in ModelOpt config name or a YAML file, resolved to one ModelOpt config.

`policy.quant_cfg` and `policy.generation.quant_cfg` both go through `resolve_format`, so the two
sides can be compared as resolved configs, not as spellings.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qarl.config import REPO_ROOT, ConfigError

NO_QUANT = {"", "none", "null", "bf16", "fp32", "false"}


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
        return json.dumps(self.modelopt_cfg, sort_keys=True, default=str)

    def with_weights_disabled(self) -> dict[str, Any]:
        """The rollout engine's config: weights arrive already fake-quantized, so only inputs quantize."""
        cfg = copy.deepcopy(self.modelopt_cfg)
        cfg["quant_cfg"] = cfg["quant_cfg"] + [{"quantizer_name": "*weight_quantizer", "enable": False}]
        cfg["algorithm"] = None
        return cfg


def builtin_names() -> list[str]:
    import modelopt.torch.quantization as mtq

    return sorted(n for n in dir(mtq) if n.endswith("_CFG") and isinstance(getattr(mtq, n), dict))


def _find_yaml(spec: str) -> Path | None:
    for candidate in (Path(spec), REPO_ROOT / spec, REPO_ROOT / "quant_configs" / spec):
        for path in (candidate, candidate.with_suffix(".yaml")):
            if path.is_file():
                return path
    return None


def resolve_format(spec: str | None) -> QuantFormat | None:
    """`None`/"none" -> no quantization; a ModelOpt config name or a YAML path -> a QuantFormat."""
    if spec is None or str(spec).strip().lower() in NO_QUANT:
        return None
    spec = str(spec).strip()
    looks_like_file = spec.endswith((".yaml", ".yml")) or "/" in spec
    if not looks_like_file:
        import modelopt.torch.quantization as mtq

        cfg = getattr(mtq, spec, None)
        if not (spec.endswith("_CFG") and isinstance(cfg, dict)):
            raise ConfigError(
                f"unknown quant config {spec!r}: not a ModelOpt built-in and not a YAML file. "
                f"Use a path such as quant_configs/nvfp4_a16.yaml or one of: {', '.join(builtin_names())}"
            )
        return QuantFormat(name=spec, source=f"modelopt:{spec}", modelopt_cfg=copy.deepcopy(cfg))
    path = _find_yaml(spec)
    if path is None:
        shipped = sorted(p.name for p in (REPO_ROOT / "quant_configs").glob("*.yaml"))
        raise ConfigError(f"quant config file not found: {spec!r}. Shipped configs in quant_configs/: {shipped}")
    from modelopt.torch.opt.config_loader import load_config
    from modelopt.torch.quantization.config import QuantizeConfig

    try:
        cfg = load_config(path, schema_type=QuantizeConfig).model_dump(exclude_unset=True)
    except Exception as e:  # ModelOpt's schema names the bad field
        raise ConfigError(f"invalid quant config {path}: {e}") from None
    return QuantFormat(name=path.stem, source=str(path), modelopt_cfg=cfg)


def check_generation_matches(policy: QuantFormat | None, generation: QuantFormat | None, allow_mismatch: bool) -> None:
    """The engine must quantize exactly as the policy trains, unless the user asked otherwise."""
    same = (policy is None and generation is None) or (
        policy is not None and generation is not None and policy.fingerprint() == generation.fingerprint()
    )
    if not same and not allow_mismatch:
        p = policy.source if policy else "none"
        g = generation.source if generation else "none"
        raise ConfigError(
            f"policy.generation.quant_cfg ({g}) differs from policy.quant_cfg ({p}): rollouts would be "
            "sampled from a differently quantized model than the one trained. Remove the override, or set "
            "policy.generation.allow_quant_mismatch=true to run that experiment on purpose."
        )
