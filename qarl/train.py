"""QA-GRPO, top to bottom: GRPO's setup and update on the step skeleton of qarl/run.py.

    recipe -> checks -> policy (warm start, quantize, calibrate | resume from a checkpoint)
    -> the KL reference (the step-0 policy, frozen; none when beta = 0)
    -> vLLM engine (refit: weights + amax) -> for each step:
         rollout (G completions per prompt) -> rewards (+ the overlong punishment) -> group-relative advantages
         -> policy update on the fake-quantized policy (straight-through to the master weights)
         -> refit -> metrics row -> checkpoint
    -> final evaluation, plot, summary.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from qarl.config import RecipeConfig, check_grpo_recipe
from qarl.evaluate import evaluate_splits, split_metrics
from qarl.graphs import CapturedCalls, static_shape
from qarl.grpo import LossTerms, group_advantages, grpo_loss, overlong_punishment, sequence_weights, zero_std_share
from qarl.learning_signal import Alarm, NoSignalWatch, Settings
from qarl.memory import FrozenModel, ModelShape
from qarl.quant import resolve_format
from qarl.metrics import PLOTTED, read_metrics
from qarl.optim import PolicyOptimizer, step_metrics
from qarl.policy import Policy
from qarl.run import Rollout, Run, initial_policy, mismatch_sums, run_steps, start_engine, start_run
from qarl.scoring import (MicroBatch, TeacherForced, TokenScores, completion_mask, host_rows, micro_batches, on_grid,
                          score_completions, scored_states, states_of)
from qarl.tasks import Task, eval_splits
from qarl.transfer import on_host, to_device


def train(cfg: RecipeConfig) -> Path:
    check_grpo_recipe(cfg)
    run = start_run(cfg, frozen=kl_reference, frozen_model=reference_memory)
    engine = start_engine(run)
    return run_steps(run, engine, GRPOSteps(run, engine))


def kl_reference(cfg: RecipeConfig, policy: Policy, task: Task) -> torch.nn.Module | None:
    """The frozen model of the KL term: the step-0 policy, rebuilt (deterministic; a LoRA policy's own base with its
    adapters off); None when beta = 0."""
    if cfg.trainer.beta <= 0:
        return None
    return policy.kl_reference(lambda: initial_policy(cfg, task, trainable=False).model)


def reference_memory(cfg: RecipeConfig, shape: ModelShape) -> FrozenModel | None:
    """The KL reference in the memory plan: a second model of the policy's shape, its quantized weights packed (a
    LoRA policy's is its own base)."""
    if cfg.trainer.beta <= 0 or cfg.policy.lora.mode != "none":
        return None
    return FrozenModel("reference", shape, cfg.policy.dtype, resolve_format(cfg.policy.quant_cfg))


