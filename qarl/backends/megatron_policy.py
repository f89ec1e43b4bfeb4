"""`policy.backend: megatron`: the Megatron-core model (qarl/backends/megatron.py) behind qarl's Policy, so the
training loops, the optimizer, checkpoints and refit run it exactly as they run the Hugging Face backend.

What differs is only what a backend must own: how the model is built (Megatron's GPTModel of this TP rank,
quantized by ModelOpt's Megatron plugin, calibrated on the HF backend's very batches), the gradient
reductions before an optimizer step (tensor and data parallel), and how a checkpoint's weights are written
(gathered from the shards into Hugging Face names, so a checkpoint is an ordinary HF one that either backend,
`qarl export` and `qarl eval` load).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from qarl.backends.megatron import (MegatronModel, all_data_parallel_values, build_megatron_model, check_megatron_model,
                                    data_parallel_rank_and_size, read_master_weights)
from qarl.calibration import calibration_batches
from qarl.config import ConfigError, PolicyConfig
from qarl.distributed import local_device
from qarl.models.resolve import default_device, resolve_model_dir
from qarl.policy import Policy, T
from qarl.quant import QuantFormat, resolve_format
from qarl.quant.formats import same_format


@dataclass
class MegatronPolicy(Policy):
    """A Policy whose `model` is this TP rank's `MegatronModel` and whose `master` (when wider than the compute
    dtype) holds this rank's shards of the master weights."""

    model: MegatronModel

    def local_share(self, micro_batches: list[T]) -> list[T]:
        """Every data-parallel rank's own micro-batches (interleaved); the TP ranks of one data-parallel rank share
        them."""
        rank, size = data_parallel_rank_and_size()
        return micro_batches[rank::size]

    def all_values(self, values: list[float]) -> list[float]:
        return all_data_parallel_values(values)

    def finish_gradients(self) -> None:
        self.model.finish_gradients()

    def clip_gradients(self, named: list[tuple[str, torch.Tensor]], max_norm: float) -> torch.Tensor:
        """The norm of the whole model's gradient: the squares of the TP-sharded parameters summed across the TP
        ranks, those of the parameters every rank holds whole counted once; then every rank clips its tensors by it."""
        return self.model.clip_gradients(named, max_norm)

    def save(self, out_dir: Path) -> None:
        self.model.save_policy(out_dir, self.format, self.tokenizer, masters=self.master)

    def load_quantizer_state(self, state: dict[str, torch.Tensor]) -> None:
        self.model.load_quantizer_state(state)


def refuse_adapters(cfg: PolicyConfig) -> None:
    if cfg.lora.mode != "none":
        raise ConfigError(f"policy.lora.mode={cfg.lora.mode}: the Megatron backend trains whole models; LoRA adapters "
                          "train on the Hugging Face backend (policy.backend=hf)")


def check(cfg: PolicyConfig) -> None:
    """What the Megatron backend cannot run, refused before anything loads: adapters, rollouts in another format,
    a process count torchrun did not give, a model family, TP size or block size the converter refuses. Under
    torchrun on GPUs, each process then takes its own GPU (LOCAL_RANK), before the warm start or anything else
    touches one."""
    refuse_adapters(cfg)
    for knob, layers, on in (("compile_norms", "RMSNorm layers", cfg.compile_norms),
                             ("compile_mlp", "gated MLPs", cfg.compile_mlp),
                             ("compile_layers", "decoder layers", cfg.compiles_layers)):
        if on:
            raise ConfigError(f"policy.{knob} compiles the HF backend's {layers}; the Megatron backend has its own: "
                              "set it false or use policy.backend=hf")
    if cfg.compiles_scores:
        raise ConfigError("policy.compile_scores compiles the HF backend's scoring of its linear head in chunks; the "
                          "Megatron backend scores from its full logits: set it false or use policy.backend=hf")
    fmt = resolve_format(cfg.quant_cfg)
    if not same_format(fmt, resolve_format(cfg.generation.quant_cfg)):
        raise ConfigError("the Megatron backend refits the engine in the policy's own format: set "
                          "policy.generation.quant_cfg to policy.quant_cfg, or use policy.backend=hf for rollouts "
                          "quantized in another format")
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world % cfg.tensor_parallel_size:
        raise ConfigError(f"policy.tensor_parallel_size={cfg.tensor_parallel_size} does not divide the {world} "
                          f"process(es) that run this command: launch it with `torchrun --nproc_per_node N -m qarl ...`, "
                          f"N a multiple of {cfg.tensor_parallel_size} (the processes beyond TP are data parallel)")
    if cfg.generation.tensor_parallel_size not in (1, world):
        raise ConfigError(f"policy.generation.tensor_parallel_size={cfg.generation.tensor_parallel_size}: under torchrun "
                          f"the engine spans the {world} process(es) of the policy; leave it at 1 or set {world}")
    check_megatron_model(resolve_model_dir(cfg.model_name), cfg.tensor_parallel_size, fmt)
    if torch.cuda.is_available():
        torch.cuda.set_device(local_device())


def build(cfg: PolicyConfig, model_dir: str, tokenizer: PreTrainedTokenizerBase, fmt: QuantFormat | None,
                          texts: list[str] | None, trainable: bool) -> MegatronPolicy:
    """This rank's Megatron model of `model_dir` in the compute dtype, quantized with `fmt` and calibrated on the
    batches the HF backend calibrates on (None: uncalibrated); `trainable`: with master weights read from the
    checkpoint in `cfg.master_dtype` when that is wider, as the HF backend keeps them."""
    refuse_adapters(cfg)
    device = default_device()
    # right-padded, as Megatron's causal attention takes rows (the HF backend's batches for right-padding tokenizers)
    calibration = None
    if texts is not None:
        calibration = lambda: calibration_batches(texts, tokenizer, cfg, device, padding_side="right")  # noqa: E731
    built = build_megatron_model(model_dir, cfg.tensor_parallel_size, getattr(torch, cfg.dtype), device, fmt=fmt,
                                 calibration=calibration, weight_cache=cfg.quant_weight_cache)
    master = None
    if trainable and cfg.master_dtype != cfg.dtype:
        master = read_master_weights(built, model_dir, getattr(torch, cfg.master_dtype))
    return MegatronPolicy(model=built, tokenizer=tokenizer, format=fmt, model_dir=model_dir, master=master)
