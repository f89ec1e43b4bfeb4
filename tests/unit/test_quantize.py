"""The quantized policy, real ModelOpt quantizers, no engine: calibration, fused amax, STE, folding, errors."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from qarl.config import ConfigError, PolicyConfig
from qarl.calibration import load_calibration_texts
from qarl.policy import build_policy
from qarl.scoring import score_completions
from qarl.quant import FUSED_SIBLINGS, folded_weights, load_quantizer_state, quantizer_state, resolve_format
from qarl.quant.quantize import quantize_policy

from tests.conftest import FORMATS


@pytest.mark.parametrize("fmt", FORMATS)
def test_fused_siblings_share_amax(make_policy, fmt):
    policy = make_policy(fmt)
    modules = dict(policy.model.named_modules())
    checked = 0
    for name, module in modules.items():
        for siblings in FUSED_SIBLINGS.values():
            parts = [modules.get(f"{name}.{s}") for s in siblings]
            if not all(p is not None for p in parts):
                continue
            for attr in ("weight_quantizer", "input_quantizer"):
                quantizers = [getattr(p, attr) for p in parts]
                if not quantizers[0].is_enabled:
                    continue
                amaxes = [q.amax.item() for q in quantizers]
                assert len(set(amaxes)) == 1, f"{name} {attr}: {amaxes}"
                checked += 1
    # 2 layers x (qkv, gate_up) x (weights, and inputs where the format quantizes them)
    assert checked == (4 if fmt.endswith("nvfp4_a16.yaml") else 8)


def test_weight_amax_is_max_over_fused_parts(make_policy, tiny_dir):
    policy = make_policy("nvfp4_w4a4")
    attn = policy.model.model.layers[0].self_attn
    expected = max(getattr(attn, p).weight.detach().abs().max().item() for p in ("q_proj", "k_proj", "v_proj"))
    assert attn.q_proj.weight_quantizer.amax.item() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("fmt", FORMATS)
def test_ste_gradients_reach_master_weights(make_policy, task, fmt):
    policy = make_policy(fmt)
    tok = policy.tokenizer
    prompts = [tok(p.prompt).input_ids for p in task.train[:8]]
    comps = [tok(p.answer).input_ids for p in task.train[:8]]
    scores = score_completions(policy.model, prompts, comps, tok.pad_token_id)
    (-(scores.logprobs.sum())).backward()
    q_proj = policy.model.model.layers[0].self_attn.q_proj
    assert q_proj.weight.grad is not None and q_proj.weight.grad.abs().sum() > 0
    # the gradient flows through the fake quantizer, not around it: it differs from the unquantized one
    plain = make_policy("none")
    plain_scores = score_completions(plain.model, prompts, comps, tok.pad_token_id)
    (-(plain_scores.logprobs.sum())).backward()
    assert not torch.allclose(q_proj.weight.grad, plain.model.model.layers[0].self_attn.q_proj.weight.grad)


@pytest.mark.parametrize("fmt", FORMATS)
def test_folded_weights_are_what_the_forward_uses(make_policy, fmt):
    """A quantized layer's output equals F.linear(input quantizer(x), folded weight)."""
    policy = make_policy(fmt)
    folded = dict(folded_weights(policy.model))
    layer = policy.model.model.layers[1].mlp.down_proj
    x = torch.randn(3, 5, layer.in_features, device=layer.weight.device)
    with torch.no_grad():
        expected = layer(x)
        manual = torch.nn.functional.linear(layer.input_quantizer(x), folded["model.layers.1.mlp.down_proj.weight"])
    assert torch.equal(expected, manual)
    assert not torch.equal(folded["model.layers.1.mlp.down_proj.weight"], layer.weight)
    assert torch.equal(folded["model.embed_tokens.weight"], policy.model.model.embed_tokens.weight)


def test_quantizer_state_round_trip(make_policy, tiny_dir):
    policy = make_policy("nvfp4_w4a4")
    state = quantizer_state(policy.model)
    assert len(state) == 2 * 7 * 2  # layers x linears x (weight, input)
    fresh = build_policy(PolicyConfig(quant_cfg="nvfp4_w4a4"), [], model_dir=tiny_dir, calibrate=False)
    load_quantizer_state(fresh.model, state)
    assert all(torch.equal(a, b) for a, b in zip(state.values(), quantizer_state(fresh.model).values()))
    with pytest.raises(ConfigError, match="no quantizer named"):
        load_quantizer_state(fresh.model, {"model.nope.weight_quantizer": torch.tensor(1.0)})


