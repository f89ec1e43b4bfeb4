"""`trainer.cuda_graphs` on the CPU: what a CUDA graph of a micro-batch replays, run eagerly. Packed into the step's
static shape (padding sequences, empty slots, the [sequences, completion] grid), a micro-batch gives the packed
path's log-probs, loss and gradients within fp32 rounding; kept gradients step as freed ones do, bit for bit; the
setting is refused where it cannot run, by name (its memory pool in the plan: tests/unit/test_memory.py). The capture
and replay themselves: tests/integration/test_gpu_update_graphs.py."""

from __future__ import annotations

import pytest
import torch

from qarl.config import ConfigError, RecipeConfig, TrainerConfig
from qarl.generation import Completion
from qarl.graphs import (check_graph_budget, check_graph_model, check_graph_settings, graph_refusals, model_refusal,
                         static_shape)
from qarl.grpo import grpo_loss, sequence_weights
from qarl.optim import PolicyOptimizer
from qarl.scoring import StaticShape, completion_mask, host_rows, micro_batches, on_grid, score_completions
from qarl.train import GraphedMicroBatches
from tests.conftest import tiny_policy


def _completions(policy, task, rows: int = 7) -> list[Completion]:
    tok = policy.tokenizer
    out = []
    for i, p in enumerate(task.train[:rows]):
        tokens = tok(p.answer).input_ids * (1 + i % 3)
        out.append(Completion(tok(p.prompt).input_ids, tokens, [-0.5 - 0.01 * j for j in range(len(tokens))], "stop"))
    return out


