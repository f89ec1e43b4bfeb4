"""LoRA end to end (QA-GRPO with policy.lora, tests/loops.py's few steps, real vLLM in subprocesses): adapter-only
refits and small checkpoints tied to their base, exact resume after SIGKILL (`-m slow`), and the qlora export (base +
PEFT adapter)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from qarl.config import ConfigError, LoraConfig, PolicyConfig
from qarl.metrics import read_metrics
from tests.loops import GRPO, deterministic, kill_after_first_checkpoint

LORA = ["policy.lora.mode=qlora", "trainer.lr=3e-3"]


def _train_cmd(run_dir: Path, *extra: str) -> list[str]:
    return GRPO.command(run_dir, *LORA, *extra)


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


@pytest.mark.slow  # exact resume after SIGKILL: tests/e2e/test_loops.py; a LoRA checkpoint loads: the tests below
def test_lora_resume_after_sigkill_is_exact(lora_run, tmp_path):
    run_dir = tmp_path / "killed"
    kill_after_first_checkpoint(_train_cmd(run_dir), run_dir)
    subprocess.run(_train_cmd(run_dir, "trainer.resume=true"), check=True, timeout=600)
    assert deterministic(read_metrics(run_dir / "metrics.jsonl")) == deterministic(read_metrics(lora_run / "metrics.jsonl"))


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
