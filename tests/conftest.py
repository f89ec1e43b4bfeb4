"""Shared fixtures and helpers of every tier (tests/unit, tests/integration, tests/e2e). vLLM engines are expensive
(~30 s to start and warm up on 2 cores), so one engine on the embedded tiny model serves every test that needs one;
each test sets its format and refits. The training loops' end-to-end runs are made once a session (`loop_runs`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qarl.config import GenerationConfig, LoraConfig, PolicyConfig
from qarl.models.resolve import resolve_model_dir
from qarl.policy import build_policy
from qarl.scoring import score_completions
from qarl.tasks import ArithmeticTask
from tests.loops import Runs

REPO = Path(__file__).resolve().parents[1]  # the repository's root

FORMATS = ["quant_configs/nvfp4_a16.yaml", "quant_configs/nvfp4_w4a4.yaml", "quant_configs/fp8_w8a8.yaml"]


@pytest.fixture(scope="session")
def task() -> ArithmeticTask:
    return ArithmeticTask(num_train=400, num_eval=32, seed=0)


@pytest.fixture(scope="session")
def tiny_dir() -> str:
    return resolve_model_dir("embedded:tiny")


def tiny_policy(task, tiny_dir: str, quant_cfg: str = "none", calib_size: int = 32, trainable: bool = False,
                **overrides):
    """A freshly loaded, quantized and calibrated tiny policy (`trainable`: with master weights, as the
    training loops build it); `overrides` are PolicyConfig fields."""
    cfg = PolicyConfig(quant_cfg=quant_cfg, quant_calib_size=calib_size, **overrides)
    torch.manual_seed(0)
    return build_policy(cfg, task.calibration_texts(calib_size), model_dir=tiny_dir, trainable=trainable)


def answer_loss(policy, task, scale: float = 1.0) -> torch.Tensor:
    """-(sum of the log-probs of 8 training answers) * scale: a real loss through the policy's forward."""
    tok = policy.tokenizer
    prompts = [tok(p.prompt).input_ids for p in task.train[:8]]
    answers = [tok(p.answer).input_ids for p in task.train[:8]]
    return -score_completions(policy.model, prompts, answers, tok.pad_token_id).logprobs.sum() * scale


W4A16 = "quant_configs/nvfp4_a16.yaml"


def lora_policy(task, tiny_dir, mode: str, quant_cfg: str = W4A16, random_b: bool = True, **lora):
    """A trainable tiny policy with LoRA adapters (`mode`: qlora or merged); `random_b`: B drawn at random, not 0 as
    at init, so the adapters matter."""
    from qarl.lora import lora_layers

    policy = tiny_policy(task, tiny_dir, quant_cfg, trainable=True, lora=LoraConfig(mode=mode, **lora))
    if random_b:
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for _, layer in lora_layers(policy.model):
                layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=generator) * 0.05)
    return policy


def eval_logits(policy, task) -> torch.Tensor:
    """The policy's logits on 4 held-out prompts, padded to one batch."""
    ids = policy.tokenizer([p.prompt for p in task.eval[:4]], return_tensors="pt", padding=True).to(policy.device)
    with torch.no_grad():
        return policy.model(**ids).logits


def small_model(tmp_path: Path, family: str) -> str:
    """A random 2-layer Llama (untied head) or Qwen3 (q/k norms, head_dim != hidden / heads), saved as safetensors."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)
    config = (LlamaConfig(**common, tie_word_embeddings=False) if family == "llama"
              else Qwen3Config(**common, head_dim=32, tie_word_embeddings=False))
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # norms away from 1, so a norm in the wrong place shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    out = tmp_path / family
    model.save_pretrained(out, safe_serialization=True)
    return str(out)


@pytest.fixture(scope="module")
def families(tmp_path_factory, tiny_dir) -> dict[str, str]:
    """Model directories of the three families the Megatron converter knows: Qwen2 (the tiny model), Llama, Qwen3."""
    tmp = tmp_path_factory.mktemp("families")
    return {"qwen2": tiny_dir, "llama": small_model(tmp, "llama"), "qwen3": small_model(tmp, "qwen3")}


@pytest.fixture(scope="session")
def loop_runs(tmp_path_factory) -> Runs:
    """Each training loop's end-to-end runs (tests/loops.py), made on first use, once a session."""
    return Runs(tmp_path_factory.mktemp)


