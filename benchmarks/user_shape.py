"""A user's model at a user's length, made locally: real shapes with random weights and the embedded tokenizer (the
model samples ids the tokenizer decodes to ''; fine for memory and speed).

    python benchmarks/user_shape.py make DIR --shape qwen3-1.7b     # 28 x 2048, vocabulary 151,936 (bf16, on a GPU)
    python benchmarks/user_shape.py make DIR --shape qwen3-8b       # 36 x 4096, vocabulary 151,936, untied head
    python benchmarks/user_shape.py make DIR --shape qwen3-8b-128k  # the same, YaRN to 131,072 positions
    python benchmarks/user_shape.py make DIR --shape llama3.2-1b     # 16 x 2048, vocabulary 128,256, Llama 3's scaled RoPE
    python benchmarks/user_shape.py make DIR --shape qwen2-2l-151k   # 2 x 128, vocabulary 151,936 (CPU-sized)
    python benchmarks/user_shape.py make DIR --shape qwen3-moe-2b    # Qwen3-30B-A3B's layers, 12 of them, 32 experts
    python benchmarks/user_shape.py make DIR --shape qwen3-30b-a3b-32l  # 32 of its 48 layers, all 128 experts
    python benchmarks/user_shape.py make DIR --shape mistral-7b-8l   # (also gemma3-1b, phi3-mini-8l: SHAPES)
    python benchmarks/user_shape.py report RUN_DIR [RUN_DIR ...]    # train-phase tokens/s, MFU, memory vs the plan
    python benchmarks/user_shape.py table RUN_DIR [RUN_DIR ...]     # the same as one markdown table, steps vs the first

`benchmarks/gpu_runs.sh user_shape` (and `user_shape_long`, `user_shape_qad`) run the shipped recipe on the
Qwen3-1.7B shape with `benchmarks/recipes/user_shape_*.yaml`. `spread` is their reward: random models never answer
right, and a reward without spread trains nothing (every advantage is 0).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

SHAPES = {
    # Qwen3-1.7B's layers: 28 x hidden 2048, MLP 6144, 16 / 8 heads of 128, q/k norms, tied embeddings
    "qwen3-1.7b": dict(family="qwen3", hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128),
    # Qwen3-8B's layers: 36 x hidden 4096, MLP 12288, 32 / 8 heads of 128, q/k norms, an untied head
    "qwen3-8b": dict(family="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
    # Llama-3.2-1B's layers: 16 x hidden 2048, MLP 8192, 32 / 8 heads of 64, Llama 3's scaled rotary embedding,
    # tied embeddings, its 128,256-token vocabulary
    "llama3.2-1b": dict(family="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                        num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128_256,
                        max_position_embeddings=131_072,
                        rope_parameters={"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 32.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 8192}),
    # a user's directory small enough for the CPU machine, with the real vocabulary
    "qwen2-2l-151k": dict(family="qwen2", hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2),
    # Qwen3-30B-A3B's layers (hidden 2048, 32 / 4 heads of 128, experts of width 768, 8 a token, an untied head),
    # 12 layers of 32 experts instead of 48 of 128: ~2.4B parameters
    "qwen3-moe-2b": dict(family="qwen3_moe", hidden_size=2048, intermediate_size=6144, num_hidden_layers=12,
                         num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=32,
                         num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True, decoder_sparse_step=1,
                         mlp_only_layers=[], tie_word_embeddings=False),
    # Qwen3-30B-A3B's layers with all 128 experts, 32 of its 48 layers (~20.5B parameters: its bf16 checkpoint, 41 GB,
    # leaves room on the GPU machine's 64 GiB disk for the kit and the run; all 48 layers' 61 GB would not)
    "qwen3-30b-a3b-32l": dict(family="qwen3_moe", hidden_size=2048, intermediate_size=6144, num_hidden_layers=32,
                              num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                              num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                              decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False),
    # Mistral-7B v0.3's layers (hidden 4096, MLP 14336, 32 / 8 heads of 128, no sliding window, its 32,768-token
    # vocabulary, an untied head), 8 of its 32 layers
    "mistral-7b-8l": dict(family="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=8,
                          num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=32_768,
                          sliding_window=None, tie_word_embeddings=False),
    # Gemma-3-1B's text layers: 26 x hidden 1152, MLP 6912, 4 / 1 heads of 256, five sliding layers (window 512) to
    # one global, scaled embeddings, its 262,144-token vocabulary
    "gemma3-1b": dict(family="gemma3_text", hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                      num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
                      sliding_window=512, vocab_size=262_144, max_position_embeddings=32_768,
                      rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                       "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
    # Phi-3-mini's layers (hidden 3072, MLP 8192, 32 heads of 96, q/k/v and gate/up fused in the checkpoint, its
    # 32,064-token vocabulary, an untied head), 8 of its 32 layers
    "phi3-mini-8l": dict(family="phi3", hidden_size=3072, intermediate_size=8192, num_hidden_layers=8,
                         num_attention_heads=32, num_key_value_heads=32, vocab_size=32_064, max_position_embeddings=4096,
                         tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
}
# Qwen3-8B with Qwen3's YaRN scaling to 131,072 positions (its long-context setting), for the longest completion
SHAPES["qwen3-8b-128k"] = dict(SHAPES["qwen3-8b"], max_position_embeddings=131_072,
                               rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                                "original_max_position_embeddings": 32_768})

VOCAB = 151_936
H100_BF16_DENSE_FLOPS = 989e12

_draws = [0]


def spread(completions: list[str], answers: list[str]) -> list[float]:
    """A reward with spread for models that never answer right: uniform in [0, 1), a function of the call count."""
    _draws[0] += 1
    rng = random.Random(_draws[0])
    return [rng.random() for _ in completions]


def make(out: Path, shape: str) -> Path:
    """A model directory of `shape`, random weights (seed 0) in bf16, with the embedded tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from qarl.models.tiny import build_tokenizer

    if (out / "config.json").is_file():
        return out
    spec = dict(SHAPES[shape])
    family = spec.pop("family")
    tokenizer = build_tokenizer()
    spec.setdefault("tie_word_embeddings", True)
    spec.setdefault("vocab_size", VOCAB)
    spec.setdefault("max_position_embeddings", 40_960)
    spec.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 1e6})
    config = AutoConfig.for_model(family, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                  pad_token_id=tokenizer.pad_token_id, **spec)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)
    print(f"{out}: {sum(p.numel() for p in model.parameters()) / 1e9:.3f}B parameters")
    return out


