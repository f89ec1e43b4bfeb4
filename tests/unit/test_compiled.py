"""Compiled elementwise layers (`policy.compile_norms`, `policy.compile_mlp`, qarl/models/compiled.py), whole
compiled decoder layers (`policy.compile_layers`) and the head's compiled scoring (`policy.compile_scores`,
qarl/scoring.py): the policy's logits, log-probs and gradients within rounding of the eager ones, one graph for every
sequence length, through gradient checkpointing, a deep copy and a qlora base, quantized matmuls outside the graphs
(but the plain matmuls of weights that hold their quantized value, traced into them);
refused where the layers must be others (the exact forward, Megatron, QAD's KL), where the compiler would trace a
quantized layer, or where the model has no MLP, dense layers or head the fusion knows."""

from __future__ import annotations

import copy
import types

import pytest
import torch
import torch._dynamo

from qarl.backends.hf import refuse_traced_quantized_layers
from qarl.config import ConfigError, LoraConfig, PolicyConfig
from qarl.models.compiled import gated_mlps, rms_norms
from qarl.models.resolve import resolve_model_dir
from qarl.models.varlen_attention import ATTENTION, enable_varlen_attention
from qarl.scoring import FUSED_SCORES, score_completions
from qarl.torch_compat import compiled_in_place
from tests.conftest import W4A16, answer_loss, eval_logits, tiny_policy