class GRPOSteps:
    """GRPO's part of a step: held-out accuracy (every split of the task), group-relative advantages, the policy
    update."""

    panels, summary = PLOTTED, None

    def __init__(self, run: Run, engine):
        self.run, self.engine = run, engine
        self.label = "QA-GRPO" if run.policy.format else "GRPO"
        self.eval_splits = eval_splits(run.task, run.cfg.eval.num_prompts, run.cfg.eval.num_transfer_prompts)
        self.advantages = torch.empty(0)
        self.no_signal: NoSignalWatch | None = None

    def evaluate(self) -> dict[str, float]:
        return split_metrics(evaluate_splits(self.engine, self.run.prompts, self.eval_splits, self.run.rewards))

    def judge(self, step: int, batch: Rollout) -> dict[str, float]:
        t = self.run.cfg.trainer
        values, parts = self.run.rewards(batch.texts, batch.answers)
        rewards = torch.tensor(values, dtype=torch.float32)
        if t.soft_overlong_tokens:  # a reward term of token counts, which the reward functions (text in) cannot see
            penalty = overlong_punishment(torch.tensor([len(c.token_ids) for c in batch.completions]),
                                          torch.tensor([c.truncated for c in batch.completions]),
                                          self.run.cfg.policy.generation.max_new_tokens, step, t)
            # the task's own signal, which the penalty's spread of lengths hides from reward/frac_zero_std
            parts["reward/frac_zero_std_task"] = zero_std_share(rewards, t.num_generations)
            rewards += penalty
            parts["reward/soft_overlong"] = penalty.mean().item()
        self.advantages, frac_zero_std = group_advantages(rewards, t.num_generations, t.scale_rewards)
        return {"reward/mean": rewards.mean().item(), "reward/std": rewards.std().item(),
                "reward/frac_zero_std": frac_zero_std, **parts}

    def update(self, step: int, batch: Rollout) -> dict[str, float]:
        return policy_update(self.run.policy, self.run.frozen, self.run.optimizer, batch, self.advantages, self.run.cfg)

    def watch(self, step: int, row: dict[str, float]) -> Alarm | None:
        if step == self.run.start_step:  # metrics.jsonl now holds the rows before this step, and only those
            self.no_signal = no_signal_watch(self.run)
        return self.no_signal(step, row) if self.no_signal else None


def no_signal_watch(run: Run) -> NoSignalWatch | None:
    """The watch on the run's learning signal (qarl/learning_signal.py); a resumed run brings the rows it wrote
    before. None: trainer.no_signal_watch=off."""
    cfg, t = run.cfg, run.cfg.trainer
    if t.no_signal_watch == "off":
        return None
    settings = Settings(quantized=run.policy.format is not None, num_generations=t.num_generations,
                        temperature=cfg.policy.generation.temperature, lr=t.lr, stop=t.no_signal_watch == "stop",
                        overlong_start_step=t.soft_overlong_start_step if t.soft_overlong_tokens else None)
    return NoSignalWatch(t.no_signal_window, settings,
                         read_metrics(run.dir / "metrics.jsonl") if run.start_step else ())


