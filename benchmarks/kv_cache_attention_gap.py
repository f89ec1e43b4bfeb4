"""Where the default mode's FP8-cache mismatch comes from: the policy's attention against vLLM's FP8 attention, on CPU.

    python benchmarks/kv_cache_attention_gap.py [--model pypi:smollm2] [--out benchmarks/results/kv_cache_attention_gap.md]

With an FP8 KV cache, vLLM's GPU attention (FlashAttention 3; Triton too) rounds the queries to FP8 at the scale 1
and FlashAttention 3 also multiplies the softmax probabilities with the values in FP8. The policy's fake quant rounds
only the keys and values. This emulates each rounding on its own, in fp32 on the CPU (E4M3 casts as the GPU makes
them, products in fp32), so that their shares of the gap can be read apart: whether rounding the queries in the
policy too would close it. Completions are sampled from the policy (keys and values in FP8, amax calibrated per layer
on the prompts), then scored by each variant; KL(policy || variant) per completion token.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

E4M3_MAX = 448.0
# Each variant: (name, round the queries, scale the probabilities by before rounding them; None: not rounded).
VARIANTS = [
    ("queries in FP8 (scale 1)", True, None),
    ("probabilities in FP8", False, 1.0),
    ("probabilities in FP8, times 2^8 first", False, 256.0),
    ("queries and probabilities (times 2^8) in FP8", True, 256.0),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="pypi:smollm2")
    parser.add_argument("--data", default="recipes/data/smollm2_mix/test.jsonl")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--out", default="benchmarks/results/kv_cache_attention_gap.md")
    args = parser.parse_args()

    import torch
    from transformers import AttentionInterface, AutoModelForCausalLM

    from qarl.config import TaskConfig
    from qarl.models.resolve import resolve_model_dir
    from qarl.tasks.chat import model_prompt_format

    torch.manual_seed(0)
    fp8 = torch.float8_e4m3fn
    state = {"calibrate": False, "queries": False, "probs": None}
    amax: dict[int, list[float]] = {}

    def fake_quant(x: torch.Tensor, a: float) -> torch.Tensor:  # ModelOpt's per-tensor E4M3 fake quant
        scale = E4M3_MAX / a
        return (x * scale).clamp(-E4M3_MAX, E4M3_MAX).to(fp8).to(x.dtype) / scale

    def attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        layer = module.layer_idx
        if state["calibrate"]:
            seen = amax.setdefault(layer, [0.0, 0.0])
            seen[0], seen[1] = max(seen[0], key.abs().max().item()), max(seen[1], value.abs().max().item())
        else:
            key, value = fake_quant(key, amax[layer][0]), fake_quant(value, amax[layer][1])
        if state["queries"]:
            query = query.clamp(-E4M3_MAX, E4M3_MAX).to(fp8).to(query.dtype)
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        scores = query @ key.transpose(-1, -2) * scaling
        if attention_mask is not None:
            scores = scores + attention_mask[:, :, :, : key.shape[-2]]
        probs = torch.exp(scores - scores.amax(-1, keepdim=True))
        total = probs.sum(-1, keepdim=True)  # the row sum of the unrounded probabilities
        if state["probs"] is not None:
            probs = (probs * state["probs"]).to(fp8).to(probs.dtype) / state["probs"]
        return ((probs @ value) / total).transpose(1, 2).contiguous(), None

    AttentionInterface.register("qarl_fp8_emulation", attention)
    model_dir = resolve_model_dir(args.model)
    ask = model_prompt_format(model_dir, TaskConfig())  # its chat template, no system turn
    tokenizer = ask.tokenizer
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="qarl_fp8_emulation").eval()
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines()[: args.prompts]]
    prompts = [ask.text(r["question"]) for r in rows]
    batch = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    with torch.no_grad():
        state["calibrate"] = True
        model(**batch)
        state["calibrate"] = False
        sequences = model.generate(**batch, do_sample=True, temperature=1.0, max_new_tokens=args.tokens,
                                   pad_token_id=tokenizer.pad_token_id)
    start = batch["input_ids"].shape[1]
    completion = sequences[:, start:]
    counted = torch.ones_like(completion, dtype=torch.bool)
    for i, row in enumerate(completion):  # up to and with the first end of turn
        ends = (row == tokenizer.eos_token_id).nonzero()
        if len(ends):
            counted[i, ends[0, 0] + 1:] = False
    mask = torch.cat([batch["attention_mask"], counted.long()], dim=1)

    def log_probs() -> torch.Tensor:
        with torch.no_grad():
            return model(input_ids=sequences, attention_mask=mask).logits[:, start - 1: -1].log_softmax(-1)

    state["queries"], state["probs"] = False, None
    policy = log_probs()
    sampled = completion.unsqueeze(-1)
    lines = [f"`python benchmarks/kv_cache_attention_gap.py --model {args.model}`: {args.prompts} prompts, "
             f"{int(counted.sum())} sampled completion tokens, fp32 on CPU; the policy rounds keys and values to FP8 "
             "(per-tensor amax, calibrated on the prompts).", "",
             "| engine's attention, beside the policy's | KL(policy \\|\\| it) per token | mean \\|Δ log-prob\\| | "
             "max \\|Δ log-prob\\| |", "|---|---|---|---|"]
    for name, queries, probs in VARIANTS:
        state["queries"], state["probs"] = queries, probs
        variant = log_probs()
        kl = (policy.exp() * (policy - variant)).sum(-1)[counted]
        delta = (variant.gather(-1, sampled) - policy.gather(-1, sampled)).squeeze(-1).abs()[counted]
        lines.append(f"| {name} | {kl.mean():.2e} | {delta.mean():.2e} | {delta.max():.2e} |")
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