def test_static_shape_holds_every_micro_batch_of_the_step():
    comps = [Completion([1] * p, [2] * c, [0.0] * c, "stop") for p, c in ((5, 9), (3, 20), (8, 4), (2, 30), (6, 6))]
    mbs = micro_batches(comps, list(range(len(comps))), size=8, max_tokens=40)
    shape = static_shape(mbs, 40, 32)
    assert [mb.rows for mb in mbs] == [[0, 1], [2], [3], [4]]
    assert shape.tokens == 40 and shape.completion == 32 and shape.longest == 32  # the step's longest sequence
    assert shape.picks == 30  # the most completion tokens a micro-batch scores
    assert shape.sequences == 3  # micro-batch 0: 2 sequences of 37 tokens, and one padding sequence of 3
    for mb in mbs:  # every one packs into it, padding sequences of at most `longest` tokens filling the slack
        rows = host_rows(mb.prompts, mb.tokens, 0, pack=True, shape=shape)
        ids, positions, starts = rows.parts[:3]
        assert ids.shape == (1, 40) and positions.shape == (1, 40) and starts.shape == (shape.sequences + 1,)
        assert int(starts[-1]) == 40 and bool((starts.diff() <= shape.longest).all())
        picks, slots, picked = rows.parts[-3:]
        assert picks.shape == slots.shape == picked.shape == (30,)
        real = sum(len(t) for t in mb.tokens)
        assert bool((slots[real:] == shape.sequences * shape.completion).all())  # spare picks: the slot past the grid
        assert picks[real:].tolist() == list(range(30 - real))  # distinct states: no pile-up in the backward
    for small in (StaticShape(8, 2, 8, 32, 8), StaticShape(40, 8, 40, 32, 2)):
        with pytest.raises(ValueError, match="does not fit"):
            host_rows(mbs[0].prompts, mbs[0].tokens, 0, pack=True, shape=small)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_a_static_micro_batch_gives_the_packed_loss_and_gradients(task, tiny_dir, loss_type, level):
    """`GraphedMicroBatches.micro_batch`, what the graph replays, run eagerly on the CPU against the packed eager
    path: log-probs on the real tokens, 0 elsewhere on the grid, the loss and every gradient within fp32 rounding."""
    policy = tiny_policy(task, tiny_dir, "quant_configs/nvfp4_w4a4.yaml", calib_size=16, trainable=True,
                         dtype="bfloat16")
    cfg = RecipeConfig()
    cfg.policy.logprob_chunk_tokens, cfg.policy.generation.max_new_tokens = 6, 32
    cfg.trainer = TrainerConfig(loss_type=loss_type, importance_sampling_level=level, max_tokens_per_micro_batch=96)
    comps = _completions(policy, task)
    mine = micro_batches(comps, list(range(len(comps))), 8, cfg.trainer.token_budget)
    assert len(mine) > 1
    optimizer = PolicyOptimizer(policy, 1e-3, 0.0, 1.0)
    graphed = GraphedMicroBatches(policy, optimizer, cfg, mine)
    pad, total = policy.tokenizer.pad_token_id, sum(len(c.token_ids) for c in comps)
    advantages = torch.linspace(-1.0, 1.0, len(comps))
    losses, grads, scores = {}, {}, {}
    for static in (False, True):
        optimizer.zero_grad()
        losses[static], scores[static] = [], []
        for mb in mine:
            grid = graphed.grid if static else None
            engine = mb.engine_logprobs(policy.device, grid)
            weights = sequence_weights(completion_mask(mb.tokens, grid), loss_type, len(comps), 32, total, len(mine),
                                       sum(len(t) for t in mb.tokens))
            advantage = on_grid(advantages[mb.rows], grid)
            if static:
                scored, terms = graphed.micro_batch(*graphed.int_inputs(mb), engine, advantage, weights, None, None)
            else:
                scored = score_completions(policy.model, mb.prompts, mb.tokens, pad, 1.0, 6, pack=True)
                terms = grpo_loss(scored.logprobs, scored.logprobs.detach(), engine, None, advantage, scored.mask,
                                  weights, cfg.trainer)
                terms.loss.backward()
            losses[static].append(terms.loss.detach())
            scores[static].append(scored.logprobs.detach())
        grads[static] = {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None}
    for eager, static, mb in zip(scores[False], scores[True], mine):
        rows, width = eager.shape
        torch.testing.assert_close(static[:rows, :width], eager, rtol=0, atol=5e-6)
        assert not static[rows:].any() and not static[:, width:].any()
    torch.testing.assert_close(torch.stack(losses[True]), torch.stack(losses[False]), rtol=1e-5, atol=1e-7)
    assert grads[True].keys() == grads[False].keys() and grads[True]
    for name, grad in grads[False].items():
        torch.testing.assert_close(grads[True][name], grad, rtol=1e-4, atol=1e-6, msg=name)
    graphed.release()
    assert all(p.grad is None for p in optimizer.params)


def test_kept_gradients_step_as_freed_ones(task, tiny_dir):
    """Two passes with gradients kept in place (zeroed, never replaced) step the masters to the same bits as with
    gradients freed after each step."""
    results = {}
    for keep in (False, True):
        policy = tiny_policy(task, tiny_dir, "quant_configs/nvfp4_a16.yaml", calib_size=16, trainable=True,
                             dtype="bfloat16")
        optimizer = PolicyOptimizer(policy, 1e-3, 0.0, 1.0)
        optimizer.keep_gradients(keep)
        kept = [p.grad for p in optimizer.params]
        comps = _completions(policy, task)
        for _ in range(2):
            optimizer.zero_grad()
            scored = score_completions(policy.model, [c.prompt_ids for c in comps], [c.token_ids for c in comps],
                                       policy.tokenizer.pad_token_id)
            optimizer.backward(-scored.logprobs.sum())
            assert optimizer.step().applied
        if keep:
            assert all(p.grad is k and not p.grad.any() for p, k in zip(optimizer.params, kept))
        results[keep] = [m.detach().clone() for m in optimizer.masters]
    assert all(torch.equal(a, b) for a, b in zip(results[False], results[True]))


