"""Mixture-of-Experts without vLLM (qarl/models/experts.py): transformers' fused experts named as the checkpoint names
each expert; the fold the rollout engine loads is the quantized forward's weights, expert by expert; what cannot run
on experts is refused by name (smoothed expert inputs, activation formats on the GPU, unmapped MoE families); the packed export writes each expert and
decodes to the policy, the dequantized one is a plain model with the policy's logits; the memory plan counts a token's
experts. The engine side (vLLM's
FusedMoE refitted with these names, parity at the fp32 floor): tests/e2e/test_families.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from qarl.config import ConfigError
from qarl.models.block_attention import ATTENTION as BLOCKS
from qarl.models.block_attention import enable_block_attention
from qarl.models.cpu_moe import enable_cpu_moe
from qarl.models.experts import CHECKPOINT_NAMES, check_experts, expert_weights, fuse_expert_weights, is_fused_experts
from qarl.models.resolve import resolve_model_dir
from tests.conftest import W4A16, answer_loss, tiny_policy

MOE = "embedded:tiny-qwen3moe"


@pytest.fixture(scope="module")
def moe_dir() -> str:
    return resolve_model_dir(MOE)


def test_each_expert_has_the_name_and_weights_transformers_saves_it_with(moe_dir):
    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    saved = load_file(f"{moe_dir}/model.safetensors")
    named = {}
    for name, module in model.named_modules():
        if is_fused_experts(module):
            for fused in ("gate_up_proj", "down_proj"):
                named.update(expert_weights(f"{name}.", fused, getattr(module, fused).detach(), "qwen3_moe"))
    assert len(named) == 2 * 8 * 3 and all(torch.equal(named[k], saved[k]) for k in named)
    state = model.state_dict()
    fused = fuse_expert_weights(named, "qwen3_moe")
    assert fused.keys() == {k for k in state if ".experts." in k}
    assert all(torch.equal(fused[k], state[k]) for k in fused)


def test_the_fold_is_what_the_quantized_forward_computes_with(task, moe_dir):
    """A plain model holding the fold (each expert's Q(W), by its checkpoint names) gives the quantized policy's
    logits exactly: each expert was folded with its own quantizer."""
    from qarl.quant import folded_weights

    policy = tiny_policy(task, moe_dir, W4A16)
    folded = dict(folded_weights(policy.model))
    assert "model.layers.0.mlp.experts.7.up_proj.weight" in folded and not any(k.endswith("gate_up_proj") for k in folded)
    plain = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32, experts_implementation="eager")
    if policy.model.config._attn_implementation == BLOCKS:  # the attention (and MoE blocks) a CPU policy computes with
        enable_block_attention(plain)
        enable_cpu_moe(plain)
    unquantized = {k: v.clone() for k, v in plain.state_dict().items()}
    missing, unexpected = plain.load_state_dict(fuse_expert_weights(folded, "qwen3_moe"), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    experts = plain.model.layers[0].mlp.experts
    assert not torch.equal(experts.gate_up_proj, unquantized["model.layers.0.mlp.experts.gate_up_proj"])
    ids = torch.tensor([policy.tokenizer(p.prompt).input_ids for p in task.eval[:4]])
    with torch.no_grad():
        assert torch.equal(plain(ids).logits, policy.model(ids).logits)


def test_what_experts_can_run_is_planned_and_the_rest_is_refused_by_name(moe_dir):
    from qarl.generation import check_expert_inputs
    from qarl.quant import resolve_format
    from qarl.quant.formats import with_calibration
    from qarl.quant.ops import input_quant_plan, is_expert_input

    assert input_quant_plan(moe_dir, resolve_format(W4A16)) == {}
    for quant_cfg in ("quant_configs/nvfp4_w4a4.yaml", "quant_configs/fp8_w8a8.yaml"):  # one input for all experts
        plan = input_quant_plan(moe_dir, resolve_format(quant_cfg))
        experts = sorted(name for name in plan if is_expert_input(name))
        assert experts == [f"model.layers.{i}.mlp.experts.{p}_input" for i in (0, 1) for p in ("down_proj", "gate_up_proj")]
        assert "model.layers.0.self_attn.q_proj" in plan
        if torch.cuda.is_available():  # vLLM's fused MoE kernel has no input quantization
            with pytest.raises(ConfigError, match="inputs of Mixture-of-Experts experts.*nvfp4_a16"):
                check_expert_inputs(plan, resolve_format(quant_cfg))
        else:
            check_expert_inputs(plan, resolve_format(quant_cfg))
    shared = input_quant_plan(resolve_model_dir("embedded:tiny-qwen2moe"), resolve_format("quant_configs/fp8_w8a8.yaml"))
    assert {"model.layers.0.mlp.shared_expert.down_proj", "model.layers.0.mlp.experts.down_proj_input"} <= set(shared)
    with pytest.raises(ConfigError, match="smooths the inputs of Mixture-of-Experts experts"):
        input_quant_plan(moe_dir, with_calibration(resolve_format("quant_configs/nvfp4_w4a4.yaml"), "awq_lite"))
    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    check_experts("qwen3_moe", model)
    with pytest.raises(ConfigError, match="deepseek_v3.*supported MoE families"):
        check_experts("deepseek_v3", model)
    assert "deepseek_v3" not in CHECKPOINT_NAMES


def test_an_expert_width_the_block_does_not_divide_is_refused_before_loading(moe_dir, tmp_path):
    from transformers import AutoConfig

    from qarl.quant import resolve_format
    from qarl.quant.quantize import check_format_fits

    config = AutoConfig.from_pretrained(moe_dir)
    config.moe_intermediate_size = 40  # the down projections' input width; NVFP4 blocks are 16
    config.save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"experts\.down_proj \(input width 40, block size 16\)"):
        check_format_fits(str(tmp_path), resolve_format(W4A16))
    check_format_fits(moe_dir, resolve_format(W4A16))


@pytest.mark.parametrize("target", ["nvfp4_w4a16_modelopt", "nvfp4_w4a16_compressed_tensors", "nvfp4_w4a4_modelopt",
                                    "fp8_w8a8_compressed_tensors"])
def test_the_packed_export_writes_each_expert_and_decodes_to_the_policy(task, moe_dir, tmp_path, target):
    """Each expert's gate, up and down as a quantized layer of its own, one global scale for an expert's gate and
    up (vLLM fuses them), the experts' shared input scale where the format quantizes inputs, decoding to the
    policy's weights (bit for bit in ModelOpt's format; compressed-tensors stores the global scale as a divisor,
    docs/guides/export.md) and logits; the routers stay unquantized (listed in compressed-tensors' `ignore`, where vLLM looks)."""
    import json

    from qarl.export.core import export_policy
    from qarl.export.verify import verify_export

    quant_cfg = {"nvfp4_w4a4": "quant_configs/nvfp4_w4a4.yaml", "fp8_w8a8": "quant_configs/fp8_w8a8.yaml"}
    policy = tiny_policy(task, moe_dir, quant_cfg.get(target.rsplit("_", 1)[0].removesuffix("_compressed"), W4A16))
    summary = export_policy(policy, f"export/{target}.yaml", tmp_path / target)
    if "compressed_tensors" in target:
        ignored = json.loads((tmp_path / target / "config.json").read_text())["quantization_config"]["ignore"]
        assert {"model.layers.0.mlp.gate", "model.layers.1.mlp.gate", "lm_head"} <= set(ignored)
        assert not {"model.layers.0.mlp.experts.0.gate_proj", "model.layers.0.self_attn.q_proj"} & set(ignored)
    if "w4a16" not in target:
        tensors = load_file(str(tmp_path / target / "model.safetensors"))
        for projections in (("gate_proj", "up_proj"), ("down_proj",)):  # one input quantizer each for all experts
            scales = [v for k, v in tensors.items() if k.startswith("model.layers.0.mlp.experts.") and "input" in k
                      and k.split(".")[6] in projections]
            assert len(scales) == 8 * len(projections) and all(torch.equal(v, scales[0]) for v in scales)
    assert summary["quantized_layers"] == 2 * (4 + 8 * 3) and summary["fused_groups_sharing_scales"] == 2 * (1 + 8)
    report = verify_export(tmp_path / target, policy=policy)
    assert report["ok"] and report["fused_scales"]["shared"], report
    quantized = report["weights"]["quantized"]
    assert quantized["params"] - quantized["bit_identical"] == summary["weights_differing"]
    assert summary["weights_differing"] == 0 if "modelopt" in target else quantized["max_abs_diff"] < 1e-6
    assert report["loaders"]["qarl-decode"]["max_abs_logit_diff"] < 1e-5


def test_the_dequantized_export_is_the_policy(task, moe_dir, tmp_path):
    from qarl.export.dequantized import export_dequantized

    policy = tiny_policy(task, moe_dir, W4A16)
    export_dequantized(policy, tmp_path / "plain", dtype="float32")
    assert any(".experts.3.down_proj.weight" in k for k in load_file(str(tmp_path / "plain" / "model.safetensors")))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "plain", dtype=torch.float32,
                                                  experts_implementation="eager")
    if policy.model.config._attn_implementation == BLOCKS:  # the attention (and MoE blocks) a CPU policy computes with
        enable_block_attention(loaded)
        enable_cpu_moe(loaded)
    ids = torch.tensor([policy.tokenizer(p.prompt).input_ids for p in task.eval[:4]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, policy.model(ids).logits)


def test_the_memory_plan_counts_a_tokens_experts(moe_dir):
    from qarl.memory import ModelShape

    shape = ModelShape.of(moe_dir)
    assert shape.experts == 8 and shape.intermediate == 2 * 96  # two experts of 96 a token
    dense_mlp = 3 * shape.layers * shape.hidden * shape.intermediate
    attention = shape.layers * shape.hidden * (shape.attention_width + shape.query_width)
    assert shape.expert_params == shape.layers * 8 * 3 * shape.hidden * 96  # every expert's weights are held
    assert shape.params > attention + shape.expert_params > attention + dense_mlp
    assert shape.linear_params == attention + shape.expert_params  # what a frozen base packs
    # each expert a token is routed to keeps hidden-wide copies in transformers' eager experts (its gathered input,
    # output and weighted output): the H100 run that under-planned by 11 GiB without them (benchmarks/results/gpu/moe)
    assert shape.experts_per_token == 2
    dense = dataclasses.replace(shape, experts=0, experts_per_token=0)
    assert shape.layer_activation_bytes(2) - dense.layer_activation_bytes(2) == 4 * 2 * shape.hidden * 2


def test_the_matrix_refuses_smoothed_expert_inputs_before_any_model_loads(moe_dir, tmp_path):
    from qarl.config import RecipeConfig, load_recipe
    from qarl.matrix import plan_matrix

    cfg = load_recipe("benchmarks/recipes/moe_matrix_cpu.yaml", [], RecipeConfig)
    cfg = dataclasses.replace(cfg, matrix=dataclasses.replace(
        cfg.matrix, base=moe_dir, models={"plain": [moe_dir]}, ptq_methods=["max", "awq_lite"], out=str(tmp_path)))
    with pytest.raises(ConfigError, match="awq_lite.*smooths the inputs of Mixture-of-Experts experts"):
        plan_matrix(cfg)


def test_diagnose_reports_each_expert_on_the_rows_routed_to_it(moe_dir, monkeypatch):
    from qarl.config import RecipeConfig, load_recipe
    from qarl.diagnose import diagnose_model, expert_inputs
    from qarl.tasks import build_task

    cfg = load_recipe("recipes/qa_grpo_tiny.yaml", ["policy.quant_calib_size=16"], RecipeConfig)
    calibration = build_task(cfg.task, 0).calibration_texts(16)
    report = diagnose_model(cfg, moe_dir, calibration)
    experts = {n for n in report if ".experts." in n}
    assert "model.layers.0.self_attn.q_proj" in report
    assert {n.rpartition(".")[2] for n in experts} == {"gate_proj", "up_proj", "down_proj"} and len(experts) >= 12
    for row in report.values():  # 4-bit is coarser than 8-bit, for weights, inputs and outputs alike
        for kind in ("weight", "input", "output"):
            assert 0 < row[f"{kind}_error_fp8"] < row[f"{kind}_error_nvfp4"] < 0.5
    # an expert's gate sees exactly the tokens routed to it, padding left out: each real token top_k times in all
    monkeypatch.setattr("qarl.diagnose.MIN_EXPERT_ROWS", 1)
    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    batch = {"input_ids": torch.tensor([[5, 6, 7, 8, 9, 10]]), "attention_mask": torch.tensor([[1, 1, 1, 1, 1, 0]])}
    rows = expert_inputs(model, [batch])
    routed = sum(len(x) for n, x in rows.items() if n.startswith("model.layers.0.") and n.endswith("gate_proj"))
    assert routed == 5 * model.config.num_experts_per_tok


def test_a_qlora_base_packs_its_experts_expert_by_expert_with_the_same_bits(task, moe_dir, tmp_path):
    """Each expert's gate/up and down stored as its own quantizer's codes (qarl/quant/packed.py): the logits, the
    adapters' gradients and the fold the engine loads are the held base's bits; the fused parameters keep one element
    an expert, which ModelOpt still reads each expert's index from; the packed export decodes to the held policy;
    a copy stays packed and unpacks to W_q."""
    import copy

    from qarl.export.core import export_policy
    from qarl.export.verify import verify_export
    from qarl.memory import ModelShape, weight_bytes
    from qarl.metrics import storage_bytes
    from qarl.quant import folded_weights, resolve_format
    from qarl.quant.packed import is_placeholder, pack_frozen_weights, unpack_frozen_weights
    from tests.conftest import answer_loss, eval_logits, lora_policy

    held, packed = (lora_policy(task, moe_dir, "qlora", W4A16, pack_base=pack) for pack in (False, True))
    experts = packed.model.model.layers[0].mlp.experts
    assert all(is_placeholder(experts._parameters[k]) for k in ("gate_up_proj", "down_proj"))
    assert experts.gate_up_proj.untyped_storage().nbytes() == 8 * 4  # one fp32 NaN an expert
    assert torch.equal(eval_logits(packed, task), eval_logits(held, task))
    want, got = dict(folded_weights(held.model)), dict(folded_weights(packed.model))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    answer_loss(packed, task).backward()
    answer_loss(held, task).backward()
    grads = [[p.grad for _, p in sorted(m.named_parameters()) if p.requires_grad] for m in (packed.model, held.model)]
    assert len(grads[0]) == 16 and all(torch.equal(a, b) for a, b in zip(*grads, strict=True))

    shape = ModelShape.of(moe_dir)  # the plan's packed weights are what the policy holds, experts included
    held_bytes = storage_bytes(p for n, p in held.model.named_parameters() if "lora_" not in n)
    packed_bytes = storage_bytes([*(p for n, p in packed.model.named_parameters() if "lora_" not in n),
                                  *packed.model.buffers()])
    planned_saving = weight_bytes(shape, "float32") - weight_bytes(shape, "float32", resolve_format(W4A16))
    assert abs((held_bytes - packed_bytes) - planned_saving) < 0.02 * planned_saving, (held_bytes, packed_bytes)

    summary = export_policy(packed, "export/nvfp4_w4a16_modelopt.yaml", tmp_path / "export")
    report = verify_export(tmp_path / "export", policy=held)
    assert summary["quantized_layers"] == 2 * (4 + 8 * 3) and summary["weights_differing"] == 0
    assert report["ok"] and report["loaders"]["qarl-decode"]["max_abs_logit_diff"] == 0.0

    partial = lora_policy(task, moe_dir, "qlora", W4A16, pack_base=False).model  # one expert left unquantized
    partial.model.layers[0].mlp.experts.gate_up_proj_weight_quantizers[3].disable()
    report = pack_frozen_weights(partial)
    assert report.kept == ["model.layers.0.mlp.experts.gate_up_proj"] and "expert left unquantized" in report.summary()
    assert not is_placeholder(partial.model.layers[0].mlp.experts.gate_up_proj)

    copied = copy.deepcopy(packed.model)
    assert copied.model.layers[0].mlp.experts.gate_up_proj.stride() == (1, 0, 0)
    assert unpack_frozen_weights(copied) == 2 * (4 + 8 * 2)
    unpacked, experts = copied.model.layers[1].mlp.experts, held.model.model.layers[1].mlp.experts
    assert torch.equal(unpacked.down_proj,
                       torch.stack([q(w) for q, w in zip(experts.down_proj_weight_quantizers, experts.down_proj)]))


@pytest.mark.parametrize("lora", ["none", "qlora"])
def test_checkpointed_experts_recompute_with_the_quantizers_of_their_own_layer(task, moe_dir, lora):
    """A checkpointed layer's recomputation stops early (torch raises inside the layer once the tensors the backward
    needs are back); ModelOpt's fused experts swap `F.linear` for their forward without restoring it on an
    exception, so an early stop inside the experts left every later `F.linear` quantized with one expert's
    quantizers (the next layer's projections: wrong gradients, or a packed base's error). Checkpointed layers
    recompute whole where experts swap functions: the gradients are the plain path's and `F.linear` is torch's."""
    from qarl.config import LoraConfig

    linear = torch.nn.functional.linear
    grads = []
    for checkpointing in ("off", "on"):
        policy = tiny_policy(task, moe_dir, W4A16, trainable=True, gradient_checkpointing=checkpointing,
                             lora=LoraConfig(mode=lora))
        policy.model.train()
        answer_loss(policy, task).backward()
        assert torch.nn.functional.linear is linear
        grads.append([p.grad for _, p in sorted(policy.model.named_parameters()) if p.requires_grad])
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(*grads, strict=True))
