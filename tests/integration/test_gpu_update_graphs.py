"""`trainer.cuda_graphs=on` on a GPU: the update's micro-batches captured once and replayed. A replay computes what
the eager call it was captured from computed, bit for bit (the same kernels on the same shapes; sequences of at most
one FlashAttention key block, whose backward then adds no atomics); a graphed update steps the policy as the eager one
does within the packed path's rounding, and a second graphed update from the same start repeats the first bit for
bit. Skipped without a GPU (CPU: tests/unit/test_graphs.py)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from tests.conftest import tiny_policy

gpu = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu, reason="needs a CUDA GPU")]

MODEL = "embedded:20m"


def _setup(task, quant_cfg: str):
    from qarl.models.resolve import resolve_model_dir
    from qarl.optim import PolicyOptimizer

    policy = tiny_policy(task, resolve_model_dir(MODEL), quant_cfg, trainable=True, model_name=MODEL,
                         dtype="bfloat16")
    cfg, batch, advantages = _step()
    return policy, PolicyOptimizer(policy, lr=1e-4, weight_decay=0.0, max_grad_norm=1.0), cfg, batch, advantages


def _step():
    """A recipe of micro-batches of 256 tokens and one step's completions (ids below the test models' 128)."""
    from qarl.config import RecipeConfig, TrainerConfig
    from qarl.generation import Completion
    from qarl.run import Rollout

    cfg = RecipeConfig()
    cfg.policy.dtype, cfg.policy.master_dtype, cfg.policy.logprob_chunk_tokens = "bfloat16", "float32", 64
    cfg.policy.generation.max_new_tokens = 96
    cfg.trainer = TrainerConfig(max_tokens_per_micro_batch=256, batch_size=12, num_generations=4)
    g = torch.Generator().manual_seed(0)
    lengths = [(12, 40), (30, 7), (5, 64), (20, 33), (9, 96), (17, 3), (25, 50), (8, 80), (14, 21), (6, 9),
               (11, 70), (19, 12)]
    comps = [Completion(torch.randint(3, 120, (p,), generator=g).tolist(),
                        torch.randint(3, 120, (c,), generator=g).tolist(), (-torch.rand(c, generator=g)).tolist(),
                        "stop") for p, c in lengths]
    return cfg, Rollout([], comps, [""] * len(comps), 0.0), torch.randn(len(comps), generator=g)


def _update(policy, optimizer, cfg, batch, advantages, graphs: str):
    from qarl.train import policy_update

    cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, cuda_graphs=graphs))
    row = policy_update(policy, None, optimizer, batch, advantages, cfg)
    return row, [m.detach().clone() for m in optimizer.masters]


@pytest.mark.parametrize("quant_cfg", ["none", "quant_configs/nvfp4_a16.yaml", "quant_configs/nvfp4_w4a4.yaml"])
def test_a_graphed_update_steps_as_the_eager_one(task, quant_cfg):
    results = {}
    for graphs in ("off", "on", "on"):
        policy, optimizer, cfg, batch, advantages = _setup(task, quant_cfg)
        results.setdefault(graphs, []).append(_update(policy, optimizer, cfg, batch, advantages, graphs))
        assert all(p.grad is None for p in optimizer.params)  # the kept gradients go with the graphs
    (eager_row, eager), = results["off"]
    (row, masters), (again_row, again) = results["on"]
    assert row["train/cuda_graph_captures"] == 1 and "train/cuda_graph_captures" not in eager_row
    same = lambda a, b: a == b or (math.isnan(a) and math.isnan(b))  # noqa: E731 (kl/ref is NaN without beta)
    assert row.keys() == again_row.keys() and all(same(row[k], again_row[k]) for k in row), (row, again_row)
    assert all(torch.equal(a, b) for a, b in zip(masters, again))  # replays repeat
    for key in ("loss", "entropy", "mismatch/kl", "grad_norm"):
        assert row[key] == pytest.approx(eager_row[key], rel=2e-2, abs=1e-4), key
    for a, b in zip(masters, eager):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-4)  # lr 1e-4: one step moves a weight by about that


def test_a_replay_computes_the_captured_call_bit_for_bit(task):
    """The same micro-batch twice: the first call runs eagerly (and is captured), the second replays; their
    log-probs, entropies and loss are equal, and the gradient doubles exactly."""
    from qarl.scoring import completion_mask, micro_batches, on_grid
    from qarl.train import GraphedMicroBatches

    policy, optimizer, cfg, batch, advantages = _setup(task, "quant_configs/nvfp4_w4a4.yaml")
    cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, cuda_graphs="on"))
    mb = micro_batches(batch.completions, [0, 1, 2], 8, cfg.trainer.token_budget)[0]
    graphed = GraphedMicroBatches(policy, optimizer, cfg, [mb, mb])
    grid = graphed.grid
    engine = mb.engine_logprobs(policy.device, grid)
    advantage = on_grid(advantages[mb.rows], grid).to(policy.device)
    weights = (completion_mask(mb.tokens, grid).sum(1).clamp(min=1) ** -1).to(policy.device)
    policy.model.train()
    optimizer.zero_grad()
    first = graphed(0, mb, engine, advantage, weights, None, None)
    once = [p.grad.clone() for p in optimizer.params]
    second = graphed(1, mb, engine, advantage, weights, None, None)
    assert graphed.calls.captures == 1
    assert torch.equal(first[0].logprobs, second[0].logprobs) and torch.equal(first[0].entropy, second[0].entropy)
    assert torch.equal(first[1].loss, second[1].loss)
    assert all(torch.equal(p.grad, 2 * g) for p, g in zip(optimizer.params, once))
    graphed.release()


@pytest.mark.skipif(not (gpu and torch.cuda.get_device_capability()[0] == 9), reason="the exact forward: Hopper")
@pytest.mark.parametrize("quant_cfg", ["quant_configs/nvfp4_w4a4.yaml", "quant_configs/fp8_w8a8.yaml"])
def test_the_exact_forward_replayed_gives_its_eager_log_probs_bit_for_bit(task, quant_cfg):
    """The exact forward's rows are batch-invariant (a row's bits do not depend on the rows beside it), so its
    micro-batches packed into the static shape, run eagerly and replayed, give each real token the log-prob its own
    eager scoring gives (the engine's, which test_gpu_exact.py pins), bit for bit."""
    from qarl.models.resolve import resolve_model_dir
    from qarl.optim import PolicyOptimizer
    from qarl.scoring import completion_mask, micro_batches, on_grid, score_completions
    from qarl.train import GraphedMicroBatches

    cfg, batch, advantages = _step()
    model = "embedded:realistic-qwen3"  # head size 128: every token a prefill, as the static layout lays them out
    policy = tiny_policy(task, resolve_model_dir(model), quant_cfg, trainable=True, model_name=model,
                         dtype="bfloat16", exact_forward=True)
    assert not policy.model._qarl_decode_steps
    optimizer = PolicyOptimizer(policy, lr=1e-4, weight_decay=0.0, max_grad_norm=1.0)
    cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, cuda_graphs="on"))
    mine = micro_batches(batch.completions, list(range(len(batch.completions))), 8, cfg.trainer.token_budget)
    graphed = GraphedMicroBatches(policy, optimizer, cfg, mine)
    pad, grid = policy.tokenizer.pad_token_id, graphed.grid
    policy.model.train()
    optimizer.zero_grad()
    for k, mb in enumerate(mine):
        engine = mb.engine_logprobs(policy.device, grid)
        advantage = on_grid(advantages[mb.rows], grid).to(policy.device)
        weights = completion_mask(mb.tokens, grid).to(policy.device).sum(1).clamp(min=1) ** -1
        scored, _ = graphed(k, mb, engine, advantage, weights, None, None)
        with torch.no_grad():
            eager = score_completions(policy.model, mb.prompts, mb.tokens, pad).logprobs
        rows, width = eager.shape
        assert torch.equal(scored.logprobs[:rows, :width], eager), k
    assert graphed.calls.captures == 1 and len(mine) > 1
    graphed.release()
