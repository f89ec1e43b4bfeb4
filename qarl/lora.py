"""LoRA adapters over a frozen, fake-quantized base: the `qlora` and `merged` modes.

    qlora   y = Q(W) x + s B A x      the base stays frozen and quantized, the adapter (fp32 masters)
                                      runs beside it (QLoRA, QeRL). Deploy the quantized base plus
                                      the adapter. Pick it for memory and refit cost: the base is folded and
                                      sent to the engine once, each refit moves only the adapter.
    merged  y = Q(W + s B A) x       LoRA-only QAT (SkyRL): W frozen, the product merged before the
                                      quantizer. Deploy one quantized merged model, trained exactly as it
                                      will be served (no adapter kernels at inference). Each refit folds and
                                      sends every adapted weight, as full training does.

s = alpha / rank (PEFT's scaling). Both modes keep A and B in the master dtype (fp32; qlora computes with them rounded
to the compute dtype, `adapter_output`), so the optimizer
holds state for the adapters only and the base needs no master copy. The KL reference is the policy
with its adapters switched off (`adapters_disabled`): no second copy of the model.

An adapted layer keeps its name and its quantizers: `apply_lora` gives it a subclass of its own class
(as the lean forward does) with two more parameters, `lora_A` [rank, in] and `lora_B` [out, rank], so
the refit, the quantizer state and checkpoints find everything where they were. On disk the adapter
is a PEFT adapter directory (`save_adapter`), which transformers/peft and vLLM load.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from qarl.config import ConfigError, LoraConfig, PolicyConfig
from qarl.models.experts import has_experts
from qarl.quant.fastpath.lean_forward import quantized_linear
from qarl.quant.mixins import with_mixin, without_mixin
from qarl.quant import pack_frozen_weights
from qarl.seeds import derived_seed

MODES = ("none", "qlora", "merged")
ADAPTER_PARAMS = ("lora_A", "lora_B")
PEFT_PREFIX = "base_model.model."


def adapter_weights(lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A and s B as an adapter computes with them: each rounded once to `dtype` from the masters. The policy and the
    engine's hooks (`adapter_output`) and vLLM's LoRA slot (qarl/generation/vllm_lora.py) all hold these."""
    return lora_a.to(dtype), (lora_b * scale).to(dtype)


def adapter_output(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float) -> torch.Tensor:
    """s B A x in x's dtype (the compute dtype), as vLLM's LoRA kernels compute it: with `adapter_weights`, x A^T
    rounded to that dtype, then expanded by s B. In bf16 it costs no fp32 copy of the layer input."""
    weight_a, scaled_b = adapter_weights(lora_a, lora_b, scale, x.dtype)
    return F.linear(F.linear(x, weight_a), scaled_b)


def merged_weight(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float) -> torch.Tensor:
    """W + s B A, summed in the adapter's dtype and rounded once to W's dtype: the merged mode's weight,
    in training, in the refit fold and in the merged export alike."""
    return (weight.to(lora_a.dtype) + (lora_b @ lora_a) * scale).to(weight.dtype)


class LoraLayer:
    """Mixed into an adapted linear layer's own class by `apply_lora` (see the module docstring)."""

    lora_A: nn.Parameter
    lora_B: nn.Parameter
    lora_scale: float
    lora_mode: str
    lora_dropout: float
    lora_enabled: bool = True
    adapter_param_names = ADAPTER_PARAMS  # parameters the engine does not load as weights

    def served_weight(self) -> torch.Tensor:
        """The weight the layer computes with before its quantizer: W, or W + s B A when merged."""
        weight = self._parameters["weight"]
        if self.lora_mode == "merged" and self.lora_enabled:
            return merged_weight(weight, self.lora_A, self.lora_B, self.lora_scale)
        return weight

    @torch.no_grad()
    def with_adapter(self, weight: torch.Tensor) -> torch.Tensor:
        """`weight` (the layer's Q(W)) with the adapter folded in, Q(W) + s B A: what an engine that runs no LoRA holds
        (`policy.generation.qlora_adapters=merged`)."""
        return merged_weight(weight, self.lora_A, self.lora_B, self.lora_scale)

    @property
    def serves_adapter(self) -> bool:
        """True when the adapter runs beside the weight (qlora): the engine needs A and B themselves."""
        return self.lora_mode == "qlora" and self.lora_enabled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.lora_enabled:
            return super().forward(x)
        if self.lora_mode == "merged":
            return quantized_linear(self, x, self.served_weight())
        y = super().forward(x)
        a = F.dropout(x, self.lora_dropout, self.training) if self.lora_dropout else x
        return y + adapter_output(a, self.lora_A, self.lora_B, self.lora_scale)