def compiled_against_eager(task, tiny_dir, varlen: bool = False, **knobs):
    """A W4A16 tiny policy compiled with `knobs` (and checkpointing) beside an eager one, from fresh compiler counters:
    logits and gradients within fp32 rounding of eager. `varlen`: the compiled one calls the GPU's attention function
    (on CPU it runs SDPA with the mask). Returns the compiled policy."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eager = tiny_policy(task, tiny_dir, W4A16, trainable=True)
    fused = tiny_policy(task, tiny_dir, W4A16, trainable=True, gradient_checkpointing="on", **knobs)
    if varlen:  # (a GPU's policy is on it from the load, a CPU's on the block attention)
        fused.model.set_attn_implementation("sdpa")
        assert enable_varlen_attention(fused.model) and fused.model.config._attn_implementation == ATTENTION
    assert torch.allclose(eval_logits(fused, task), eval_logits(eager, task), rtol=0, atol=1e-5)
    answer_loss(eager, task).backward()
    answer_loss(fused, task).backward()
    for (name, a), b in zip(eager.model.named_parameters(), fused.model.parameters(), strict=True):
        if a.grad is not None:
            assert (a.grad - b.grad).abs().max() <= 1e-5 * a.grad.abs().max(), name  # fp32 rounding
    return fused


def test_compiled_layers_give_the_eager_numbers_within_rounding_in_one_graph(task, tiny_dir):
    knobs = {"compile_norms": True, "compile_mlp": True}
    fused = compiled_against_eager(task, tiny_dir, **knobs)
    assert len(rms_norms(fused.model)) == 2 * 2 + 1  # two a layer and the final one
    assert len(gated_mlps(fused.model)) == 2
    ids = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10, 11]], device=fused.device)  # another length: no new graph
    with torch.no_grad():
        fused.model(input_ids=ids[:, :4])  # the inference graphs, once
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with torch.no_grad():
        fused.model(input_ids=ids)
        reference = copy.deepcopy(fused.model)  # a KL reference is a copy of the policy
        for mlp in gated_mlps(reference):  # each copied MLP runs its own projections
            assert mlp.forward.__self__ is mlp
        reference(input_ids=ids)
    assert not torch._dynamo.utils.counters["graph_break"]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs

    qlora, plain = (tiny_policy(task, tiny_dir, W4A16, trainable=True, lora=LoraConfig(mode="qlora"),
                                **(knobs if compiled else {})) for compiled in (True, False))  # with a packed base
    assert torch.allclose(eval_logits(qlora, task), eval_logits(plain, task), rtol=0, atol=1e-5)


def test_compiled_decoder_layers_give_the_eager_numbers_with_the_quantized_matmuls_outside_the_graphs(task, tiny_dir):
    fused = compiled_against_eager(task, tiny_dir, varlen=True, compile_layers=True)
    assert all(compiled_in_place(layer) for layer in fused.model.model.layers)
    tok = fused.tokenizer
    rows = [(tok(p.prompt).input_ids, tok(p.answer).input_ids * (1 + i % 3)) for i, p in enumerate(task.train[:12])]

    def score_packed(first: int, count: int) -> None:
        prompts, completions = zip(*rows[first : first + count])
        score_completions(fused.model, list(prompts), list(completions), tok.pad_token_id, pack=True
                          ).logprobs.sum().backward()

    score_packed(0, 3)  # each variant's graphs once (padded rows with and without grad: above): packed rows
    with torch.no_grad():
        fused.model(input_ids=torch.arange(3, 21, device=fused.device).view(2, 9))  # the no-grad graphs, once
        for p in fused.model.parameters():  # an optimizer step: the quantized layers plan again, no graph is made
            p.add_(1e-3 * torch.randn_like(p))
    with torch._dynamo.config.patch(error_on_recompile=True):  # other lengths, rows, weights: the same graphs
        score_packed(3, 5)
        answer_loss(fused, task).backward()
        with torch.no_grad():
            fused.model(input_ids=torch.arange(3, 18, device=fused.device).view(3, 5))
    breaks = torch._dynamo.utils.counters["graph_break"]
    assert any("planned_linear" in reason for reason in breaks)  # each quantized matmul runs eagerly, as attention
    assert all("planned_linear" in reason or "varlen_attention_forward" in reason for reason in breaks)


def held_policies(task, tiny_dir):
    """Mixed-precision W4A16 tiny policies, eager and with compiled (and checkpointed) decoder layers, each quantized
    weight holding its quantized value (the masters copied in, as at each optimizer step), from fresh compiler
    counters."""
    from qarl.optim import PolicyOptimizer

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eager, fused = (tiny_policy(task, tiny_dir, W4A16, trainable=True, dtype="bfloat16", **knobs)
                    for knobs in ({}, {"compile_layers": True, "gradient_checkpointing": "on"}))
    for policy in (eager, fused):
        PolicyOptimizer(policy, lr=1e-3, weight_decay=0.0, max_grad_norm=1.0)
    return eager, fused


def held_agree(eager, fused, task) -> None:
    """The loss within 1 % and each gradient within 5 % of its largest element (bf16 rounding through fused kernels),
    with grad only: no-grad graphs would double the compile time."""
    losses = []
    for policy in (eager, fused):
        policy.model.zero_grad(set_to_none=True)
        losses.append(answer_loss(policy, task))
        losses[-1].backward()
    assert abs(losses[1].item() - losses[0].item()) <= 0.01 * abs(losses[0].item())
    for (name, a), b in zip(eager.model.named_parameters(), fused.model.parameters(), strict=True):
        if a.grad is not None:
            assert (a.grad.float() - b.grad.float()).abs().max() <= 0.05 * a.grad.float().abs().max(), name


def test_held_weights_are_traced_into_the_compiled_decoder_layers_as_plain_matmuls(task, tiny_dir):
    """A quantized layer whose weight holds its quantized value is a plain matmul, which the compiled layers trace:
    no graph break at a quantized layer, and the eager numbers within bf16 rounding. (fp32, above: no hold, each
    quantized matmul eager.)"""
    eager, fused = held_policies(task, tiny_dir)
    held_agree(eager, fused, task)
    noted = [m._qarl_plain for m in fused.model.model.layers.modules() if hasattr(m, "_qarl_plain")]
    assert len(noted) == 2 * 7 and all(noted)  # every projection of both layers
    assert not any("lean_forward" in r or "planned_linear" in r for r in torch._dynamo.utils.counters["graph_break"])


@pytest.mark.slow  # a second compilation of a layer (~40 s on 2 cores)
def test_a_compiled_layer_whose_hold_ends_calls_its_quantized_matmul_eagerly(task, tiny_dir):
    """A new amax ends one layer's hold: it quantizes its weight at each call again, and gets a graph that calls it
    eagerly, the eager numbers again."""
    eager, fused = held_policies(task, tiny_dir)
    held_agree(eager, fused, task)
    for policy in (eager, fused):
        quantizer = policy.model.model.layers[0].self_attn.q_proj.weight_quantizer
        quantizer.amax = quantizer.amax * 1.5
    held_agree(eager, fused, task)
    attention = fused.model.model.layers[0].self_attn
    assert not attention.q_proj._qarl_plain and attention.k_proj._qarl_plain
    assert any("planned_linear" in reason for reason in torch._dynamo.utils.counters["graph_break"])


def test_compiled_decoder_layers_are_refused_where_they_would_trace_or_repeat_something(task, tiny_dir, monkeypatch):
    with pytest.raises(ConfigError, match="compile_norms=false"):
        PolicyConfig(compile_layers=True, compile_norms=True)
    with pytest.raises(ConfigError, match="lora.mode=qlora"):
        PolicyConfig(compile_layers=True, lora=LoraConfig(mode="qlora"))
    with pytest.raises(ConfigError, match="quant_weight_cache=true"):
        PolicyConfig(compile_layers=True, quant_weight_cache=False)
    plain = tiny_policy(task, tiny_dir, W4A16)
    q_proj = plain.model.model.layers[0].self_attn.q_proj
    refuse_traced_quantized_layers(plain.model.model.layers)  # every quantized layer lean: nothing to refuse
    q_proj.forward = types.MethodType(type(q_proj).forward, q_proj)  # a forward of its own: the compiler would trace it
    with pytest.raises(ConfigError, match="layers.0.self_attn.q_proj run a forward of their own"):
        refuse_traced_quantized_layers(plain.model.model.layers)

    def load_model(*args, **kwargs):
        raise AssertionError("the weights loaded before the refusal")

    monkeypatch.setattr("qarl.backends.hf.load_model", load_model)
    with pytest.raises(ConfigError, match="experts"):
        tiny_policy(task, resolve_model_dir("embedded:tiny-qwen3moe"), W4A16, trainable=True, compile_layers=True)


@pytest.mark.parametrize("knob", ["compile_norms", "compile_mlp", "compile_layers", "compile_scores"])
def test_compiled_layers_are_refused_where_the_layers_must_be_others(knob):
    with pytest.raises(ConfigError, match=knob):
        PolicyConfig(exact_forward=True, dtype="bfloat16", **{knob: True})
    from qarl.backends.megatron_policy import check

    with pytest.raises(ConfigError, match=knob):
        check(PolicyConfig(backend="megatron", **{knob: True}))


def test_a_model_without_a_known_gated_mlp_is_refused_by_name_before_it_loads(task, monkeypatch):
    phi3 = resolve_model_dir("embedded:tiny-phi3")  # gate and up fused in one projection: not a known gated MLP

    def load_model(*args, **kwargs):
        raise AssertionError("the weights loaded before the refusal")

    monkeypatch.setattr("qarl.backends.hf.load_model", load_model)
    with pytest.raises(ConfigError, match="Phi3MLP.*compile_mlp=false"):
        tiny_policy(task, phi3, W4A16, trainable=True, compile_mlp=True)


def _scores_and_grads(policy, task, chunk_tokens: int):
    tok = policy.tokenizer
    prompts = [tok(p.prompt).input_ids for p in task.train[:8]]
    completions = [tok(p.answer).input_ids * (1 + i % 3) for i, p in enumerate(task.train[:8])]
    scores = score_completions(policy.model, prompts, completions, tok.pad_token_id, 0.7, chunk_tokens=chunk_tokens)
    scores.logprobs.sum().backward()
    grads = {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None}
    policy.model.zero_grad(set_to_none=True)
    return scores, grads


def test_compiled_scores_give_the_eager_numbers_within_fp32_rounding_in_one_graph(task, tiny_dir):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eager = tiny_policy(task, tiny_dir, W4A16, trainable=True)
    fused = tiny_policy(task, tiny_dir, W4A16, trainable=True, compile_scores=True)
    assert getattr(fused.model.get_output_embeddings(), FUSED_SCORES)
    want, want_grads = _scores_and_grads(eager, task, chunk_tokens=5)
    got, got_grads = _scores_and_grads(fused, task, chunk_tokens=5)  # 5 rows a chunk, and a shorter last chunk
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs >= 2  # the forward's scores and the backward's gradient
    torch.testing.assert_close(got.logprobs, want.logprobs, rtol=0, atol=5e-6)
    torch.testing.assert_close(got.entropy, want.entropy, rtol=0, atol=5e-5)
    assert got_grads.keys() == want_grads.keys() and len(got_grads) > 10
    for name, grad in want_grads.items():
        assert (got_grads[name] - grad).abs().max() <= 1e-5 * grad.abs().max(), name
    _scores_and_grads(fused, task, chunk_tokens=7)  # other chunk sizes: no new graph
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    assert not torch._dynamo.utils.counters["graph_break"]


def test_compiled_scores_are_refused_where_nothing_would_compile(task, tiny_dir):
    with pytest.raises(ConfigError, match="logprob_chunk_tokens=0"):
        PolicyConfig(compile_scores=True, logprob_chunk_tokens=0)
    with pytest.raises(ConfigError, match="compile_scores=false"):
        tiny_policy(task, tiny_dir, W4A16, trainable=True, compile_scores=True,
                    lora=LoraConfig(mode="qlora", target_modules=["q_proj", "lm_head"]))
    from qarl.config import load_recipe
    from qarl.config import check_qad_recipe

    with pytest.raises(ConfigError, match="QAD's KL"):
        check_qad_recipe(load_recipe("recipes/qa_distillation_tiny.yaml", ["policy.compile_scores=true"]))