@pytest.fixture(scope="session")
def make_policy(task, tiny_dir):
    """make_policy(quant_cfg) -> a freshly loaded, quantized and calibrated policy (fp32)."""

    def make(quant_cfg: str = "none", **overrides):
        return tiny_policy(task, tiny_dir, quant_cfg, **overrides)

    return make


@pytest.fixture(scope="session")
def engine(tiny_dir):
    from qarl.generation import VLLMEngine

    return VLLMEngine(tiny_dir, GenerationConfig(max_new_tokens=16, kv_cache_gib=1), dtype="float32", seed=0)


def _sampling(i: int, logprobs: int | None, stop: list[int], greedy: bool):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=3 + i % 14, temperature=0.0 if greedy else 1.0, seed=None if greedy else i,
                          logprobs=logprobs, flat_logprobs=True, detokenize=False, stop_token_ids=stop)


def qarl_parity(model_name: str, num_prompts: int, max_new_tokens: int) -> dict:
    """`qarl parity recipes/parity_tiny.yaml` (fp32, every shipped format) on `model_name` in a process of its own (its
    engine never meets this session's), its JSON report per format."""
    import json
    import subprocess
    import sys

    parity = subprocess.run([sys.executable, "-m", "qarl", "parity", "recipes/parity_tiny.yaml",
                             f"policy.model_name={model_name}", f"parity.num_prompts={num_prompts}",
                             f"parity.max_new_tokens={max_new_tokens}", "--json"],
                            check=True, capture_output=True, text=True)
    return json.loads(parity.stdout[parity.stdout.index("{"):])


def check_kept_logprobs(engine, policy) -> None:
    """The log-probs `engine` keeps at vLLM's sampler (generation/sampled_logprobs.py) equal, bit for bit, what vLLM
    returns when asked, and line up with the tokens when requests finish at different steps (their own max_tokens,
    stop tokens drawn at random) and when prompts are prefilled over several steps (rows vLLM discards; greedy
    there; seeded split prefills: tests/integration/test_engine_split_prefill.py). Samples given to the wrong request are refused."""
    engine.set_quant_format(policy.format)
    engine.refit(policy.model)
    assert engine._sampled is not None, "the engine keeps the log-probs at the sampler of this vLLM's model runner"
    vocab = len(policy.tokenizer)
    budget = engine.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    generator = torch.Generator().manual_seed(0)
    stop = list(range(3, vocab, 9))  # a ninth of the vocabulary ends a completion
    for length, count, greedy in [(20, 48, False), (200, budget // 200 + 4, True)]:
        prompts = torch.randint(3, vocab, (count, length), generator=generator).tolist()
        requests = [{"prompt_token_ids": p} for p in prompts]
        asked = engine.llm.generate(requests, [_sampling(i, 0, stop, greedy) for i in range(count)], use_tqdm=False)
        engine.llm.reset_prefix_cache()  # the prompts are prefilled again, split as the first time
        with engine._sampled.recording():
            kept = engine.llm.generate(requests, [_sampling(i, None, stop, greedy) for i in range(count)], use_tqdm=False)
        split = any(step.kept is not None and not step.kept.all() for step in engine._sampled._taken)
        assert split == greedy, "the long prompts (only) are prefilled over several steps"
        logprobs = engine._sampled.logprobs(kept)
        assert {out.outputs[0].finish_reason for out in kept} == {"stop", "length"}
        for a, k, lp in zip(asked, kept, logprobs):
            assert k.outputs[0].logprobs is None  # vLLM carried nothing
            assert list(k.outputs[0].token_ids) == list(a.outputs[0].token_ids)
            assert lp == list(a.outputs[0].logprobs.logprobs)

    first = [{"prompt_token_ids": p} for p in torch.randint(3, vocab, (48, 20), generator=generator).tolist()]
    with engine._sampled.recording():
        kept = engine.llm.generate(first, [_sampling(i, None, stop, False) for i in range(48)], use_tqdm=False)
    step = engine._sampled._taken[0]
    step.req_ids = step.req_ids[1:] + step.req_ids[:1]  # each first token given to another request: refused
    with pytest.raises(RuntimeError, match="do not line up"):
        engine._sampled.logprobs(kept)
