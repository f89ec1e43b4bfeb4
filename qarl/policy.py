"""The Policy the training loops train, and the one seam to the training backends that build it.

A backend is one module under qarl/backends with `check(cfg)` (what it refuses, before anything loads) and
`build(cfg, model_dir, tokenizer, fmt, texts, trainable) -> Policy`; `policy.backend` picks it. A backend subclasses
`Policy` where it must differ (gradient reductions and norm, saving), so the loops, the optimizer, checkpoints and
refit never ask which backend they run.

`build_policy` goes recipe -> model directory -> (checks) -> backend: model -> quantizers -> calibration.
Everything that can be wrong with the input is checked before the expensive steps.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TypeVar
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from qarl.calibration import calibration_batches, load_calibration_texts
from qarl.config import ConfigError, LoraConfig, PolicyConfig
from qarl.lora import AdapterDisabled, QuantNoise, pack_base, save_adapter, write_lora_manifest
from qarl.models.checks import with_pad_token
from qarl.models.resolve import resolve_model_dir
from qarl.quant import QuantFormat, load_quantizer_state, pack_frozen_weights, quantizer_state, resolve_format
from qarl.quant.formats import is_quantizer_key
from qarl.quant.rollout_view import RolloutView
from qarl.quant.state_file import write_quant_state

T = TypeVar("T")


def check_precision(cfg: PolicyConfig) -> None:
    """Compute and master dtypes that can train, before anything is loaded."""
    if cfg.master_dtype == "float16":
        raise ConfigError("policy.master_dtype=float16 cannot train: AdamW's updates and epsilon underflow in "
                          "fp16 and the loss goes NaN. Keep master weights in float32 (the default) and compute "
                          "in float16 with policy.dtype=float16.")
    width = {"float32": 4, "bfloat16": 2, "float16": 2}
    if width[cfg.master_dtype] < width[cfg.dtype]:
        raise ConfigError(f"policy.master_dtype={cfg.master_dtype} is narrower than the compute dtype "
                          f"policy.dtype={cfg.dtype}; master weights must be at least as wide (use float32).")


@dataclass
class Policy:
    """The trainable model, its tokenizer, its quantization format, and where the engine starts from.

    `model` answers like a Hugging Face causal LM (`model(input_ids, attention_mask).logits`). `master` holds the
    master weights by parameter name when they are wider than the compute dtype (fp32 masters, bf16/fp16
    model); None when the model's own parameters are the masters.
    """

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    format: QuantFormat | None
    model_dir: str
    master: dict[str, torch.Tensor] | None = None
    rollout: RolloutView | None = None  # set when the engine quantizes differently (attach_rollout_view)
    lora: LoraConfig | None = None  # adapters over a frozen base (qarl/lora.py); None: full training
    noise: QuantNoise | None = None  # LoRA's adaptive quantization noise, when on (`start_noise`)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def rollout_model(self) -> torch.nn.Module:
        """The model the rollout engine is refitted from: the policy itself, or (rollouts quantized in
        another format) the policy's current weights quantized and calibrated in the engine's format."""
        return self.rollout.sync(self.master_state_dict()) if self.rollout is not None else self.model

    def kl_reference(self, fresh_model: Callable[[], torch.nn.Module]) -> torch.nn.Module:
        """The frozen model the KL term compares with: a LoRA policy's own base (adapters off, no copy);
        otherwise `fresh_model()`, the step-0 policy, frozen, its quantized weights kept as their codes."""
        if self.lora is not None:
            return AdapterDisabled(self.model)
        model = fresh_model().eval().requires_grad_(False)
        pack_frozen_weights(model)
        return model

    def start_noise(self, total_steps: int, seed: int) -> None:
        """Turn on LoRA's adaptive quantization noise if the config asks for it (before the first refit)."""
        if self.lora is not None and self.lora.noise_start > 0:
            self.noise = QuantNoise(self.model, self.lora, total_steps, seed)

    def prepare_step(self, step: int) -> dict[str, float]:
        """Set the policy state that is a function of the step (LoRA's noise) before the refit that
        serves `step`'s rollout; returns its metrics for that step's row."""
        return {"lora/noise_std": self.noise.apply(step)} if self.noise is not None else {}

    def local_share(self, micro_batches: list[T]) -> list[T]:
        """The micro-batches of a step this process trains on: all of them (data parallelism, where a backend has
        it, gives each data-parallel process its share; `finish_gradients` then sums their gradients)."""
        return micro_batches

    def all_values(self, values: list[float]) -> list[float]:
        """Per-micro-batch metric values of every process's `local_share`, concatenated: here, `values`."""
        return values

    def finish_gradients(self) -> None:
        """After the backward passes of a step, before the optimizer reads the gradients: what a backend must
        still do to them (the Megatron backend's tensor- and data-parallel reductions); nothing here."""

    def clip_gradients(self, named: list[tuple[str, torch.Tensor]], max_norm: float) -> torch.Tensor:
        """Scale the gradients of these (name, tensor) pairs to a total norm of at most `max_norm`; returns the
        norm before clipping."""
        return torch.nn.utils.clip_grad_norm_([t for _, t in named], max_norm)

    def save(self, out_dir: Path) -> None:
        """Write the policy as a Hugging Face directory of its master weights (a LoRA policy: its adapter
        and a pointer to its frozen base) plus its quantizer state (the layout is in qarl/checkpoint.py)."""
        if self.lora is not None:
            save_adapter(self.model, self.lora, out_dir / "adapter", base_model=self.model_dir)
            write_lora_manifest(out_dir, self.lora, self.model_dir, self.model.dtype)
        else:
            policy_dir = out_dir / "policy"
            self.model.save_pretrained(policy_dir, state_dict=self.master_state_dict(), safe_serialization=True)
            self.tokenizer.save_pretrained(policy_dir)
        if self.format is not None:
            write_quant_state(out_dir, quantizer_state(self.model), self.format, self.device)

    def load_quantizer_state(self, state: dict[str, torch.Tensor]) -> None:
        """The amax `save` wrote, into a policy built with the same format and left uncalibrated (a qlora base
        is packed once it has its amax)."""
        load_quantizer_state(self.model, state)
        if self.lora is not None:
            pack_base(self.model, self.lora)

    def master_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's weights as a checkpoint keeps them: master precision, no quantizer buffers."""
        state = {k: v for k, v in self.model.state_dict(keep_vars=True).items() if not is_quantizer_key(k)}
        if self.master is not None:
            by_tensor = {id(p): self.master[n] for n, p in self.model.named_parameters()}
            state = {k: by_tensor.get(id(v), v) for k, v in state.items()}  # tied weights map to one master
        return {k: v.detach() for k, v in state.items()}


