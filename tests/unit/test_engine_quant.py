"""The engine's input quantization (qarl/quant/ops.py, qarl/generation/engine_quant.py): one op per
layer that must compute exactly what the policy's ModelOpt input quantizer computes, the plan read from
ModelOpt's own quantizers, and the engine modes (eager / CUDA graphs) with their refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from qarl.config import ConfigError, GenerationConfig, LoraConfig, PolicyConfig
from qarl.generation import engine_adapter_rank, engine_mode, merges_adapters, training_engine_rank
from qarl.generation.vllm_engine import runs_eager
from qarl.generation.vllm_lora import engine_options as lora_engine_options
from qarl.models.resolve import resolve_model_dir
from qarl.quant import resolve_format
from qarl.quant.ops import FP8, NVFP4, InputQuant, fake_quant_input, input_quant_plan

from tests.conftest import tiny_policy

ACTIVATION_FORMATS = ["nvfp4_w4a4", "fp8_w8a8"]


def _inputs(width: int, dtype: torch.dtype, device: str) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    normal = torch.randn(3, 7, width, generator=generator)
    heavy = torch.distributions.StudentT(2.0).sample((5, width)) * 3
    strided = torch.randn(width, 6, generator=generator).t()  # non-contiguous, as ModelOpt meets it
    return [t.to(dtype=dtype, device=device) for t in (normal, heavy, strided, torch.zeros(2, width))]


def _check_op_equals_modelopt(policy, device: str) -> int:
    """fake_quant_input == TensorQuantizer.forward bit for bit on every quantized input of `policy`."""
    checked = 0
    plan = input_quant_plan(policy.model_dir, policy.format)
    modules = dict(policy.model.named_modules())
    for name, spec in plan.items():
        quantizer = modules[name].input_quantizer.to(device)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for x in _inputs(modules[name].weight.shape[1], dtype, device):
                expected = quantizer(x)
                got = fake_quant_input(x, quantizer.amax, spec, quantizer.pre_quant_scale)
                assert got.dtype == expected.dtype and torch.equal(got, expected), (name, dtype)
                checked += 1
    return checked


@pytest.mark.parametrize("fmt", ACTIVATION_FORMATS)
def test_engine_op_is_modelopts_input_quantizer_bit_for_bit(task, tiny_dir, fmt):
    policy = tiny_policy(task, tiny_dir, fmt, quant_weight_cache=False)  # ModelOpt's own forward
    assert _check_op_equals_modelopt(policy, "cpu") == 14 * 3 * 4


def test_engine_op_applies_awq_smoothing_as_modelopt(task, tiny_dir):
    from qarl.config import PolicyConfig
    from qarl.policy import build_policy
    from qarl.quant.formats import with_calibration

    awq = with_calibration(resolve_format("nvfp4_w4a4"), "awq_lite")
    policy = build_policy(PolicyConfig(quant_calib_size=16, quant_weight_cache=False), task.calibration_texts(16), model_dir=tiny_dir, fmt=awq)
    assert all(spec.smoothing for spec in input_quant_plan(tiny_dir, awq).values())
    assert policy.model.model.layers[0].self_attn.q_proj.input_quantizer.pre_quant_scale is not None
    assert _check_op_equals_modelopt(policy, "cpu") == 14 * 3 * 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", ACTIVATION_FORMATS)
def test_engine_op_is_modelopts_input_quantizer_on_the_gpu(task, tiny_dir, fmt):
    policy = tiny_policy(task, tiny_dir, fmt, quant_weight_cache=False)  # ModelOpt's own forward
    assert _check_op_equals_modelopt(policy, "cuda") == 14 * 3 * 4


def test_plan_reads_modelopts_quantizers(tiny_dir):
    assert input_quant_plan(tiny_dir, None) == {}
    assert input_quant_plan(tiny_dir, resolve_format("nvfp4_a16")) == {}  # weight-only: a plain vLLM engine
    for name, kind in [("nvfp4_w4a4", InputQuant(NVFP4, block_size=16)), ("fp8_w8a8", InputQuant(FP8))]:
        plan = input_quant_plan(tiny_dir, resolve_format(name))
        assert len(plan) == 14 and set(plan.values()) == {kind}  # 7 projections x 2 layers; lm_head stays off
        assert "model.layers.1.mlp.down_proj" in plan and "lm_head" not in plan


def test_plan_refuses_what_the_engine_cannot_reproduce(tiny_dir, tmp_path):
    with pytest.raises(ConfigError, match="is neither"):  # INT8 per-tensor inputs
        input_quant_plan(tiny_dir, resolve_format("INT8_DEFAULT_CFG"))
    config = tmp_path / "fp8_with_output.yaml"
    config.write_text("quant_cfg:\n"
                      "  - quantizer_name: '*weight_quantizer'\n    cfg: {num_bits: [4, 3], axis: null}\n"
                      "  - quantizer_name: '*input_quantizer'\n    cfg: {num_bits: [4, 3], axis: null}\n"
                      "  - quantizer_name: '*output_quantizer'\n    cfg: {num_bits: [4, 3], axis: null}\n"
                      "algorithm: max\n")
    with pytest.raises(ConfigError, match="output_quantizer"):
        input_quant_plan(tiny_dir, resolve_format(str(config)))


def test_engine_modes_and_their_refusals():
    on_gpu = torch.cuda.is_available()
    assert runs_eager(GenerationConfig()) is not on_gpu  # auto: graphs on a GPU, eager on CPU
    assert runs_eager(GenerationConfig(enforce_eager=True)) is True  # YAML's boolean spelling
    assert runs_eager(GenerationConfig(enforce_eager="auto"), adapter_hooks="why") is True
    assert runs_eager(GenerationConfig(enforce_eager="auto"), smoothing=True) is True
    with pytest.raises(ConfigError, match="choose one of"):
        runs_eager(GenerationConfig(enforce_eager="sometimes"))
    with pytest.raises(ConfigError, match="qlora adapters, which the engine then adds by forward hooks"):
        runs_eager(GenerationConfig(enforce_eager=False), adapter_hooks="why")
    with pytest.raises(ConfigError, match="AWQ"):
        runs_eager(GenerationConfig(enforce_eager="false"), smoothing=True)
    if not on_gpu:
        with pytest.raises(ConfigError, match="CPU"):
            runs_eager(GenerationConfig(enforce_eager="false"))


def test_vllm_lora_serves_qlora_adapters_where_it_can_and_hooks_are_named_elsewhere(tiny_dir):
    def hooks(cfg: PolicyConfig, quantized_inputs: bool, model_dir: str = tiny_dir) -> str | None:
        """Why the engine of a run of `cfg` adds adapters by hooks (`engine_mode`, as the run's settings check asks)."""
        fmt = resolve_format("nvfp4_w4a4" if quantized_inputs else "nvfp4_a16")
        return engine_mode(model_dir, fmt, cfg.generation, cfg.dtype, training_engine_rank(cfg, False), False)[2]

    qlora = PolicyConfig(lora=LoraConfig(mode="qlora", rank=16))
    assert engine_adapter_rank(qlora.lora) == 16
    assert engine_adapter_rank(PolicyConfig().lora) == 0 == engine_adapter_rank(None)
    assert training_engine_rank(qlora, False) == 16 and training_engine_rank(qlora, True) == 0  # a merging engine: none
    assert hooks(PolicyConfig(), quantized_inputs=True) is None  # no adapters
    assert hooks(dataclasses.replace(qlora, dtype="bfloat16"), quantized_inputs=False) is None
    assert "quantizes layer inputs" in hooks(qlora, quantized_inputs=True)
    huge = dataclasses.replace(qlora, dtype="bfloat16", lora=LoraConfig(mode="qlora", rank=1024))
    assert "above the largest rank" in hooks(huge, quantized_inputs=False)
    moe = hooks(dataclasses.replace(qlora, dtype="bfloat16"), False, resolve_model_dir("embedded:tiny-qwen3moe"))
    assert "MoE" in moe and ("CPU" in moe) is not torch.cuda.is_available()  # hooks on both: vLLM's MoE LoRA unchecked
    assert (hooks(qlora, quantized_inputs=False) is None) is not torch.cuda.is_available()  # GPU: fp16/bf16
    assert lora_engine_options(16)["max_lora_rank"] == 16 and lora_engine_options(17)["max_lora_rank"] == 32


def test_auto_merges_qlora_adapters_where_vllm_lora_cannot_serve_them_and_a_merge_can(tiny_dir):
    """`policy.generation.qlora_adapters=auto` (the default): vLLM's LoRA where it serves the adapters, a merge where
    it cannot (the engine keeps its graphs; e.g. MoE, a rank above vLLM's), qarl's hooks where a merge cannot either
    (a format that quantizes layer inputs, a base served packed); "lora" and "merged" as asked."""
    w4a16, w4a4 = resolve_format("nvfp4_a16"), resolve_format("nvfp4_w4a4")
    moe_dir = resolve_model_dir("embedded:tiny-qwen3moe")
    qlora = PolicyConfig(dtype="bfloat16", lora=LoraConfig(mode="qlora", rank=16))
    assert qlora.generation.qlora_adapters == "auto"
    assert merges_adapters(qlora, moe_dir, w4a16, False)  # vLLM's LoRA on experts unchecked: merged, graphs kept
    assert not merges_adapters(qlora, tiny_dir, w4a16, False)  # dense: vLLM's LoRA serves it
    assert not merges_adapters(qlora, moe_dir, w4a4, False)  # quantized inputs: a merge cannot; hooks
    assert not merges_adapters(qlora, moe_dir, w4a16, True)  # a packed base holds no merged weight
    huge = dataclasses.replace(qlora, lora=LoraConfig(mode="qlora", rank=1024))
    assert merges_adapters(huge, tiny_dir, w4a16, False)  # above vLLM's largest rank
    for mode, merges in (("lora", False), ("merged", True)):
        asked = dataclasses.replace(qlora, generation=GenerationConfig(qlora_adapters=mode))
        assert merges_adapters(asked, moe_dir, w4a16, False) is merges
        assert merges_adapters(asked, tiny_dir, w4a16, False) is merges
    assert not merges_adapters(PolicyConfig(), moe_dir, w4a16, False)  # full training: no adapters


def test_a_run_decides_the_merge_for_its_rollout_format_not_the_format_its_engine_starts_in():
    """QAD's engine starts in its teacher's format (unquantized, which a merge could serve) and then serves the
    student's: the run decides once, for the student's format, so an activation format keeps qarl's hooks throughout
    (a merging engine would be refused at the switch)."""
    from qarl.config import RecipeConfig, load_recipe
    from qarl.run import engine_merges_adapters

    moe = ["policy.model_name=embedded:tiny-qwen3moe", "policy.lora.mode=qlora"]
    for fmt, merges in (("nvfp4_w4a4", False), ("nvfp4_a16", True)):
        cfg = load_recipe("recipes/qa_distillation_tiny.yaml", [*moe, f"policy.quant_cfg=quant_configs/{fmt}.yaml"],
                          RecipeConfig)
        assert engine_merges_adapters(cfg, resolve_model_dir("embedded:tiny-qwen3moe")) is merges
