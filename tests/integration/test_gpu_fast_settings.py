"""The fast settings' `auto` on a GPU, run for real: each kind of training run starts, says what `auto` picked, and
trains two steps with it (compiled layers and scores, packed micro-batches where they serve; off where `on` would be
refused). Each run is `qarl train|distill` in a process of its own (one vLLM engine a process), on the embedded
models. The decisions themselves are tested on CPU (tests/unit/test_fast_settings.py). Skipped without a GPU."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

SHORT = ["trainer.steps=2", "warm_start.steps=5", "eval.every=0", "checkpoint.every=1000", "policy.dtype=bfloat16",
         "policy.generation.enforce_eager=true", "trainer.cuda_graphs=auto"]  # (graphs' default: off)
ON = "compile_layers on (auto), compile_scores on (auto), micro-batches of"
GRAPHS = "cuda_graphs on (auto)"
CASES = {  # command, recipe, overrides, what the start-up line says (the first three settings, then the graphs)
    "QA-GRPO W4A16": ("train", "recipes/qa_grpo_tiny.yaml", [], ON, GRAPHS),
    "fp16": ("train", "recipes/qa_grpo_tiny.yaml", ["policy.dtype=float16"], ON,
             "cuda_graphs off (auto: policy.dtype=float16)"),
    "KL reference": ("train", "recipes/qa_grpo_tiny.yaml", ["trainer.beta=0.04"], ON, GRAPHS),
    "qlora": ("train", "recipes/qlora_grpo_tiny.yaml", [],
              "compile_layers off (auto: policy.lora.mode=qlora), compile_scores on (auto), micro-batches of",
              "cuda_graphs off (auto: policy.lora.mode=qlora)"),
    "QAD": ("distill", "recipes/qa_distillation_tiny.yaml", ["teacher.dtype=bfloat16"],
            "compile_layers on (auto), compile_scores off (auto: QAD's KL is not compiled), micro-batches of",
            "cuda_graphs off (auto: QAD's update is not captured)"),
    "exact forward": ("train", "recipes/qa_grpo_tiny.yaml",
                      ["policy.model_name=embedded:20m", "policy.exact_forward=true",
                       "policy.quant_cfg=quant_configs/nvfp4_w4a4.yaml"],
                      "compile_layers off (auto: policy.exact_forward), compile_scores off (auto: "
                      "policy.exact_forward), micro-batches by rows (auto: policy.exact_forward)",
                      "cuda_graphs off (auto: micro-batches by rows: policy.exact_forward)"),
    "exact forward, a token budget": ("train", "recipes/qa_grpo_tiny.yaml",
                                      ["policy.model_name=embedded:realistic-qwen3", "policy.exact_forward=true",
                                       "policy.quant_cfg=quant_configs/nvfp4_w4a4.yaml",
                                       "trainer.max_tokens_per_micro_batch=2048"],
                                      "micro-batches of 2048 tokens (set)", GRAPHS),
    "exact forward, head size 64": ("train", "recipes/qa_grpo_tiny.yaml",  # FlashAttention 3 decodes it otherwise
                                    ["policy.model_name=embedded:20m", "policy.exact_forward=true",
                                     "policy.quant_cfg=quant_configs/nvfp4_w4a4.yaml",
                                     "trainer.max_tokens_per_micro_batch=2048"],
                                    "micro-batches of 2048 tokens (set)",
                                    "cuda_graphs off (auto: the engine decodes this attention shape with other tiles "
                                    "than it prefills)"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_auto_picks_and_the_run_trains(case, tmp_path):
    command, recipe, overrides, said, graphs = CASES[case]
    run_dir = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "qarl.cli", command, recipe, f"run.dir={run_dir}", *SHORT,
                             *overrides], cwd=REPO, capture_output=True, text=True, timeout=900)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    line = next(x for x in output.splitlines() if x.startswith("fast settings: "))
    assert said in line and line.endswith(graphs), line
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    key = "loss" if command == "train" else "distill/kl"
    losses = [r[key] for r in rows if key in r]
    assert len(losses) == 2 and all(abs(v) < 1e6 for v in losses), losses
    captures = [r.get("train/cuda_graph_captures") for r in rows if key in r]  # the key only where graphs ran
    assert all(c >= 1 for c in captures) if graphs == GRAPHS else captures == [None, None], captures
    if case == "KL reference":  # the reference is the policy built again, compiled as the policy: ~no KL at step 0
        assert abs(rows[0]["kl/ref"]) < 1e-4, rows[0]["kl/ref"]  # (scored in eval mode, the policy in train mode)
