"""The engine with CUDA graphs and vLLM's compilation (the GPU default): a refit must reach what the captured
graphs compute, weights and amax alike. A stale graph is a silent bug, so this checks what the engine samples.
Needs CUDA; skipped without it."""

from __future__ import annotations

import weakref

import pytest
import torch

from qarl.config import GenerationConfig

from tests.conftest import check_kept_logprobs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("fmt", ["nvfp4_a16", "nvfp4_w4a4", "fp8_w8a8"])
def test_refit_under_cuda_graphs_changes_what_the_engine_samples(tiny_dir, task, make_policy, fmt):
    from qarl.generation import VLLMEngine
    from qarl.generation.engine_quant import QuantizedInput
    from qarl.parity import measure
    from qarl.scoring import score_completions

    policy = make_policy(fmt)
    settings = GenerationConfig(max_new_tokens=8, gpu_memory_utilization=0.2, sleep_between_rollouts="off")
    engine = VLLMEngine(tiny_dir, settings, "float32", 0, quant_format=policy.format)
    assert not engine.eager  # "auto" on a GPU: graphs and compilation
    quantized_inputs = [m for m in engine.model.modules() if isinstance(m, QuantizedInput)]
    assert len(quantized_inputs) == (0 if fmt == "nvfp4_a16" else 8)  # W4A16: a plain vLLM model
    engine.refit(policy.model)
    prompts = [policy.tokenizer(p.prompt).input_ids for p in task.eval[:16]]
    before = [c.token_ids for c in engine.generate(prompts, greedy=True)]
    # (W4A4 and FP8 on a GPU mismatch above the floor: different kernels on the two sides, see parity)
    assert measure(engine, policy, prompts, max_new_tokens=8, seed=0).mean_abs < 5e-2

    optimizer = torch.optim.SGD(policy.model.parameters(), lr=5.0)  # a large step: greedy outputs change
    scores = score_completions(policy.model, prompts, before, policy.tokenizer.pad_token_id)
    scores.logprobs.sum().backward()
    optimizer.step()
    assert [c.token_ids for c in engine.generate(prompts, greedy=True)] == before  # no refit yet
    stale = measure(engine, policy, prompts, max_new_tokens=8, seed=0)
    engine.refit(policy.model)
    after = [c.token_ids for c in engine.generate(prompts, greedy=True)]
    assert after != before
    assert measure(engine, policy, prompts, max_new_tokens=8, seed=0).mean_abs < stale.mean_abs / 5

    if quantized_inputs:  # the amax alone: the graphs read the engine's amax tensors, written in place
        amax_tensors = [m.input_amax for m in quantized_inputs]
        for module in policy.model.modules():
            quantizer = getattr(module, "input_quantizer", None)
            if quantizer is not None and quantizer.is_enabled:
                quantizer.amax = quantizer.amax * 64
        stale = measure(engine, policy, prompts, max_new_tokens=8, seed=0)
        engine.refit(policy.model)
        assert all(m.input_amax is t for m, t in zip(quantized_inputs, amax_tensors))
        assert [c.token_ids for c in engine.generate(prompts, greedy=True)] != after
        assert measure(engine, policy, prompts, max_new_tokens=8, seed=0).mean_abs < stale.mean_abs / 5
    engine.close()


def test_logprobs_kept_at_the_sampler_under_cuda_graphs(tiny_dir, make_policy):
    """The log-probs kept at vLLM's sampler (the v2 model runner's on a GPU) are vLLM's own (conftest)."""
    from qarl.generation import VLLMEngine

    policy = make_policy("nvfp4_w4a4")
    settings = GenerationConfig(max_new_tokens=8, gpu_memory_utilization=0.2, sleep_between_rollouts="off")
    engine = VLLMEngine(tiny_dir, settings, "float32", 0, quant_format=policy.format)
    check_kept_logprobs(engine, policy)
    engine.close()


def test_a_colocated_graph_engine_restarts_for_a_new_format(tiny_dir, make_policy):
    """A graph engine changes format by restarting in this process, sleep mode on (vLLM's sleep allocator
    takes one engine at a time, so the old one must have given everything back); it then serves the new
    format synced (distill's teacher -> student switch, `qarl parity`, `qarl eval`)."""
    from qarl.generation import VLLMEngine
    from qarl.generation.engine_quant import QuantizedInput

    engine = VLLMEngine(tiny_dir, GenerationConfig(max_new_tokens=8, gpu_memory_utilization=0.2), "float32", 0)
    assert engine.sleeps and not engine.eager
    plain = make_policy("none")
    engine.refit(plain.model)
    prompt = [[5, 6, 7, 8]]
    first = engine.generate(prompt, greedy=True)[0].token_ids
    policy = make_policy("nvfp4_w4a4")
    engine.set_quant_format(policy.format)
    assert sum(isinstance(m, QuantizedInput) for m in engine.model.modules()) == 8
    engine.refit(policy.model)
    engine.generate(prompt, greedy=True)
    engine.set_quant_format(None)
    engine.refit(plain.model)
    assert engine.generate(prompt, greedy=True)[0].token_ids == first
    engine.close()


@pytest.mark.parametrize("family", ["mistral", "qwen3"])
def test_a_graph_engine_of_a_model_class_compiled_twice_restarts(family):
    """vLLM compiles MistralModel (a LlamaModel) and Qwen3Model (a Qwen2Model) twice over: two bytecode hooks, vLLM
    removing one (when the engine is collected). The engine drops both; left, it keeps the closed model alive, and the next engine
    (sleep mode: one at a time in a process) cannot start."""
    from qarl.generation import VLLMEngine
    from qarl.models.resolve import resolve_model_dir

    model_dir = resolve_model_dir(f"embedded:tiny-{family}")
    for _ in range(2):
        engine = VLLMEngine(model_dir, GenerationConfig(max_new_tokens=8, gpu_memory_utilization=0.2), "float32", 0)
        assert engine.sleeps and not engine.eager
        assert engine.generate([[5, 6, 7, 8]], greedy=True)[0].token_ids
        closed = [weakref.ref(module) for module in engine.model.modules()]  # a hook holds the inner model
        engine.close()
        assert not [ref() for ref in closed if ref() is not None]