# policy.backend -> the module that checks and builds its Policy, imported on use
BACKENDS = {"hf": "qarl.backends.hf", "megatron": "qarl.backends.megatron_policy"}


def backend_module(cfg: PolicyConfig) -> ModuleType:
    """The module of `policy.backend` (its `check` and `build`), imported on use."""
    if cfg.backend not in BACKENDS:
        raise ConfigError(f"policy.backend={cfg.backend!r}; choose one of {sorted(BACKENDS)}")
    return importlib.import_module(BACKENDS[cfg.backend])


def check_backend(cfg: PolicyConfig) -> None:
    """`policy.backend` and what it allows, before anything loads."""
    module = backend_module(cfg)
    module.check(cfg)


def build_policy(
    cfg: PolicyConfig,
    task_texts: list[str],
    model_dir: str | None = None,
    fmt: QuantFormat | None | str = "from-config",
    calibrate: bool = True,
    trainable: bool = False,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> Policy:
    """Load and quantize the policy with `cfg.backend`. `fmt` overrides `cfg.quant_cfg`; `calibrate=False`
    leaves amax to be loaded from a saved quantizer state. `trainable`: keep master weights
    (`cfg.master_dtype`) when they are wider than the compute dtype; the model is then cast to the compute
    dtype, so it computes with exactly the tensors a compute-dtype load would give (round to nearest even)."""
    check_precision(cfg)
    if fmt == "from-config":
        fmt = resolve_format(cfg.quant_cfg)
    model_dir = model_dir or resolve_model_dir(cfg.model_name)
    if cfg.exact_forward:
        from qarl.backends.exact_forward import check_exact_forward
        from qarl.models.checks import load_pretrained

        check_exact_forward(load_pretrained(AutoConfig, model_dir, cfg.trust_remote_code))
    texts = load_calibration_texts(cfg, task_texts) if fmt is not None and calibrate else None
    tokenizer = tokenizer or AutoTokenizer.from_pretrained(model_dir, trust_remote_code=cfg.trust_remote_code)
    tokenizer = with_pad_token(tokenizer)
    return backend_module(cfg).build(cfg, model_dir, tokenizer, fmt, texts, trainable)


def attach_rollout_view(policy: Policy, cfg: PolicyConfig, calibration_texts: list[str],
                        fmt: QuantFormat | None | str = "from-config") -> None:
    """When `policy.generation.quant_cfg` (`fmt`: it resolved) differs from the policy's format (allowed by
    `allow_quant_mismatch`), give the policy a RolloutView in the generation format: a second copy of
    the model that the engine is refitted from (qarl/quant/rollout_view.py). Otherwise nothing."""
    fmt = resolve_format(cfg.generation.quant_cfg) if fmt == "from-config" else fmt
    if fmt is None or (policy.format is not None and fmt.fingerprint() == policy.format.fingerprint()):
        return
    texts = load_calibration_texts(cfg, calibration_texts)
    view = build_policy(cfg, [], model_dir=policy.model_dir, fmt=fmt, calibrate=False)
    batches = list(calibration_batches(texts, view.tokenizer, cfg, view.device))
    policy.rollout = RolloutView(view.model, fmt, batches)
