"""LoRA over a frozen fake-quantized base (qarl/lora.py): the two modes' math, what trains, the KL
reference, the engine's adapters (parity at the floor, adapter-only refits), checkpoints (small, tied to
their base, exact resume after SIGKILL), exports (qlora base + PEFT adapter, merged), and bad input."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from qarl.config import ConfigError, LoraConfig, PolicyConfig
from qarl.lora import AdapterDisabled, adapter_output, adapters_disabled, check_lora, lora_layers, merged_weight
from qarl.metrics import read_metrics
from qarl.optim import PolicyOptimizer
from qarl.parity import measure
from qarl.quant import folded_weights
from tests.conftest import answer_loss, tiny_policy
from tests.test_train import _deterministic, kill_after_first_checkpoint
from tests.test_train import _train_cmd as train_cmd

W4A16 = "quant_configs/nvfp4_a16.yaml"


def lora_policy(task, tiny_dir, mode: str, quant_cfg: str = W4A16, random_b: bool = True, **lora):
    policy = tiny_policy(task, tiny_dir, quant_cfg, trainable=True, lora=LoraConfig(mode=mode, **lora))
    if random_b:  # B = 0 at init: make the adapters matter
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for _, layer in lora_layers(policy.model):
                layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=generator) * 0.05)
    return policy


def _logits(policy, task) -> torch.Tensor:
    ids = policy.tokenizer([p.prompt for p in task.eval[:4]], return_tensors="pt", padding=True)
    with torch.no_grad():
        return policy.model(**ids).logits


@pytest.mark.parametrize("mode", ["qlora", "merged"])
def test_each_mode_computes_its_formula_and_starts_at_the_base(task, tiny_dir, mode):
    base = tiny_policy(task, tiny_dir, W4A16)
    fresh = lora_policy(task, tiny_dir, mode, random_b=False)
    assert torch.equal(_logits(fresh, task), _logits(base, task))  # B = 0: the adapted model is the base
    policy = lora_policy(task, tiny_dir, mode)
    name, layer = next(lora_layers(policy.model))
    x = torch.randn(3, layer.in_features)
    with torch.no_grad():
        got = layer(x)
        q_x = layer.input_quantizer(x) if layer.input_quantizer.is_enabled else x
        if mode == "qlora":  # Q(W) x + s B A x
            want = F.linear(q_x, layer.weight_quantizer(layer.weight), layer.bias) + adapter_output(
                x, layer.lora_A, layer.lora_B, layer.lora_scale)
        else:  # Q(W + s B A) x
            w = merged_weight(layer.weight, layer.lora_A, layer.lora_B, layer.lora_scale)
            want = F.linear(q_x, layer.weight_quantizer(w), layer.bias)
    assert torch.equal(got, want)
    assert not torch.equal(_logits(policy, task), _logits(base, task))
    with adapters_disabled(policy.model):  # the KL reference: the base, no copy
        assert torch.equal(_logits(policy, task), _logits(base, task))
    reference = policy.kl_reference(lambda: pytest.fail("a LoRA policy needs no second model"))
    assert isinstance(reference, AdapterDisabled) and reference.policy is policy.model
    # the fold the engine loads: Q(W) for qlora (the adapter travels separately), Q(W + s B A) merged
    folded = dict(folded_weights(policy.model))
    assert not any(k.endswith(("lora_A", "lora_B")) for k in folded)
    want_fold = layer.weight_quantizer(layer.served_weight())
    assert torch.equal(folded[f"{name}.weight"], want_fold)


@pytest.mark.parametrize("mode", ["qlora", "merged"])
def test_only_the_adapters_train(task, tiny_dir, mode):
    policy = lora_policy(task, tiny_dir, mode)
    assert policy.master is None  # a frozen base needs no master copy
    optimizer = PolicyOptimizer(policy, lr=1e-2, weight_decay=0.0, max_grad_norm=1.0)
    adapters = {id(p) for _, layer in lora_layers(policy.model) for p in (layer.lora_A, layer.lora_B)}
    assert {id(p) for p in optimizer.params} == adapters
    base = {n: p.detach().clone() for n, p in policy.model.named_parameters() if not p.requires_grad}
    before = {id(p): p.detach().clone() for p in optimizer.params}
    optimizer.backward(answer_loss(policy, task))
    assert optimizer.step().applied
    assert all(torch.equal(p, base[n]) for n, p in policy.model.named_parameters() if n in base)
    assert all(not torch.equal(p, before[id(p)]) for p in optimizer.params)


def test_bad_lora_settings_are_refused_before_loading(tiny_dir):
    cases = [
        (LoraConfig(mode="qlora", target_modules=["nope_proj"]), "match no linear layer"),
        (LoraConfig(mode="qlora", rank=100), "exceeds the smaller side"),
        (LoraConfig(mode="merged", dropout=0.1), "needs mode=qlora"),
        (LoraConfig(mode="qlora", rank=0), "rank must be >= 1"),
        (LoraConfig(mode="lora"), "choose one of"),
    ]
    for lora, needle in cases:
        with pytest.raises(ConfigError, match=needle):
            check_lora(PolicyConfig(lora=lora), tiny_dir)
    cfg = PolicyConfig(lora=LoraConfig(mode="qlora"))
    cfg.generation.tensor_parallel_size = 2
    with pytest.raises(ConfigError, match="tensor_parallel_size=1"):
        check_lora(cfg, tiny_dir)


def assert_at_floor(mismatch, quant_cfg: str) -> None:
    """The fp32 floor: same bits in, same rounding decisions. W4A16 holds it on every CPU. W4A4 holds it where the
    CPU's GEMM sums a row the same way whatever the number of rows; on an AMX CPU (Sapphire Rapids) 1-6 rows sum
    in another order than 7 or more, so the engine's decode steps and the policy's scoring of all tokens at once
    differ in last bits, and a few activations round to the neighbouring 4-bit value: a few tokens move by up to
    0.015, the mean stays 30x below the unsynced mismatch (3.1e-2)."""
    if quant_cfg == W4A16:
        assert mismatch.max_abs < 1e-4, mismatch
    else:
        assert mismatch.mean_abs < 1e-3 and mismatch.max_abs < 0.05, mismatch


@pytest.mark.parametrize("mode", ["qlora", "merged"])
@pytest.mark.parametrize("quant_cfg", [W4A16, "quant_configs/nvfp4_w4a4.yaml"])
def test_engine_reproduces_the_lora_policy_at_the_floor(engine, task, tiny_dir, mode, quant_cfg):
    from qarl.quant import resolve_format

    policy = lora_policy(task, tiny_dir, mode, quant_cfg)
    prompts = [policy.tokenizer(p.prompt).input_ids for p in task.eval[:8]]
    engine.set_quant_format(resolve_format(quant_cfg))
    first = engine.refit(policy.model)
    mismatch = measure(engine, policy, prompts, max_new_tokens=16, seed=0)
    assert_at_floor(mismatch, quant_cfg)
    adapter_bytes = sum(p.numel() * 4 for _, layer in lora_layers(policy.model) for p in (layer.lora_A, layer.lora_B))
    with torch.no_grad():  # a training step changes only the adapters
        for _, layer in lora_layers(policy.model):
            layer.lora_B.mul_(1.5)
    second = engine.refit(policy.model)
    if mode == "qlora":  # the base went once; now only the adapters (and the few amax values)
        assert adapter_bytes <= second.bytes < adapter_bytes * 1.05 and first.bytes > 3 * second.bytes
    else:  # merged: every adapted weight is folded again
        assert second.bytes > 3 * adapter_bytes
    assert_at_floor(measure(engine, policy, prompts, max_new_tokens=16, seed=0), quant_cfg)
    plain = tiny_policy(task, tiny_dir, quant_cfg)  # a refit from a policy without adapters removes them
    engine.refit(plain.model)
    assert_at_floor(measure(engine, plain, prompts, max_new_tokens=16, seed=0), quant_cfg)


# --- end to end: training, checkpoints, resume, export ------------------------------------------------

LORA = ["policy.lora.mode=qlora", "trainer.lr=3e-3"]


def _train_cmd(run_dir: Path, *extra: str) -> list[str]:
    return train_cmd(run_dir, *LORA, *extra)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("lora_run")
    subprocess.run(_train_cmd(run_dir), check=True, timeout=600)
    return run_dir


def test_lora_run_refits_only_adapters_and_keeps_small_checkpoints(lora_run):
    rows = read_metrics(lora_run / "metrics.jsonl")
    assert max(r["mismatch/max_abs_logprob_diff"] for r in rows[:4]) < 1e-4
    refit = [r["perf/refit_bytes"] for r in rows[:4]]
    assert len(set(refit)) == 1 and refit[0] < 400_000  # the adapter (311 KB fp32) + amax, every step
    checkpoint = lora_run / "checkpoints" / "step_4"
    assert (checkpoint / "adapter" / "adapter_config.json").is_file() and not (checkpoint / "policy").exists()
    weights = sum(p.stat().st_size for p in (checkpoint / "adapter").iterdir())
    base = Path(json.loads((checkpoint / "lora.json").read_text())["base"])
    assert weights < 0.25 * (base / "model.safetensors").stat().st_size


def test_lora_resume_after_sigkill_is_exact(lora_run, tmp_path):
    run_dir = tmp_path / "killed"
    kill_after_first_checkpoint(_train_cmd(run_dir), run_dir)
    subprocess.run(_train_cmd(run_dir, "trainer.resume=true"), check=True, timeout=600)
    assert _deterministic(read_metrics(run_dir / "metrics.jsonl")) == _deterministic(read_metrics(lora_run / "metrics.jsonl"))


def test_a_lora_checkpoint_on_another_base_is_refused(lora_run, tmp_path):
    from qarl.checkpoint import load_policy_checkpoint

    checkpoint = tmp_path / "step_4"
    shutil.copytree(lora_run / "checkpoints" / "step_4", checkpoint)
    manifest = json.loads((checkpoint / "lora.json").read_text())
    other = tmp_path / "other_base"
    shutil.copytree(manifest["base"], other)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(other / "model.safetensors"))
    tensors = {k: v + 0.01 for k, v in tensors.items()}
    save_file(tensors, str(other / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="an adapter only fits the exact base"):
        load_policy_checkpoint(checkpoint, PolicyConfig(), base_dir=str(other))
    with pytest.raises(ConfigError, match="differs from the settings"):
        load_policy_checkpoint(checkpoint, PolicyConfig(lora=LoraConfig(mode="qlora", rank=8)))


def test_qlora_export_is_base_plus_peft_adapter_and_matches_the_policy(lora_run, tmp_path):
    from qarl.checkpoint import load_policy_checkpoint
    from qarl.export import export_checkpoint, verify_export

    out = tmp_path / "export"
    summary = export_checkpoint(lora_run, "export/nvfp4_w4a16_compressed_tensors.yaml", out)
    # compressed-tensors' NVFP4 global scale is a divisor: a few weights land 1-2 fp32 ulps away (test_export)
    assert summary["lora"]["mode"] == "qlora" and summary["weights_differing"] < 0.25 * summary["quantized_params"]
    assert (out / "adapter" / "adapter_config.json").is_file()
    policy = load_policy_checkpoint(lora_run, PolicyConfig())
    report = verify_export(out, policy=policy)
    assert report["ok"], report
    adapter = report["adapter_loaders"]
    assert adapter["qarl-decode+adapter"]["max_abs_logit_diff"] < 1e-4
    assert adapter["transformers+peft"]["status"] == "ok", adapter
    assert adapter["transformers+peft"]["max_abs_logit_diff"] < 1e-4  # W4A16: dequantized base + adapter


def test_merged_export_and_dequantized_merge_match_the_policy(task, tiny_dir, tmp_path):
    from qarl.export import export_policy, verify_export
    from qarl.export.dequantized import export_dequantized

    policy = lora_policy(task, tiny_dir, "merged")
    out = tmp_path / "merged"
    summary = export_policy(policy, "export/nvfp4_w4a16_compressed_tensors.yaml", out)
    assert summary["lora"]["adapter_dir"] is None and summary["weights_differing"] < 0.25 * summary["quantized_params"]
    report = verify_export(out, policy=policy)
    assert report["ok"] and report["loaders"]["qarl-decode"]["max_abs_logit_diff"] < 1e-4, report
    qlora = lora_policy(task, tiny_dir, "qlora")
    plain = tmp_path / "dequantized"
    export_dequantized(qlora, plain, dtype="float32")  # fp32 here so the comparison sits at the floor
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(plain)
    ids = qlora.tokenizer([p.prompt for p in task.eval[:4]], return_tensors="pt", padding=True)
    with torch.no_grad():
        assert (merged(**ids).logits - _logits(qlora, task)).abs().max() < 1e-4