def test_cuda_graphs_are_refused_where_they_cannot_run(tiny_dir):
    def recipe(**changes) -> RecipeConfig:
        cfg = RecipeConfig()
        cfg.policy.dtype, cfg.policy.master_dtype = "bfloat16", "float32"
        cfg.trainer.cuda_graphs, cfg.trainer.max_tokens_per_micro_batch = "on", 8192
        for key, value in changes.items():
            section, name = key.split("__")
            setattr(getattr(cfg, section), name, value)
        return cfg

    assert graph_refusals(recipe(), "cuda") == graph_refusals(recipe(trainer__max_tokens_per_micro_batch="auto"),
                                                              "cuda") == []
    cases = {"cpu": (recipe(), "has none"),
             "rows": (recipe(trainer__max_tokens_per_micro_batch=0), "trainer.max_tokens_per_micro_batch"),
             "fp16": (recipe(policy__dtype="float16"), "policy.dtype=float16"),
             "masters": (recipe(policy__master_dtype="bfloat16"), "policy.master_dtype=float32"),
             "checkpointing": (recipe(policy__gradient_checkpointing="on"), "policy.gradient_checkpointing=off"),
             "chunks": (recipe(policy__logprob_chunk_tokens=0), "policy.logprob_chunk_tokens")}
    for name, (cfg, needle) in cases.items():
        device = "cpu" if name == "cpu" else "cuda"
        with pytest.raises(ConfigError, match="trainer.cuda_graphs=on") as refused:
            check_graph_settings(cfg, device)
        assert needle in str(refused.value), name
    assert "QAD" in graph_refusals(recipe(), "cuda", distilling=True)[0][1]
    check_graph_settings(recipe(trainer__cuda_graphs="off"), "cpu")  # off: nothing to refuse
    check_graph_model(recipe(trainer__cuda_graphs="off"), tiny_dir)
    check_graph_model(recipe(), tiny_dir)  # the tiny model's forward can be captured
    # a budget left to auto and decided 0 (by rows) is refused once decided, with why it was
    with pytest.raises(ConfigError, match=r"is 0 here \(auto: the CPU\)"):
        check_graph_budget(recipe(trainer__max_tokens_per_micro_batch=0), "auto: the CPU")


def test_models_whose_forward_asks_the_gpu_mid_way_are_refused(tmp_path):
    """Experts chosen per token, a rotary table that grows with the longest position, logits changed after the head:
    each named before anything loads."""
    from transformers import Gemma2Config, LlamaConfig, Qwen3MoeConfig

    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)
    configs = {"Mixture-of-Experts": Qwen3MoeConfig(**common, num_experts=4, num_experts_per_tok=2,
                                                    moe_intermediate_size=32),
               "dynamic rotary": LlamaConfig(**common, rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                       "rope_theta": 10000.0}),
               "scored whole": Gemma2Config(**common, head_dim=16, final_logit_softcapping=30.0),
               "": LlamaConfig(**common)}
    for needle, config in configs.items():
        model_dir = tmp_path / (needle or "plain").replace(" ", "_")
        config.save_pretrained(model_dir)
        why = model_refusal(str(model_dir))
        assert (needle in why[1] and "trainer.cuda_graphs=off" in why[1]) if needle else why is None, (needle, why)