def policy_update(policy: Policy, reference: torch.nn.Module | None, optimizer: PolicyOptimizer,
                  batch: Rollout, advantages: torch.Tensor, cfg: RecipeConfig) -> dict[str, float]:
    """`num_iterations` passes of the GRPO loss over the step's completions, in micro-batches (each one's scoring,
    loss and backward replayed as a CUDA graph with `trainer.cuda_graphs=on`: `GraphedMicroBatches`).
    A pass whose loss or gradient is not finite is skipped (`train/skipped`)."""
    t = cfg.trainer
    comps = batch.completions
    trained = [i for i, c in enumerate(comps) if c.token_ids and not (t.mask_truncated_completions and c.truncated)]
    if not trained:
        return {}
    longest = max(len(c.token_ids) for c in comps)
    total_tokens = sum(len(comps[i].token_ids) for i in trained)
    every = micro_batches(comps, trained, t.micro_batch_size, t.token_budget)
    mine = policy.local_share(every)  # this process's micro-batches (data parallel); each weighted for the whole step
    graphed = GraphedMicroBatches(policy, optimizer, cfg, mine) if t.cuda_graphs == "on" else None
    grid = graphed.grid if graphed else None  # graphed: the [sequences, completion] grid every micro-batch is laid on

    def score(model: torch.nn.Module, mb: MicroBatch) -> TokenScores:
        if graphed:  # laid out as the graphs lay it out: the same rows and row counts, the same bits
            return graphed.score(model, mb)
        return score_completions(model, mb.prompts, mb.tokens, policy.tokenizer.pad_token_id,
                                 cfg.policy.generation.temperature, cfg.policy.logprob_chunk_tokens,
                                 pack=t.token_budget > 0)

    # the rollout-time log-probs: the engine's, the reference's, and (later passes compare with it) the policy's own
    engine_lp = [mb.engine_logprobs(policy.device, grid) for mb in mine]
    weights = [sequence_weights(completion_mask(mb.tokens, grid), t.loss_type, len(trained), longest, total_tokens,
                                len(every), sum(len(tokens) for tokens in mb.tokens)) for mb in mine]
    moved = to_device([on_grid(advantages[mb.rows], grid) for mb in mine] + weights, policy.device)
    advantage, weights = moved[: len(mine)], moved[len(mine):]
    with torch.no_grad():
        ref_lp = [score(reference, mb).logprobs if reference is not None else None for mb in mine]
        old: list[TokenScores | None] = [score(policy.model, mb) if t.num_iterations > 1 else None for mb in mine]

    def eager(k: int, mb: MicroBatch) -> tuple[TokenScores, LossTerms]:
        scores = score(policy.model, mb)
        old_k = old[k] or TokenScores(scores.logprobs.detach(), scores.entropy.detach(), scores.mask)
        terms = grpo_loss(scores.logprobs, old_k.logprobs, engine_lp[k], ref_lp[k], advantage[k], old_k.mask,
                          weights[k], t)
        optimizer.backward(terms.loss)
        return old_k, terms

    def graph(k: int, mb: MicroBatch) -> tuple[TokenScores, LossTerms]:
        return graphed(k, mb, engine_lp[k], advantage[k], weights[k], ref_lp[k], old[k])

    stats: dict[str, list[float]] = {"grad_norm": []}
    results = []
    losses: list[list[torch.Tensor | None]] = []  # per micro-batch, read to the host once at the end
    update = graph if graphed else eager
    policy.model.train()
    try:
        for _ in range(t.num_iterations):
            optimizer.zero_grad()
            for k, mb in enumerate(mine):
                scored, terms = update(k, mb)
                if old[k] is None:  # one pass: the policy has not moved since rollout, old = current
                    old[k] = scored
                losses.append([terms.loss.detach(), terms.clip_fraction, terms.kl, terms.is_weight_mean])
            results.append(optimizer.step())
            stats["grad_norm"].append(results[-1].grad_norm)
    finally:
        if graphed:
            graphed.release()
    policy.model.eval()
    captures = {"train/cuda_graph_captures": float(graphed.calls.captures)} if graphed else {}
    # rollout/train mismatch on the sampled tokens: engine log-probs vs the policy's at rollout time
    mismatch: list[list[torch.Tensor | None]] = []
    for k in range(len(mine)):
        mismatch.append([*mismatch_sums(old[k].logprobs, engine_lp[k], old[k].mask), old[k].entropy.sum(),
                         old[k].mask.sum()])
    stats.update(on_host(("loss", "clip", "kl", "is_weight"), losses))
    stats.update(on_host(("max_diff", "k3", "entropy", "tokens"), mismatch))
    every_value = {k: policy.all_values(v) for k, v in stats.items() if k != "grad_norm"}  # every process's
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    tokens = sum(every_value["tokens"])
    return {"loss": sum(every_value["loss"]) / t.num_iterations, "clip_fraction": mean(every_value["clip"]),
            "kl/ref": mean(every_value["kl"]), "is_weight_mean": mean(every_value["is_weight"]),
            "grad_norm": mean(stats["grad_norm"]), "entropy": sum(every_value["entropy"]) / tokens,
            "mismatch/kl": sum(every_value["k3"]) / tokens, "mismatch/max_abs_logprob_diff": max(every_value["max_diff"]),
            "train/policy_tokens": float(t.num_iterations * sum(len(comps[i].prompt_ids) + len(comps[i].token_ids)
                                                                for i in trained)),
            **step_metrics(results), **captures}