def test_block_size_that_does_not_divide_a_layer_is_named(tmp_path, task):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(hidden_size=64, intermediate_size=72, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=128, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(config)
    called = []
    with pytest.raises(ConfigError, match=r"model\.layers\.0\.mlp\.down_proj \(input width 72, block size 16\)"):
        quantize_policy(model, resolve_format("nvfp4_a16"), lambda: called.append(1) or [])
    assert not called, "the check must come before calibration"
    # the fix the message suggests works: exclude the layer in the config
    path = tmp_path / "nvfp4_skip_down.yaml"
    path.write_text((resolve_format("nvfp4_a16").source and open("quant_configs/nvfp4_a16.yaml").read())
                    + "  - quantizer_name: '*down_proj*'\n    enable: false\n")
    quantize_policy(Qwen2ForCausalLM(config), resolve_format(str(path)), None)


def test_missing_calibration_data_is_an_error_before_loading_the_model(tmp_path):
    for source in [str(tmp_path / "nope.jsonl"), "no-such-org/no-such-dataset-qarl"]:
        with pytest.raises(ConfigError, match="calibration data"):
            load_calibration_texts(PolicyConfig(quant_calib_data=source), [])
    data = tmp_path / "calib.jsonl"
    data.write_text('{"text": "12+3=15"}\n{"text": "1+1=2"}\n')
    assert load_calibration_texts(PolicyConfig(quant_calib_data=str(data)), []) == ["12+3=15", "1+1=2"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": "x"}\n')
    with pytest.raises(ConfigError, match="no column"):
        load_calibration_texts(PolicyConfig(quant_calib_data=str(bad)), [])


@pytest.mark.parametrize("fmt", ["nvfp4_a16", "nvfp4_w4a4"])
def test_awq_smoothing_is_shared_by_fused_siblings_and_served_as_the_forward_computes(task, tiny_dir, fmt):
    """AWQ-lite PTQ: one input scale per fused group (the engine fuses q/k/v and gate/up and reads one
    input), folded into the served weight when the input is not quantized, kept on the input otherwise."""
    from qarl.quant.formats import with_calibration

    calibrated = with_calibration(resolve_format(fmt), "awq_lite")
    policy = build_policy(PolicyConfig(quant_calib_size=32), task.calibration_texts(32), model_dir=tiny_dir, fmt=calibrated)
    attn = policy.model.model.layers[0].self_attn
    scales = [m.input_quantizer.pre_quant_scale for m in (attn.q_proj, attn.k_proj, attn.v_proj)]
    assert all(s is not None for s in scales) and not torch.equal(scales[0], torch.ones_like(scales[0]))
    assert torch.equal(scales[0], scales[1]) and torch.equal(scales[0], scales[2])
    layer = policy.model.model.layers[1].mlp.down_proj
    x = torch.randn(3, 5, layer.in_features, device=layer.weight.device)
    folded = dict(folded_weights(policy.model))["model.layers.1.mlp.down_proj.weight"]
    with torch.no_grad():
        expected = layer(x)
        if fmt == "nvfp4_a16":  # the scale lives in the served weight: x (Q(W) s)^T
            manual = torch.nn.functional.linear(x, folded)
        else:  # the engine's input quantizer applies it: Q(x s) Q(W)^T
            manual = torch.nn.functional.linear(layer.input_quantizer(x), folded)
    torch.testing.assert_close(manual, expected, rtol=1e-5, atol=1e-6)


def test_smoothing_calibration_cannot_train():
    """AWQ rewrites the weights and moves a scale into the input quantizer: PTQ only, refused for training."""
    from qarl.config import RecipeConfig, load_recipe
    from qarl.quant.formats import with_calibration
    from qarl.quant.quantize import check_trainable_format
    from qarl.run import check_run_settings

    check_trainable_format(resolve_format("nvfp4_w4a4"), "policy.quant_cfg")
    with pytest.raises(ConfigError, match="awq_lite, a smoothing algorithm"):
        check_trainable_format(with_calibration(resolve_format("nvfp4_w4a4"), "awq_lite"), "policy.quant_cfg")
    with pytest.raises(ConfigError, match="policy.quant_cfg .*post-training quantization only"):
        check_run_settings(load_recipe("recipes/qa_grpo_tiny.yaml", ["policy.quant_cfg=NVFP4_AWQ_LITE_CFG"], RecipeConfig))


@pytest.mark.parametrize("spec", ["NVFP4_FOUR_OVER_SIX_CFG", "NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG"])
def test_static_block_formats_round_trip_through_the_quantizer_state(task, tiny_dir, spec):
    """ModelOpt's MSE / 4-over-6 calibration turns weight quantizers into static-block ones with a global
    amax; a checkpoint's quantizer state restores them: the same folded weights, bit for bit, cached."""
    from qarl.quant.fastpath.weight_cache import WeightCacheMixin

    cfg = PolicyConfig(quant_calib_size=16)
    policy = build_policy(cfg, task.calibration_texts(16), model_dir=tiny_dir, fmt=resolve_format(spec))
    quantizer = policy.model.model.layers[0].mlp.down_proj.weight_quantizer
    assert quantizer.is_nvfp4_static and isinstance(quantizer, WeightCacheMixin)
    fresh = build_policy(cfg, [], model_dir=tiny_dir, fmt=resolve_format(spec), calibrate=False)
    load_quantizer_state(fresh.model, quantizer_state(policy.model))
    restored = fresh.model.model.layers[0].mlp.down_proj.weight_quantizer
    assert restored.is_nvfp4_static and isinstance(restored, WeightCacheMixin)
    before, after = dict(folded_weights(policy.model)), dict(folded_weights(fresh.model))
    assert all(torch.equal(before[k].view(torch.int32), after[k].view(torch.int32)) for k in before)


def test_a_model_quantized_by_the_first_import_of_modelopt_is_freed_when_dropped():
    """A process's first quantizing call imports ModelOpt, whose libraries keep their optional imports' errors with
    the tracebacks, and so every frame on the stack at that import (modelopt_compat.import_modelopt imports it on a
    thread of its own): the model quantized there is freed once the caller drops it, as every later one is."""
    code = textwrap.dedent("""
        import gc, sys, weakref
        import torch.nn as nn
        from qarl.quant.formats import insert_quantizers, resolve_format

        def quantized():
            model = nn.Sequential(nn.Linear(32, 32))
            insert_quantizers(model, resolve_format("nvfp4_a16"))
            return weakref.ref(model)

        assert "modelopt" not in sys.modules, "ModelOpt imported before the first quantizing call"
        ref = quantized()
        gc.collect()
        print("freed" if ref() is None else "kept")
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[-1] == "freed"
