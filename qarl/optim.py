"""The policy's optimizer step, shared by every training loop: master weights, fp16 loss scaling, and
the guard against non-finite losses and gradients.

Mixed precision is a compute-dtype model plus master weights (`Policy.master`), not autocast: the
model's parameters are the bf16/fp16 tensors its forward, its fake quantizers and the rollout engine
all use, so the policy computes with exactly the weights vLLM receives, and every layer (norms,
embeddings, the head) runs in the compute dtype on both sides. The optimizer updates the fp32 masters
(AdamW state in fp32) and copies them, rounded, into the model after each step; updates far below a
bf16 ulp accumulate in the master instead of being rounded away. A quantized layer's compute weight is
then fake-quantized in place (`qarl.quant.fastpath.weight_cache.copy_masters`): the model holds exactly what its
forward and the engine use, quantized once per step. When master and compute dtype are equal the
model's parameters are the masters (the weight cache quantizes them once per step) and this is plain
AdamW with gradient clipping.

fp16 compute gets dynamic loss scaling (the loss is multiplied by a scale before backward so small
gradients survive fp16; an overflow halves the scale and skips the step; 2000 clean steps double it).
A step whose loss or gradient is not finite is skipped, not applied, and reported; `NonFiniteGuard`
stops a run after `trainer.max_nonfinite_steps` of them in a row.

AdamW's multi-tensor step allocates temporaries as large as all the tensors it steps at once (the masters' size, the
update's peak at a real shape); `PolicyOptimizer` steps groups of about `STEP_GROUP_BYTES` one after another instead,
freeing each group's gradients once it is stepped. A tensor's update is elementwise and its own (the masters are
tensors of one kind on one device, so every group takes the same AdamW implementation), so this is the one step's
result bit for bit (tests/unit/test_precision.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qarl.config import ConfigError, TrainingDiverged
from qarl.policy import Policy
from qarl.quant.fastpath.weight_cache import copy_masters, weight_holders

STEP_GROUP_BYTES = 2**30  # the masters AdamW steps at once (a larger tensor is a group of its own)


@dataclass
class StepResult:
    applied: bool
    nonfinite: bool  # the loss or the unscaled gradient was NaN/inf (not a mere loss-scale overflow)
    grad_norm: float
    loss_scale: float | None


class LossScaler:
    """Dynamic loss scaling for fp16 (the usual schedule: start high, halve on overflow, grow slowly)."""

    def __init__(self, scale: float = 2.0**16, growth_interval: int = 2000, min_scale: float = 1.0):
        self.scale, self.growth_interval, self.min_scale = scale, growth_interval, min_scale
        self.clean_steps = 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale, self.clean_steps = max(self.scale / 2, self.min_scale), 0
        else:
            self.clean_steps += 1
            if self.clean_steps % self.growth_interval == 0:
                self.scale *= 2

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.scale, self.clean_steps = float(state["scale"]), int(state["clean_steps"])


class PolicyOptimizer:
    """AdamW on the policy's master weights: `backward(loss)` per micro-batch, then `step()`."""

    def __init__(self, policy: Policy, lr: float, weight_decay: float, max_grad_norm: float):
        self.model = policy.model
        self.finish_gradients = policy.finish_gradients  # a backend's gradient reductions, before the step
        self.clip_gradients = policy.clip_gradients  # a backend's gradient norm (a sharded one sums across shards)
        self.all_values = policy.all_values  # data parallel: every process's values, for one decision on all of them
        named = [(n, p) for n, p in policy.model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.masters = self.params if policy.master is None else [policy.master[n] for n, _ in named]
        self.optimizer = torch.optim.AdamW(self.masters, lr=lr, weight_decay=weight_decay)
        self.step_groups = step_groups([m.numel() * m.element_size() for m in self.masters], STEP_GROUP_BYTES)
        self.max_grad_norm = max_grad_norm
        # fp16 compute needs loss scaling even when the trained tensors are fp32 (LoRA adapters): the
        # gradients pass through fp16 activations on their way back
        self.scaler = LossScaler() if self.params and policy.model.dtype == torch.float16 else None
        self._loss_finite: torch.Tensor | None = None
        self._kept_gradients = False
        self._holders = weight_holders(policy.model) if self.masters is not self.params else {}
        self._copy_masters()

    def _copy_masters(self) -> None:
        if self.masters is not self.params:
            copy_masters(zip(self.params, self.masters), self._holders)

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def zero_grad(self) -> None:
        if self._kept_gradients:
            for p in self.params:
                p.grad.zero_()
        else:
            self.model.zero_grad(set_to_none=True)
        self.optimizer.zero_grad(set_to_none=True)
        self._loss_finite = None

    def keep_gradients(self, keep: bool) -> None:
        """The trainable parameters' gradients as tensors made once (zeros), zeroed in place after each step and
        never replaced, so that a captured backward keeps adding into the memory it was captured with
        (qarl/graphs.py); False frees them. Only beside master weights of another dtype (their own gradients)."""
        if keep and self.masters is self.params:
            raise ValueError("kept gradients need master weights of their own (policy.master_dtype != policy.dtype)")
        self._kept_gradients = keep
        for p in self.params:
            p.grad = torch.zeros_like(p) if keep else None

    def backward(self, loss: torch.Tensor) -> None:
        self.note_loss(loss)
        (loss * self.scaler.scale if self.scaler else loss).backward()

    def note_loss(self, loss: torch.Tensor) -> None:
        """Count `loss` in the step's finite-loss check (`backward` does; a captured backward's caller calls it)."""
        finite = torch.isfinite(loss.detach())
        self._loss_finite = finite if self._loss_finite is None else self._loss_finite & finite

    def step(self) -> StepResult:
        """Apply the accumulated gradient, or skip it if the loss or the gradient is not finite."""
        self.finish_gradients()
        if self.masters is not self.params:  # compute-dtype grads -> fp32 master grads
            for p, m in zip(self.params, self.masters):
                m.grad = None if p.grad is None else p.grad.to(m.dtype)
                if not self._kept_gradients:
                    p.grad = None
        if self.scaler:
            for m in self.masters:
                if m.grad is not None:
                    m.grad.mul_(1.0 / self.scaler.scale)
        norm = self.clip_gradients(list(zip(self.names, self.masters)), self.max_grad_norm)
        local_finite = True if self._loss_finite is None else bool(self._loss_finite.item())
        loss_finite = all(self.all_values([float(local_finite)]))
        grad_finite = bool(torch.isfinite(norm).item())
        applied = loss_finite and grad_finite
        if applied:
            self._step_in_groups()
            self._copy_masters()
        # an fp16 gradient that overflows only because of the loss scale is not a non-finite gradient
        overflow = self.scaler is not None and loss_finite and not grad_finite
        nonfinite = not applied and not (overflow and self.scaler.scale > self.scaler.min_scale)
        if self.scaler:
            self.scaler.update(overflow=not applied)
        self.zero_grad()
        return StepResult(applied=applied, nonfinite=nonfinite, grad_norm=norm.item(),
                          loss_scale=self.scaler.scale if self.scaler else None)

    def _step_in_groups(self) -> None:
        """AdamW over one group of masters at a time (a tensor without a gradient is left alone by a step), each
        group's gradients freed once stepped: the step's temporaries are a group's size, not the masters'. An error
        midway (out of memory) leaves the step partly applied in memory; it stops the run, whose checkpoints on disk
        are whole."""
        grads = [m.grad for m in self.masters]
        for m in self.masters:
            m.grad = None
        for group in self.step_groups:
            for i in group:
                self.masters[i].grad = grads[i]
            self.optimizer.step()
            for i in group:
                self.masters[i].grad = grads[i] = None

    def state_dict(self) -> dict:
        return {"adamw": self.optimizer.state_dict(), "loss_scaler": self.scaler.state_dict() if self.scaler else None}

    def load_state_dict(self, state: dict) -> None:
        saved = state["adamw"]["state"]
        wrong = [i for i, master in enumerate(self.masters)
                 if i in saved and "exp_avg" in saved[i] and saved[i]["exp_avg"].shape != master.shape]
        if len(saved) > len(self.masters) or wrong:
            raise ConfigError("the checkpoint's optimizer state belongs to parameters of other shapes (another model, "
                              "or another tensor/data-parallel layout): resume with the settings the run was trained "
                              "with, or start a new run from the checkpoint's policy/")
        self.optimizer.load_state_dict(state["adamw"])
        if self.scaler and state.get("loss_scaler"):
            self.scaler.load_state_dict(state["loss_scaler"])


def step_groups(sizes: list[int], limit: int) -> list[list[int]]:
    """Consecutive indices of tensors of these byte sizes, in groups of at most `limit` bytes (a larger tensor alone)."""
    groups: list[list[int]] = []
    total = 0
    for i, size in enumerate(sizes):
        if not groups or total + size > limit:
            groups.append([])
            total = 0
        groups[-1].append(i)
        total += size
    return groups


def step_metrics(results: list[StepResult]) -> dict[str, float]:
    """What a metrics row says about a step's optimizer steps (one per `num_iterations` pass)."""
    row = {"train/skipped": float(sum(not r.applied for r in results)),
           "train/nonfinite": float(sum(r.nonfinite for r in results))}
    if results and results[-1].loss_scale is not None:
        row["train/loss_scale"] = results[-1].loss_scale
    return row


class NonFiniteGuard:
    """Counts steps with a non-finite loss or gradient; `limit` in a row stop the run with an error."""

    def __init__(self, limit: int):
        self.limit, self.in_a_row, self.total = limit, 0, 0

    def __call__(self, nonfinite: bool, step: int) -> None:
        if not nonfinite:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        self.total += 1
        if self.in_a_row >= self.limit:
            raise TrainingDiverged(
                f"{self.in_a_row} steps in a row (the last: step {step}) had a non-finite loss or gradient; each was "
                f"skipped, and the run stops here (trainer.max_nonfinite_steps={self.limit}). Checkpoints written "
                "before stay intact and loadable. Lower trainer.lr, compute in bfloat16 or float32 instead of "
                "float16 (policy.dtype), keep policy.master_dtype=float32, or raise trainer.max_nonfinite_steps.")