class GraphedMicroBatches:
    """Each micro-batch's scoring, GRPO loss and backward as one CUDA graph (`trainer.cuda_graphs=on`,
    qarl/graphs.py): every micro-batch of the step packed into one `StaticShape`, its per-token tensors on that
    shape's [sequences, completion] grid, the gradients kept in place for the update (released with the graphs).
    A model that lays out its rows itself (the exact forward: `qarl_static_layout`) gets them right-padded to the
    shape's width, with its layout in the graph's buffers too."""

    def __init__(self, policy: Policy, optimizer: PolicyOptimizer, cfg: RecipeConfig, mine: list[MicroBatch]):
        self.policy, self.optimizer, self.cfg = policy, optimizer, cfg
        self.shape = static_shape(mine, cfg.trainer.token_budget, cfg.policy.generation.max_new_tokens)
        self.grid = (self.shape.sequences, self.shape.completion)
        self.static_layout = getattr(policy.model, "qarl_static_layout", None)
        self.layout_sizes: tuple | None = None
        self.calls = CapturedCalls(self.micro_batch, policy.device)
        optimizer.keep_gradients(True)

    def __call__(self, k: int, mb: MicroBatch, engine: torch.Tensor, advantage: torch.Tensor, weights: torch.Tensor,
                 ref: torch.Tensor | None, old: TokenScores | None) -> tuple[TokenScores, LossTerms]:
        inputs = [*self.int_inputs(mb), engine, advantage, weights, ref, None if old is None else old.logprobs]
        scored, terms = self.calls((self.shape, ref is None, old is None), inputs)
        self.optimizer.note_loss(terms.loss)
        # the next replay overwrites the graph's outputs: keep copies
        copied = TokenScores(scored.logprobs.clone(), scored.entropy.clone(), scored.mask.clone())
        values = (getattr(terms, field.name) for field in dataclasses.fields(terms))
        return copied, LossTerms(*(None if x is None else x.detach().clone() for x in values))

    def int_inputs(self, mb: MicroBatch) -> list[torch.Tensor]:
        """`mb`'s rows packed into the step's shape (and the model's own layout of them), on the device in one copy."""
        rows = host_rows(mb.prompts, mb.tokens, self.policy.tokenizer.pad_token_id, pack=self.static_layout is None,
                         shape=self.shape)
        layout: list[torch.Tensor] = []
        if self.static_layout is not None:
            layout, self.layout_sizes = self.static_layout(rows.lengths, rows.longest, self.shape.tokens)
        return to_device([*rows.parts, *layout], self.policy.device)

    def score(self, model: torch.nn.Module, mb: MicroBatch) -> TokenScores:
        """`model`'s scores of `mb` packed into the step's shape, eagerly (the reference's, and the rollout-time
        policy's that later passes compare with)."""
        return self.scores_of(model, self.int_inputs(mb))

    def scores_of(self, model: torch.nn.Module, parts: list[torch.Tensor]) -> TokenScores:
        """Scores of the rows in `int_inputs`' tensors."""
        pack, p = self.static_layout is None, self.cfg.policy
        count = (3 if pack else 2) + 6  # `TeacherForced.from_parts`' tensors; the model's layout after them
        rows = TeacherForced.from_parts(parts[:count], self.shape.longest, pack)
        steps = None if pack else model.qarl_layout_steps(parts[count:], self.layout_sizes)
        return scored_states(model, states_of(model, rows, steps), p.generation.temperature, p.logprob_chunk_tokens)

    def micro_batch(self, *inputs: torch.Tensor | None) -> tuple[TokenScores, LossTerms]:
        """What is captured: the scores of a `StaticShape`'s rows, the GRPO loss on its grid, the backward."""
        parts, (engine, advantage, weights, ref, old) = list(inputs[:-5]), inputs[-5:]
        scores = self.scores_of(self.policy.model, parts)
        current = scores.logprobs.detach()
        terms = grpo_loss(scores.logprobs, current if old is None else old, engine, ref, advantage, scores.mask,
                          weights, self.cfg.trainer)
        terms.loss.backward()
        return TokenScores(current, scores.entropy, scores.mask), terms

    def release(self) -> None:
        self.calls.release()
        self.optimizer.keep_gradients(False)