def report(run_dir: Path) -> dict[str, float]:
    """Medians over a run's steps after the first (which warms up allocators and graphs); {} if none finished."""
    from qarl.memory import ModelShape

    config = (run_dir / "config.yaml").read_text()
    model_dir = next(line.split(":", 1)[1].strip() for line in config.splitlines() if line.strip().startswith("model_name:"))
    params = ModelShape.of(model_dir).params
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if "perf/step_s" in line]
    if not rows:
        return {}
    steady = rows[1:] or rows
    med = lambda key: statistics.median(r[key] for r in steady if r.get(key) is not None)  # noqa: E731
    out = {"steps": len(rows), "step_s": med("perf/step_s"), "rollout_s": med("perf/rollout_s"),
           "train_s": med("perf/train_s"), "rollout_tokens_per_s": med("perf/rollout_tokens_per_s"),
           "train_tokens_per_s": med("perf/train_tokens_per_s"), "completion_mean_length": med("completion/mean_length")}
    out["train_mfu"] = 6 * params * out["train_tokens_per_s"] / H100_BF16_DENSE_FLOPS
    for key in ("memory/update_peak_gib", "memory/planned_update_gib", "perf/torch_peak_update_gib",
                "memory/device_peak_rollout_gib", "memory/device_peak_update_gib", "perf/gpu_mem_after_rollout_gib",
                "perf/gpu_mem_after_update_gib", "mismatch/kl"):
        if any(key in r for r in steady):
            out[key] = max(r[key] for r in steady if key in r) if "gib" in key else med(key)
    return out


def table(runs: list[Path]) -> str:
    """The runs side by side (the fast settings' table, gpu_runs.sh fast_table): step, rollout and train throughput,
    MFU and mismatch, each step time also as a ratio to the first run's."""
    found = {run.name: report(run) for run in runs}
    first = next((r["step_s"] for r in found.values() if r), None)
    lines = ["| run | steps | step s | vs first | rollout tok/s | train tok/s | train MFU | mismatch/kl |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in found.items():
        if not r:
            lines.append(f"| {name} | no step finished (its log says why) | | | | | | |")
            continue
        lines.append(f"| {name} | {r['steps']} | {r['step_s']:.1f} | {r['step_s'] / first:.2f}x | "
                     f"{r['rollout_tokens_per_s']:,.0f} | {r['train_tokens_per_s']:,.0f} | {100 * r['train_mfu']:.0f} % | "
                     f"{r.get('mismatch/kl', float('nan')):.3g} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    made = sub.add_parser("make")
    made.add_argument("out", type=Path)
    made.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-1.7b")
    for command in ("report", "table"):
        sub.add_parser(command).add_argument("runs", type=Path, nargs="+")
    args = parser.parse_args()
    if args.command == "make":
        make(args.out, args.shape)
    elif args.command == "table":
        print(table(args.runs))
    else:
        for run in args.runs:
            found = report(run)
            print(run.name, json.dumps({k: round(v, 4) for k, v in found.items()}) if found
                  else "no step finished (the run's log says why)")


if __name__ == "__main__":
    main()
