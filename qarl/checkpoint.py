"""Checkpoints: written atomically, found again on resume, loadable without any training state.

Layout of RUN_DIR/checkpoints/step_N/:
  policy/                      an ordinary Hugging Face directory of the master weights + tokenizer
    or, for a LoRA policy (qarl/lora.py), instead of policy/:
  adapter/                     a PEFT adapter directory (adapter_config.json, adapter_model.safetensors)
  lora.json                    the LoRA settings and the base they belong to (path + weight fingerprint)
  quantizer_state.safetensors  the calibrated amax of every quantizer (absent for unquantized runs), with the FP8
                               kernel it trained under in its metadata (qarl/quant/state_file.py)
  quant_format.yaml            the resolved ModelOpt config the amax belongs to
  trainer_state.pt             optimizer state, RNG states, data position, step (weights_only-loadable)
  trainer_state.rankR.pt       under torchrun, process R's own (its optimizer state is that of its shards)
  run.json                     the run id (RUN_DIR/qarl_run.json) and step: pruning and resuming keep to one run
  manifest.json                every file above with its size and sha256 (qarl/run_dir.py)
  COMPLETE                     written last; a directory without it is never loaded
A checkpoint is assembled in step_N.tmp and renamed into place, so a crash leaves either the old
set of checkpoints or the new one, never a half-written step_N. Under torchrun the main process writes
the shared files (policy/ gathered from the shards) and renames; every process writes its trainer state.
A checkpoint damaged after it was written (a file truncated or changed: its manifest tells) is never loaded:
a run directory's newest intact checkpoint stands in for it, and a checkpoint named directly is refused.
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file

from qarl.config import ConfigError, PolicyConfig
from qarl.distributed import barrier, is_main_process, rank, world_size
from qarl.files import give_umask_modes
from qarl.lora import load_adapter_state, read_lora_manifest
from qarl.quant import QuantFormat
from qarl.quant.formats import format_from_yaml
from qarl.quant.state_file import QUANTIZER_STATE
from qarl.run_dir import (CHECKPOINT_RUN, complete_checkpoints, prunable, read_identity, resolve_checkpoint,
                          write_manifest)

if TYPE_CHECKING:
    from qarl.optim import PolicyOptimizer
    from qarl.policy import Policy


def save_checkpoint(run_dir: str | Path, step: int, policy: Policy, trainer_state: dict[str, Any],
                    keep: int = 2) -> Path:
    """Write checkpoints/step_<step> atomically, marked with the run's id and with a manifest of its files, and keep the
    newest `keep` intact complete ones of this run. Collective under torchrun: every process calls it with its own
    trainer state."""
    root = Path(run_dir) / "checkpoints"
    final = root / f"step_{step}"
    tmp = root / f"step_{step}.tmp"
    if is_main_process():
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    barrier()
    policy.save(tmp)
    torch.save(trainer_state, tmp / _trainer_state_file())
    barrier()
    if is_main_process():
        run_id = (read_identity(run_dir) or {}).get("run_id")
        (tmp / CHECKPOINT_RUN).write_text(json.dumps({"run_id": run_id, "step": step}))
        give_umask_modes(tmp)  # (safetensors writes its files 0600)
        write_manifest(tmp)
        (tmp / "COMPLETE").write_text(str(step))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        for old in prunable(complete_checkpoints(run_dir, run_id), keep):
            shutil.rmtree(old)
    barrier()
    return final


def _trainer_state_file() -> str:
    return "trainer_state.pt" if rank() == 0 else f"trainer_state.rank{rank()}.pt"


def checkpoint_format(checkpoint: Path) -> QuantFormat | None:
    path = checkpoint / "quant_format.yaml"
    return format_from_yaml(path.read_text()) if path.is_file() else None


def load_trainer_state(checkpoint: Path) -> dict[str, Any]:
    state = torch.load(checkpoint / _trainer_state_file(), weights_only=True)
    if state.get("processes", 1) != world_size():
        raise ConfigError(f"checkpoint {checkpoint} was written by {state['processes']} process(es) and this run has "
                          f"{world_size()}: resume with the tensor parallelism it was trained with (its policy/ loads at "
                          "any, e.g. as a new run's policy.model_name)")
    return state


def trainer_state(step: int, optimizer: PolicyOptimizer, prompts_per_step: int) -> dict[str, Any]:
    """What a checkpoint keeps beyond the policy to continue exactly: optimizer, RNGs, data position."""
    return {"step": step, "optimizer": optimizer.state_dict(), "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(), "data_position": step * prompts_per_step, "processes": world_size()}


def restore_trainer_state(checkpoint: Path, optimizer: PolicyOptimizer) -> int:
    """Inverse of `trainer_state`: optimizer and RNGs restored; returns the step to continue from."""
    state = load_trainer_state(checkpoint)
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["torch_rng"])
    random.setstate(state["python_rng"])
    return state["step"]


def model_dir_dtype(model_dir: Path) -> str:
    """The dtype a Hugging Face directory was saved in, from its config.json."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
    return str(dtype).replace("torch.", "")


def trained_dtype(checkpoint: Path) -> str:
    """The dtype a checkpoint's policy was saved (= trained) in; a LoRA checkpoint records it."""
    if (checkpoint / "lora.json").is_file():
        return json.loads((checkpoint / "lora.json").read_text())["dtype"]
    return model_dir_dtype(checkpoint / "policy")


def checkpoint_model_dir(checkpoint: Path) -> Path:
    """The Hugging Face directory a checkpoint's model loads from: its policy/, or a LoRA adapter's base."""
    if (checkpoint / "lora.json").is_file():
        return Path(read_lora_manifest(checkpoint)[1])
    return checkpoint / "policy"


def load_policy_checkpoint(checkpoint: str | Path, cfg: PolicyConfig, trainable: bool = False,
                           quantized: bool = True, base_dir: str | None = None) -> Policy:
    """Rebuild the policy of a checkpoint: master weights (or base + adapter), same quantizers, saved
    amax. `trainable`: keep the master weights, for a resumed run. `quantized=False`: the same weights
    (and adapter) without quantizers. `base_dir`: the base a LoRA checkpoint must have been trained on
    (checked by fingerprint; default: the base the checkpoint points to)."""
    from qarl.policy import build_policy

    checkpoint = resolve_checkpoint(checkpoint)
    fmt = checkpoint_format(checkpoint) if quantized else None
    model_dir = str(checkpoint / "policy")
    if (checkpoint / "lora.json").is_file():
        lora, model_dir = read_lora_manifest(checkpoint, base_dir)
        if cfg.lora.mode != "none" and cfg.lora != lora:
            raise ConfigError(f"policy.lora in the recipe ({cfg.lora}) differs from the settings checkpoint "
                              f"{checkpoint} was trained with ({lora}); a run resumes with the settings it started with")
        cfg = dataclasses.replace(cfg, lora=lora)
    elif cfg.lora.mode != "none":
        raise ConfigError(f"checkpoint {checkpoint} holds a fully trained policy, not a LoRA adapter; "
                          "set policy.lora.mode=none to load it")
    policy = build_policy(cfg, [], model_dir=model_dir, fmt=fmt, calibrate=False, trainable=trainable)
    if fmt is not None:
        policy.load_quantizer_state(load_file(str(checkpoint / QUANTIZER_STATE)))
    if policy.lora is not None:
        load_adapter_state(policy.model, load_file(str(checkpoint / "adapter" / "adapter_model.safetensors")))
    return policy
