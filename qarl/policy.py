"""The policy the training loops train, and its log-probs. The Hugging Face backend lives here: a transformers
causal LM, fake-quantized by ModelOpt; `policy.backend` picks another (qarl/backends/megatron_policy.py), which
subclasses `Policy` where it must differ (building, gradient reductions and norm, saving), so the loops, the
optimizer, checkpoints and refit never ask which backend they run.

`build_policy` goes recipe -> model directory -> (checks) -> backend: model -> quantizers -> calibration.
Everything that can be wrong with the input is checked before the expensive steps.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from qarl.config import ConfigError, LoraConfig, PolicyConfig
from qarl.lora import AdapterDisabled, QuantNoise, apply_lora, save_adapter, write_lora_manifest
from qarl.quant import QuantFormat, load_quantizer_state, quantize_policy, quantizer_state, resolve_format
from qarl.quant.formats import format_to_yaml
from qarl.quant.rollout_view import RolloutView

EMBEDDED_PREFIX = "embedded:"
T = TypeVar("T")


def cache_dir() -> Path:
    return Path(os.environ.get("QARL_CACHE_DIR", Path.home() / ".cache" / "qarl"))


def resolve_model_dir(model_name: str) -> str:
    """"embedded:<size>" -> a locally made model directory; a local directory -> itself; else a hub name."""
    if model_name.startswith(EMBEDDED_PREFIX):
        from qarl.models.tiny import make_tiny_model

        size = model_name[len(EMBEDDED_PREFIX):]
        return str(make_tiny_model(cache_dir() / "embedded" / size, size=size))
    path = Path(model_name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ConfigError(f"{path} is not a Hugging Face model directory (no config.json)")
        return str(path)
    if model_name.startswith((".", "/", "~")) or model_name.count("/") != 1:
        raise ConfigError(f"model not found: {model_name!r} is neither a local model directory nor a hub id (org/name)")
    return model_name  # a hub id: transformers and vLLM resolve it (needs a reachable hub or a warm cache)


def load_calibration_texts(cfg: PolicyConfig, task_texts: list[str]) -> list[str]:
    """`quant_calib_data`: "task" (the task's prompts), a local file, or a datasets hub name."""
    source = cfg.quant_calib_data
    if source == "task":
        texts = task_texts
    else:
        import datasets

        path = Path(source).expanduser()
        builders = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text", ".csv": "csv"}
        try:
            if path.suffix in builders or path.exists():
                if not path.is_file():
                    raise ConfigError(f"calibration data file not found: {source}")
                data = datasets.load_dataset(builders.get(path.suffix, "json"), data_files=str(path), split="train")
            else:
                data = datasets.load_dataset(source, split="train")
        except ConfigError:
            raise
        except Exception as e:
            raise ConfigError(
                f"calibration data {source!r} could not be loaded ({type(e).__name__}: {e}). Use "
                "policy.quant_calib_data=task, a local .jsonl/.parquet/.txt file, or a reachable hub dataset."
            ) from None
        column = cfg.quant_calib_text_column if cfg.quant_calib_text_column in data.column_names else "text"
        if column not in data.column_names:
            raise ConfigError(
                f"calibration data {source!r} has no column {cfg.quant_calib_text_column!r} (columns: "
                f"{data.column_names}); set policy.quant_calib_text_column"
            )
        texts = [str(t) for t in data[column][: cfg.quant_calib_size]]
    texts = texts[: cfg.quant_calib_size]
    if not texts:
        raise ConfigError(f"calibration data {source!r} is empty")
    return texts


def calibration_batches(
    texts: list[str], tokenizer: PreTrainedTokenizerBase, cfg: PolicyConfig, device: torch.device,
    padding_side: str | None = None,
) -> Iterator[dict[str, torch.Tensor]]:
    """`texts` tokenized in batches of `cfg.quant_batch_size`, padded on the tokenizer's side (or `padding_side`)."""
    for start in range(0, len(texts), cfg.quant_batch_size):
        enc = tokenizer(
            texts[start : start + cfg.quant_batch_size],
            return_tensors="pt",
            padding=True,
            padding_side=padding_side or tokenizer.padding_side,
            truncation=True,
            max_length=cfg.quant_sequence_length,
        )
        yield {k: v.to(device) for k, v in enc.items()}


DTYPES = ("float32", "bfloat16", "float16")


def check_precision(cfg: PolicyConfig) -> None:
    """Compute and master dtypes that can train, before anything is loaded."""
    for key in ("dtype", "master_dtype"):
        if getattr(cfg, key) not in DTYPES:
            raise ConfigError(f"policy.{key}={getattr(cfg, key)!r}; choose one of {DTYPES}")
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
        otherwise `fresh_model()`, the step-0 policy, frozen."""
        if self.lora is not None:
            return AdapterDisabled(self.model)
        return fresh_model().eval().requires_grad_(False)

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
            save_file(quantizer_state(self.model), str(out_dir / "quantizer_state.safetensors"))
            (out_dir / "quant_format.yaml").write_text(format_to_yaml(self.format))

    def load_quantizer_state(self, state: dict[str, torch.Tensor]) -> None:
        """The amax `save` wrote, into a policy built with the same format and left uncalibrated."""
        load_quantizer_state(self.model, state)

    def master_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's weights as a checkpoint keeps them: master precision, no quantizer buffers."""
        state = {k: v for k, v in self.model.state_dict(keep_vars=True).items() if "_quantizer." not in k}
        if self.master is not None:
            by_tensor = {id(p): self.master[n] for n, p in self.model.named_parameters()}
            state = {k: by_tensor.get(id(v), v) for k, v in state.items()}  # tied weights map to one master
        return {k: v.detach() for k, v in state.items()}


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_model(model_dir: str, cfg: PolicyConfig, device: torch.device, dtype: str | None = None) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype or cfg.dtype), trust_remote_code=cfg.trust_remote_code
    )
    return model.to(device)