def test_the_exact_forwards_static_layout_is_its_layout_padded():
    """The exact forward's layout of a micro-batch packed into a static shape (padding sequences, empty slots, the
    paged cache's blocks and table width held fixed): the real sequences' token places, cache slots, block-table rows
    and prefill boundaries are the ones its own layout of the micro-batch gives; every split of the budget fits its
    blocks; and a static layout never decodes."""
    from qarl.backends.exact_forward import ExactLayout
    from qarl.generation.exact import BLOCK_SIZE, PagedLayout

    comps = [Completion([1] * p, [2] * c, [0.0] * c, "stop") for p, c in ((5, 40), (3, 20), (18, 4), (2, 30))]
    mb = micro_batches(comps, list(range(len(comps))), size=8, max_tokens=200)[0]
    shape = StaticShape(tokens=200, sequences=8, longest=48, completion=64, picks=120)  # (another micro-batch's)
    rows = host_rows(mb.prompts, mb.tokens, 0, pack=False, shape=shape)
    assert rows.parts[0].shape == (shape.sequences, shape.longest) and sum(rows.lengths) == 200
    real = [len(p) + len(c) for p, c in zip(mb.prompts, mb.tokens)]
    assert rows.lengths[: len(real)] == real and rows.lengths[-1] == 0  # padding sequences, then empty slots
    blocks = -(-shape.tokens // BLOCK_SIZE) + shape.sequences
    static, sizes = ExactLayout.host(rows.lengths, rows.lengths, shape.longest, static=(blocks, shape.longest))
    own, own_sizes = ExactLayout.host(real, real, shape.longest)
    assert sizes == (blocks, shape.longest, shape.longest) and own_sizes[0] <= blocks
    tokens = sum(real)
    for name, a, b in zip(("index", "positions", "slots"), static[:3], own[:3]):
        assert torch.equal(a[:tokens], b), name
    table, own_table = static[3], own[3]
    assert table.shape == (shape.sequences, -(-shape.longest // BLOCK_SIZE))
    for i, n in enumerate(real):  # each sequence's own blocks (the entries past them are never read)
        used = -(-n // BLOCK_SIZE)
        assert torch.equal(table[i, :used], own_table[i, :used]), i
    assert torch.equal(static[4][: len(real) + 1], own[4]) and torch.equal(static[5][: len(real)], own[5])
    assert bool((static[4][len(real):].diff() >= 0).all()) and int(static[4][-1]) == 200
    g = torch.Generator().manual_seed(0)
    for _ in range(200):  # any split of the budget into sequences of at most `longest` tokens fits the blocks
        cuts = sorted(torch.randint(0, 201, (shape.sequences - 1,), generator=g).tolist())
        lengths = [b - a for a, b in zip([0, *cuts], [*cuts, 200])]
        assert sum(-(-n // BLOCK_SIZE) for n in lengths) <= blocks
    with pytest.raises(ValueError, match="prefill"):
        PagedLayout.host([10, 20], [5, 20], static=(8, 32))


def test_the_setting_reads_on_and_off_as_recipes_spell_them():
    """YAML reads a bare on/off as a boolean: `trainer.cuda_graphs=on` is "on", as every on/off setting."""
    from qarl.config import load_recipe

    assert load_recipe("recipes/qa_grpo_tiny.yaml", [], RecipeConfig).trainer.cuda_graphs == "off"  # the default
    for spelled, read in (("on", "on"), ("off", "off"), ("true", "on"), ("auto", "auto")):
        cfg = load_recipe("recipes/qa_grpo_tiny.yaml", [f"trainer.cuda_graphs={spelled}"], RecipeConfig)
        assert cfg.trainer.cuda_graphs == read, spelled
    with pytest.raises(ConfigError, match=r"must be auto \| on \| off"):
        load_recipe("recipes/qa_grpo_tiny.yaml", ["trainer.cuda_graphs=sometimes"], RecipeConfig)


def test_out_of_memory_in_an_update_names_the_setting_to_change():
    """A run's update out of memory names what lowers its peak: with the graphs' pool planned, turning them off
    first (checkpointing is refused beside them); without, the micro-batch and checkpointing."""
    from types import SimpleNamespace

    from qarl.memory import MemoryPlan
    from qarl.run import update_or_name_the_knob

    def oom(step, batch):
        raise torch.OutOfMemoryError("CUDA out of memory")

    steps = SimpleNamespace(update=oom)
    for parts, needle, absent in (({"CUDA graph pool": 1}, "set trainer.cuda_graphs=off", "gradient_checkpointing"),
                                  ({"activations": 1}, "policy.gradient_checkpointing=on", "cuda_graphs")):
        memory = MemoryPlan({"weights": 1}, parts, 0, "x", 10, False, 256, 0)
        with pytest.raises(RuntimeError, match="out of memory in the update of step 3") as error:
            update_or_name_the_knob(steps, 3, None, memory)
        assert needle in str(error.value) and absent not in str(error.value) and "trainer.resume=true" in str(
            error.value)