def _lora_class(cls: type) -> type:
    """`Lora<Layer>`: the layer's class with the adapter mixed in."""
    return with_mixin(LoraLayer, cls, "Lora", globals())


def matches_targets(name: str, targets: list[str]) -> bool:
    return any(name == t or name.endswith("." + t) for t in targets)


def _linears(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            yield name, module


def check_lora(cfg: PolicyConfig, model_dir: str) -> None:
    """Every LoRA setting that cannot run, refused before anything heavy: the mode, rank, alpha and
    dropout, target names that match no linear layer, a rank larger than a layer allows, and the
    combinations the engine cannot serve. The model is built on the meta device (no weights read)."""
    lora = cfg.lora
    if lora.mode not in MODES:
        raise ConfigError(f"policy.lora.mode={lora.mode!r}; choose one of {MODES}")
    if lora.mode == "none":
        return
    if lora.rank < 1 or lora.alpha <= 0:
        raise ConfigError(f"policy.lora.rank={lora.rank}, alpha={lora.alpha}: the rank must be >= 1 and alpha > 0")
    if not 0.0 <= lora.dropout < 1.0:
        raise ConfigError(f"policy.lora.dropout={lora.dropout} must be in [0, 1)")
    if lora.mode == "merged" and lora.dropout:
        raise ConfigError("policy.lora.dropout > 0 needs mode=qlora: in merged mode the adapter is part of the "
                          "weight, so there is no separate adapter input to drop (set policy.lora.dropout=0)")
    if lora.noise_start < 0 or lora.noise_end < 0:
        raise ConfigError("policy.lora.noise_start / noise_end are standard deviations: they must be >= 0")
    if lora.mode == "qlora" and lora.pack_base and not cfg.quant_weight_cache:
        raise ConfigError("policy.lora.pack_base=true needs policy.quant_weight_cache=true: the packed base's layers "
                          "decode their weight again in the backward only on qarl's lean forward (without it each "
                          "decoded weight is kept for the backward). Set policy.quant_weight_cache=true, or "
                          "policy.lora.pack_base=false.")
    if lora.mode == "qlora" and cfg.generation.tensor_parallel_size > 1:
        raise ConfigError("policy.lora.mode=qlora serves the adapter beside unsharded engine layers; use "
                          "policy.generation.tensor_parallel_size=1, or mode=merged (adapters folded into weights)")
    if cfg.generation.allow_quant_mismatch and str(cfg.generation.quant_cfg) != str(cfg.quant_cfg):
        raise ConfigError("policy.lora with rollouts quantized in another format (policy.generation.quant_cfg) is "
                          "not supported: LoRA trains the base in its rollout format already; drop the generation "
                          "override or policy.lora")
    from qarl.models.checks import meta_model

    linears = dict(_linears(meta_model(model_dir, cfg.trust_remote_code)))
    targeted = {n: m for n, m in linears.items() if matches_targets(n, lora.target_modules)}
    if not targeted:
        names = sorted({n.rsplit(".", 1)[-1] for n in linears})
        raise ConfigError(f"policy.lora.target_modules={lora.target_modules} match no linear layer of {model_dir}; "
                          f"its linear layers are named {names}")
    too_small = [f"{n} ({m.in_features}->{m.out_features})" for n, m in targeted.items()
                 if lora.rank > min(m.in_features, m.out_features)]
    if too_small:
        raise ConfigError(f"policy.lora.rank={lora.rank} exceeds the smaller side of {len(too_small)} targeted "
                          f"layer(s), e.g. {too_small[0]}: a rank above min(in, out) adds parameters and no "
                          "expressiveness. Lower the rank or drop those layers from target_modules.")


def apply_lora(model: nn.Module, cfg: LoraConfig, dtype: torch.dtype) -> list[str]:
    """Freeze `model` and give each targeted linear layer an adapter (A: Kaiming-uniform, B: zero, so the
    adapted model starts equal to the base); returns the adapted layer names."""
    model.requires_grad_(False)
    names = []
    for name, module in list(_linears(model)):
        if not matches_targets(name, cfg.target_modules):
            continue
        device = module.weight.device
        module.__class__ = _lora_class(type(module))
        module.lora_A = nn.Parameter(torch.empty(cfg.rank, module.in_features, device=device, dtype=dtype))
        module.lora_B = nn.Parameter(torch.zeros(module.out_features, cfg.rank, device=device, dtype=dtype))
        nn.init.kaiming_uniform_(module.lora_A, a=math.sqrt(5))
        module.lora_scale, module.lora_mode, module.lora_dropout = cfg.alpha / cfg.rank, cfg.mode, cfg.dropout
        module.lora_enabled = True
        names.append(name)
    if has_experts(model):
        print("LoRA: a Mixture-of-Experts layer's experts (fused 3-D weights, not linear layers) take no adapter and "
              "stay frozen; the adapters are on the attention and any dense MLP layers", flush=True)
    return names


def pack_base(model: nn.Module, cfg: LoraConfig) -> None:
    """qlora with `cfg.pack_base`: the calibrated frozen base kept as its low-precision codes (qarl/quant/packed.py)."""
    if cfg.mode == "qlora" and cfg.pack_base:
        print(f"qlora base: {pack_frozen_weights(model).summary()}")


def lora_layers(model: nn.Module) -> Iterator[tuple[str, LoraLayer]]:
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            yield name, module


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The base model: every adapter switched off inside the block."""
    layers = [m for _, m in lora_layers(model)]
    for layer in layers:
        layer.lora_enabled = False
    try:
        yield
    finally:
        for layer in layers:
            layer.lora_enabled = True


class AdapterDisabled(nn.Module):
    """The KL reference of a LoRA policy: the same model, called with its adapters off."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.policy = model

    def forward(self, *args, **kwargs):
        with adapters_disabled(self.policy):
            return self.policy(*args, **kwargs)

    def get_decoder(self) -> nn.Module:
        """The base's decoder, its adapters off (chunked scoring calls the decoder and the head apart)."""
        return AdapterDisabled(self.policy.get_decoder())

    def get_output_embeddings(self) -> nn.Module:
        return AdapterDisabled(self.policy.get_output_embeddings())


def served_adapters(model: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """{layer name: (A, B, s)} of every adapter that runs beside its weight (qlora): what the engine adds."""
    return {n: (m.lora_A.detach(), m.lora_B.detach(), m.lora_scale) for n, m in lora_layers(model) if m.serves_adapter}


# --- on disk: PEFT's adapter format ------------------------------------------------------------------


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters by PEFT's names (base_model.model.<layer>.lora_A.weight, ...)."""
    state = {}
    for name, layer in lora_layers(model):
        state[f"{PEFT_PREFIX}{name}.lora_A.weight"] = layer.lora_A.detach().contiguous()
        state[f"{PEFT_PREFIX}{name}.lora_B.weight"] = layer.lora_B.detach().contiguous()
    return state


@torch.no_grad()
def load_adapter_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Inverse of `adapter_state`, with a clear error when the adapter does not fit the model's layers."""
    layers = dict(lora_layers(model))
    expected = set(adapter_state(model))
    if set(state) != expected:
        missing, unknown = sorted(expected - set(state)), sorted(set(state) - expected)
        raise ConfigError(f"the adapter does not fit this model's adapted layers: missing {missing[:3]}, "
                          f"unknown {unknown[:3]} (target_modules differ?)")
    for key, value in state.items():
        layer_name, part = key[len(PEFT_PREFIX):].rsplit(".", 2)[:2]
        target = getattr(layers[layer_name], part)
        if target.shape != value.shape:
            raise ConfigError(f"adapter tensor {key} has shape {tuple(value.shape)}, the model's is "
                              f"{tuple(target.shape)} (a different rank or base model?)")
        target.copy_(value)


def save_adapter(model: nn.Module, cfg: LoraConfig, out_dir: Path, base_model: str) -> int:
    """A PEFT adapter directory (adapter_config.json + adapter_model.safetensors); returns its bytes."""
    from peft import LoraConfig as PeftLoraConfig
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    names = sorted({n.rsplit(".", 1)[-1] for n, _ in lora_layers(model)})
    PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=names,
                   task_type="CAUSAL_LM", base_model_name_or_path=base_model).save_pretrained(str(out_dir))
    save_file({k: v.cpu() for k, v in adapter_state(model).items()}, str(out_dir / "adapter_model.safetensors"),
              metadata={"format": "pt"})
    return sum(p.stat().st_size for p in out_dir.iterdir())


@torch.no_grad()
def deployable_model(model: nn.Module) -> nn.Module:
    """A copy of a LoRA policy's model in the form it is deployed: merged layers carry W + s B A as
    their weight (the very tensor training quantized), qlora layers just their base W (the adapter
    ships beside it). Plain layers, same quantizers and amax."""
    import copy

    model = copy.deepcopy(model)
    for _, layer in list(lora_layers(model)):
        if layer.lora_mode == "merged":
            layer.weight.copy_(merged_weight(layer.weight, layer.lora_A, layer.lora_B, layer.lora_scale))
        del layer.lora_A, layer.lora_B
        layer.__class__ = without_mixin(type(layer))  # Lora<cls> -> cls
    return model


# --- the base an adapter belongs to --------------------------------------------------------------------


def base_fingerprint(model_dir: str | Path) -> str:
    """A cheap identity of a model directory's weights: each safetensors file's size, header (tensor
    names, shapes, offsets) and 64 evenly spaced 4 KiB samples of its data. Two different bases of one
    architecture (another fine-tune, another warm start) differ in their data samples."""
    digest = hashlib.sha256()
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{model_dir} has no .safetensors weights: a LoRA base must be a safetensors model")
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with path.open("rb") as f:
            header = int.from_bytes(f.read(8), "little")
            digest.update(f.read(header))
            for i in range(64):
                f.seek(8 + header + (size - 8 - header) * i // 64)
                digest.update(f.read(4096))
    return digest.hexdigest()[:32]


def write_lora_manifest(out_dir: Path, cfg: LoraConfig, base_dir: str, dtype: torch.dtype) -> None:
    manifest = {"dtype": str(dtype).replace("torch.", ""), "mode": cfg.mode, "rank": cfg.rank, "alpha": cfg.alpha, "dropout": cfg.dropout,
                "target_modules": list(cfg.target_modules), "noise_start": cfg.noise_start, "noise_end": cfg.noise_end,
                "base": str(Path(base_dir).resolve()), "base_fingerprint": base_fingerprint(base_dir)}
    (out_dir / "lora.json").write_text(json.dumps(manifest, indent=2))


def read_lora_manifest(checkpoint: Path, base_dir: str | None = None) -> tuple[LoraConfig, str]:
    """The adapter settings and base directory of a LoRA checkpoint. `base_dir` (e.g. the base a resumed
    recipe names) must be the very base the adapter was trained on, checked by fingerprint."""
    manifest = json.loads((checkpoint / "lora.json").read_text())
    base = base_dir or manifest["base"]
    if not Path(base).is_dir():
        raise ConfigError(f"LoRA checkpoint {checkpoint} points to its base model {base}, which does not exist; "
                          "restore that directory (for the embedded default: rerun the warm start)")
    if base_fingerprint(base) != manifest["base_fingerprint"]:
        raise ConfigError(f"LoRA checkpoint {checkpoint} was trained on the base {manifest['base']}, and {base} holds "
                          "different weights: an adapter only fits the exact base it was trained on")
    cfg = LoraConfig(**{k: manifest[k] for k in ("mode", "rank", "alpha", "dropout", "target_modules",
                                                  "noise_start", "noise_end")})
    return cfg, base


# --- adaptive quantization noise (QeRL) -----------------------------------------------------------------


class QuantNoise:
    """Channel-wise Gaussian noise on the norms in front of the quantized projections, std decaying
    geometrically from `noise_start` to `noise_end` over the run. The noise multiplies the frozen norm
    weights in place (x_norm * (1 + z) enters q/k/v and gate/up), so the refit sends it to the engine
    with the norms and both sides sample with the same noisy policy. A function of (seed, step)."""

    def __init__(self, model: nn.Module, cfg: LoraConfig, total_steps: int, seed: int):
        self.cfg, self.total, self.seed = cfg, max(total_steps, 1), seed
        self.norms = [(n, m) for n, m in model.named_modules()
                      if n.endswith(("input_layernorm", "post_attention_layernorm")) and getattr(m, "weight", None) is not None]
        self.clean = {n: m.weight.detach().clone() for n, m in self.norms}

    def std(self, step: int) -> float:
        start, end = self.cfg.noise_start, max(self.cfg.noise_end, 1e-12)
        return start * (end / start) ** (min(step, self.total - 1) / max(self.total - 1, 1))

    @torch.no_grad()
    def apply(self, step: int) -> float:
        generator = torch.Generator().manual_seed(derived_seed(self.seed, step))
        std = self.std(step)
        for name, norm in self.norms:
            z = torch.randn(norm.weight.shape, generator=generator) * std
            norm.weight.copy_(self.clean[name] * (1 + z.to(norm.weight.device, norm.weight.dtype)))
        return std
