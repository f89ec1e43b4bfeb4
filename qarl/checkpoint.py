"""Checkpoints: written atomically, found again on resume, loadable without any training state.

Layout of RUN_DIR/checkpoints/step_N/:
  policy/                      an ordinary Hugging Face directory of the master weights + tokenizer
  quantizer_state.safetensors  the calibrated amax of every quantizer (absent for unquantized runs)
  quant_format.yaml            the resolved ModelOpt config the amax belongs to
  trainer_state.pt             optimizer state, RNG states, data position, step (weights_only-loadable)
  COMPLETE                     written last; a directory without it is never loaded
A checkpoint is assembled in step_N.tmp and renamed into place, so a crash leaves either the old
set of checkpoints or the new one, never a half-written step_N.
"""

from __future__ import annotations

import random
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file

from qarl.config import ConfigError, PolicyConfig
from qarl.quant import QuantFormat, load_quantizer_state, quantizer_state
from qarl.quant.formats import format_from_yaml, format_to_yaml

if TYPE_CHECKING:
    from qarl.optim import PolicyOptimizer
    from qarl.policy import Policy

STEP_DIR = re.compile(r"^step_(\d+)$")


def save_policy(out_dir: Path, policy: Policy) -> None:
    """Write the policy as a Hugging Face directory of its master weights plus its quantizer state."""
    policy_dir = out_dir / "policy"
    policy.model.save_pretrained(policy_dir, state_dict=policy.master_state_dict(), safe_serialization=True)
    policy.tokenizer.save_pretrained(policy_dir)
    if policy.format is not None:
        save_file(quantizer_state(policy.model), str(out_dir / "quantizer_state.safetensors"))
        (out_dir / "quant_format.yaml").write_text(format_to_yaml(policy.format))


def save_checkpoint(run_dir: str | Path, step: int, policy: Policy, trainer_state: dict[str, Any],
                    keep: int = 2) -> Path:
    """Write checkpoints/step_<step> atomically and keep the newest `keep` complete ones."""
    root = Path(run_dir) / "checkpoints"
    final = root / f"step_{step}"
    tmp = root / f"step_{step}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    save_policy(tmp, policy)
    torch.save(trainer_state, tmp / "trainer_state.pt")
    (tmp / "COMPLETE").write_text(str(step))
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    for old in complete_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old)
    return final


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / "checkpoints"
    found = []
    for path in root.glob("step_*") if root.is_dir() else []:
        match = STEP_DIR.match(path.name)
        if match and (path / "COMPLETE").is_file():
            found.append((int(match.group(1)), path))
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def checkpoint_format(checkpoint: Path) -> QuantFormat | None:
    path = checkpoint / "quant_format.yaml"
    return format_from_yaml(path.read_text()) if path.is_file() else None


def load_trainer_state(checkpoint: Path) -> dict[str, Any]:
    return torch.load(checkpoint / "trainer_state.pt", weights_only=True)


def trainer_state(step: int, optimizer: PolicyOptimizer, prompts_per_step: int) -> dict[str, Any]:
    """What a checkpoint keeps beyond the policy to continue exactly: optimizer, RNGs, data position."""
    return {"step": step, "optimizer": optimizer.state_dict(), "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(), "data_position": step * prompts_per_step}


def restore_trainer_state(checkpoint: Path, optimizer: PolicyOptimizer) -> int:
    """Inverse of `trainer_state`: optimizer and RNGs restored; returns the step to continue from."""
    state = load_trainer_state(checkpoint)
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["torch_rng"])
    random.setstate(state["python_rng"])
    return state["step"]


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, or a run directory (its newest complete checkpoint)."""
    path = Path(path)
    if (path / "policy").is_dir():
        if (path.parent.name == "checkpoints") and not (path / "COMPLETE").is_file():
            raise ConfigError(f"checkpoint {path} is incomplete (no COMPLETE marker): it was never finished")
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise ConfigError(f"no checkpoint found at {path}: expected a step_N directory or a run directory")
    return latest


def load_policy_checkpoint(checkpoint: str | Path, cfg: PolicyConfig, trainable: bool = False) -> Policy:
    """Rebuild the quantized policy of a checkpoint: master weights, same quantizers, saved amax
    (`trainable`: keep the master weights, for a resumed run)."""
    from qarl.policy import build_policy

    checkpoint = resolve_checkpoint(checkpoint)
    fmt = checkpoint_format(checkpoint)
    policy = build_policy(cfg, [], model_dir=str(checkpoint / "policy"), fmt=fmt, calibrate=False, trainable=trainable)
    if fmt is not None:
        load_quantizer_state(policy.model, load_file(str(checkpoint / "quantizer_state.safetensors")))
    return policy