# policy.backend -> "module:function" that builds its Policy; each backend is one module, imported on use
BACKENDS = {"hf": "qarl.policy:build_hf_policy", "megatron": "qarl.backends.megatron_policy:build_megatron_policy"}


def _backend_module(cfg: PolicyConfig) -> tuple[object, str]:
    """(the module of `policy.backend`, the name of its builder), imported on use."""
    if cfg.backend not in BACKENDS:
        raise ConfigError(f"policy.backend={cfg.backend!r}; choose one of {sorted(BACKENDS)}")
    module, _, function = BACKENDS[cfg.backend].partition(":")
    return importlib.import_module(module), function


def check_backend(cfg: PolicyConfig) -> None:
    """`policy.backend` and what it allows, before anything loads (the backend's own `check` does the rest)."""
    module, _ = _backend_module(cfg)
    if cfg.tensor_parallel_size < 1:
        raise ConfigError(f"policy.tensor_parallel_size={cfg.tensor_parallel_size} must be at least 1")
    if cfg.backend == "hf":
        if cfg.tensor_parallel_size != 1:
            raise ConfigError(f"policy.tensor_parallel_size={cfg.tensor_parallel_size} needs policy.backend=megatron: "
                              "the Hugging Face backend trains in one process")
        if int(os.environ.get("WORLD_SIZE", 1)) > 1:
            raise ConfigError("the Hugging Face backend trains in one process, but torchrun started "
                              f"{os.environ['WORLD_SIZE']}: run it without torchrun, or set policy.backend=megatron")
        return
    module.check(cfg)


def build_policy(
    cfg: PolicyConfig,
    task_texts: list[str],
    model_dir: str | None = None,
    fmt: QuantFormat | None | str = "from-config",
    calibrate: bool = True,
    trainable: bool = False,
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
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=cfg.trust_remote_code)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    module, function = _backend_module(cfg)
    return getattr(module, function)(cfg, model_dir, tokenizer, fmt, texts, trainable)


