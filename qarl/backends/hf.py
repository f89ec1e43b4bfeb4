"""`policy.backend: hf`: a transformers causal LM in one process, fake-quantized by ModelOpt, with master weights
kept apart when they are wider than the compute dtype."""

from __future__ import annotations

import os

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from qarl.calibration import calibration_batches
from qarl.config import ConfigError, PolicyConfig
from qarl.lora import apply_lora, pack_base
from qarl.models.checks import load_pretrained, meta_model
from qarl.models.experts import check_experts, config_has_experts
from qarl.models.compiled import check_decoder_layers, check_gated_mlps, compile_layers, compile_mlp, compile_norms
from qarl.models.resolve import default_device
from qarl.models.block_attention import enable_block_attention
from qarl.models.cpu_moe import enable_cpu_moe
from qarl.models.varlen_attention import enable_varlen_attention
from qarl.policy import Policy
from qarl.scoring import compile_scores
from qarl.quant import (QuantFormat, mark_plain_linears, quantize_policy, swaps_functions_in_forward,
                        traced_quantized_modules)


def check(cfg: PolicyConfig) -> None:
    """What this backend cannot do, refused before anything loads: it trains in one process."""
    if cfg.tensor_parallel_size != 1:
        raise ConfigError(f"policy.tensor_parallel_size={cfg.tensor_parallel_size} needs policy.backend=megatron: "
                          "the Hugging Face backend trains in one process")
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        raise ConfigError("the Hugging Face backend trains in one process, but torchrun started "
                          f"{os.environ['WORLD_SIZE']}: run it without torchrun, or set policy.backend=megatron")


def load_model(model_dir: str, cfg: PolicyConfig, device: torch.device, dtype: str | None = None) -> PreTrainedModel:
    """The model in `dtype`; a Mixture-of-Experts model's experts one by one (transformers' eager experts, the order
    ModelOpt's quantized experts and the engine's CPU experts compute in), whether quantized or not; on CPU its MoE
    blocks compute as the CPU engine's (qarl/models/cpu_moe.py)."""
    config = load_pretrained(AutoConfig, model_dir, cfg.trust_remote_code)
    experts = {"experts_implementation": "eager"} if config_has_experts(config) else {}
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype or cfg.dtype), trust_remote_code=cfg.trust_remote_code, **experts
    )
    if device.type == "cuda":  # packed micro-batches attend within each sequence (padded rows: SDPA as before)
        enable_varlen_attention(model)
    else:  # every token's attention and MoE block computed as the CPU rollout engine computes them, to the bit
        enable_block_attention(model)
        enable_cpu_moe(model)
    return model.to(device)


def refuse_traced_quantized_layers(layers: torch.nn.ModuleList) -> None:
    """`policy.compile_layers` leaves qarl's quantized linear layers out of the compiled graphs (but for plain
    matmuls of held weights, `qarl.quant.mark_plain_linears`); a quantized layer of the decoder `layers` that runs a
    forward of its own would be traced (its fake quantization rounded by the compiler): refused."""
    traced = [f"layers.{i}.{name}" for i, layer in enumerate(layers) for name in traced_quantized_modules(layer)]
    if traced:
        raise ConfigError(f"policy.compile_layers leaves qarl's quantized linear layers out of the compiled graphs; "
                          f"{', '.join(traced[:3])}{' ...' if len(traced) > 3 else ''} run a forward of their own "
                          "(ModelOpt's, for a quantizer qarl's lean forward does not serve: a quantizer sequence, "
                          "enabled attention quantizers), which the compiler would trace: set "
                          "policy.compile_layers=false")


def enable_checkpointing(model: PreTrainedModel) -> None:
    """Activation checkpointing of each decoder layer (non-reentrant). torch stops a layer's recomputation once the
    tensors the backward needs are back, by raising inside the layer; a quantized module that replaces a torch
    function during its forward (ModelOpt's fused experts) would then leave it replaced, and every later layer
    would compute with it. Such a model's layers are recomputed whole (`early_stop` off: the layer's last ops
    again, which the backward does not need)."""
    whole = swaps_functions_in_forward(model)
    model.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": False, **({"early_stop": False} if whole else {})})


def build(cfg: PolicyConfig, model_dir: str, tokenizer: PreTrainedTokenizerBase, fmt: QuantFormat | None,
          texts: list[str] | None, trainable: bool) -> Policy:
    """A transformers model, quantized by ModelOpt and calibrated on `texts` (None: uncalibrated)."""
    architecture = meta_model(model_dir, cfg.trust_remote_code)
    check_experts(architecture.config.model_type, architecture)  # a MoE layout the refit can name, before loading
    if cfg.compile_mlp:
        check_gated_mlps(architecture)
    if cfg.compiles_layers:
        check_decoder_layers(architecture)
    device = default_device()
    master = None
    if trainable and cfg.master_dtype != cfg.dtype and cfg.lora.mode == "none":
        model = load_model(model_dir, cfg, device, dtype=cfg.master_dtype)
        master = {n: p.detach() for n, p in model.named_parameters()}  # .to() below leaves these alone
        model.to(getattr(torch, cfg.dtype))
    else:
        model = load_model(model_dir, cfg, device)
    if fmt is not None:
        batches = (lambda: calibration_batches(texts, tokenizer, cfg, device)) if texts is not None else None
        quantize_policy(model, fmt, batches, weight_cache=cfg.quant_weight_cache)
    lora = None
    if cfg.lora.mode != "none":  # a frozen base: no master copy; the adapters are the masters
        apply_lora(model, cfg.lora, dtype=getattr(torch, cfg.master_dtype))
        lora = cfg.lora
        if fmt is not None and texts is not None:  # calibrated (else packed once `load_quantizer_state` sets amax)
            pack_base(model, cfg.lora)
    if trainable and cfg.gradient_checkpointing == "on":  # "auto" was decided by the memory plan (qarl/memory.py)
        enable_checkpointing(model)
    if cfg.compile_norms:
        print(f"compiled {compile_norms(model)} RMSNorm layers (policy.compile_norms)")
    if cfg.compile_mlp:
        print(f"compiled {compile_mlp(model)} gated MLP activations (policy.compile_mlp)")
    if cfg.compiles_layers:  # "on"; an "auto" no training run decided (`qarl eval`) is off (PolicyConfig)
        layers = check_decoder_layers(model)
        refuse_traced_quantized_layers(layers)
        print(f"compiled {compile_layers(layers)} decoder layers (policy.compile_layers)")
        mark_plain_linears(model.get_decoder())
    if cfg.compiles_scores:
        compile_scores(model)
        print("the linear head's scoring compiled (policy.compile_scores)")
    if cfg.exact_forward:
        from qarl.backends.exact_forward import enable_exact_forward

        enable_exact_forward(model)
    return Policy(model=model, tokenizer=tokenizer, format=fmt, model_dir=model_dir, master=master, lora=lora)