def build_hf_policy(cfg: PolicyConfig, model_dir: str, tokenizer: PreTrainedTokenizerBase, fmt: QuantFormat | None,
                    texts: list[str] | None, trainable: bool) -> Policy:
    """The Hugging Face backend: a transformers model, quantized by ModelOpt and calibrated on `texts` (None:
    uncalibrated)."""
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
    if cfg.exact_forward:
        from qarl.backends.exact_forward import enable_exact_forward

        enable_exact_forward(model)
    return Policy(model=model, tokenizer=tokenizer, format=fmt, model_dir=model_dir, master=master, lora=lora)


def attach_rollout_view(policy: Policy, cfg: PolicyConfig, calibration_texts: list[str]) -> None:
    """When `policy.generation.quant_cfg` differs from the policy's format (allowed by
    `allow_quant_mismatch`), give the policy a RolloutView in the generation format: a second copy of
    the model that the engine is refitted from (qarl/quant/rollout_view.py). Otherwise nothing."""
    fmt = resolve_format(cfg.generation.quant_cfg)
    if fmt is None or (policy.format is not None and fmt.fingerprint() == policy.format.fingerprint()):
        return
    texts = load_calibration_texts(cfg, calibration_texts)
    view = build_policy(cfg, [], model_dir=policy.model_dir, fmt=fmt, calibrate=False)
    batches = list(calibration_batches(texts, view.tokenizer, cfg, view.device))
    policy.rollout = RolloutView(view.model, fmt, batches)


@dataclass
class TokenScores:
    """Per completion token, padded to [batch, longest completion]: log-prob, entropy, and a 0/1 mask."""

    logprobs: torch.Tensor
    entropy: torch.Tensor
    mask: torch.Tensor


def completion_logits(
    model: PreTrainedModel, prompts: list[list[int]], completions: list[list[int]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Teacher-forced logits that predict each completion token, [batch, longest completion, vocab],
    with the completion tokens and a 0/1 mask of the same [batch, longest completion] shape."""
    device = next(model.parameters()).device
    batch, width = len(prompts), max(len(p) + len(c) for p, c in zip(prompts, completions))
    longest = max(len(c) for c in completions)
    ids = torch.full((batch, width), pad_id, dtype=torch.long, device=device)
    attention = torch.zeros_like(ids)
    # index of the logit that predicts completion token j of row i: len(prompt_i) - 1 + j
    positions = torch.zeros((batch, longest), dtype=torch.long, device=device)
    mask = torch.zeros((batch, longest), device=device)
    targets = torch.full((batch, longest), pad_id, dtype=torch.long, device=device)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        ids[i, : len(p) + len(c)] = torch.tensor(p + c, device=device)
        attention[i, : len(p) + len(c)] = 1
        positions[i] = (len(p) - 1 + torch.arange(longest, device=device)).clamp(max=width - 1)
        mask[i, : len(c)] = 1
        targets[i, : len(c)] = torch.tensor(c, dtype=torch.long, device=device)
    logits = model(input_ids=ids, attention_mask=attention).logits
    return logits.gather(1, positions[..., None].expand(-1, -1, logits.shape[-1])), targets, mask


def score_completions(
    model: PreTrainedModel,
    prompts: list[list[int]],
    completions: list[list[int]],
    pad_id: int,
    temperature: float = 1.0,
) -> TokenScores:
    """Teacher-forced log-prob (and entropy) of each completion token given everything before it.

    Computed in fp32 from logits / temperature, the same distribution the engine samples from; a model
    with the exact forward picks each token's log-prob with the engine's own kernel
    (`qarl_token_logprobs`, qarl/backends/exact_forward.py). Carries grad when grad is enabled.
    """
    logits, targets, mask = completion_logits(model, prompts, completions, pad_id)
    log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)
    engine_scoring = getattr(model, "qarl_token_logprobs", None)
    picked = (engine_scoring(logits, targets, temperature) if engine_scoring is not None
              else log_probs.gather(-1, targets[..., None]).squeeze(-1))
    token_logprobs = picked * mask
    entropy = -(log_probs.exp() * log_probs).sum(-1) * mask
    return TokenScores(logprobs=token_logprobs, entropy=entropy, mask=mask)
