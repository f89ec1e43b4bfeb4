"""Rollout throughput on a GPU: plain vLLM against qarl's engine in every shipped format, one process.

    python benchmarks/gpu_rollout.py [--model embedded:0.5b] [--batches 64 512] [--tokens 256] [--eager] [--out F.md]

Every engine serves the same model (default: the embedded Qwen2.5-0.5B-shaped model, random weights,
bf16) and samples `--tokens` tokens per completion whatever it draws (EOS ignored), from 16-token
prompts, at temperature 1. Plain vLLM runs with its defaults (CUDA graphs and compilation); qarl's
engine runs as a training run would use it: refitted from a ModelOpt-quantized policy of each format
(folded weights and amax), sampling through `VLLMEngine.generate` (per-sample seeds, log-probs).
`--eager` runs qarl's engines with `enforce_eager` for comparison. Tokens/s are generated tokens over
the wall time of one `generate` call, median of `--repeats` after a warm-up call.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

FORMATS = ["none", "nvfp4_a16", "nvfp4_w4a4", "fp8_w8a8"]


def _tokens_per_s(generate, tokens: int, repeats: int) -> float:
    generate()  # warm-up (first-call allocations, graph replays of new sizes)
    times = []
    for _ in range(repeats):
        _sync()
        start = time.perf_counter()
        generated = generate()
        _sync()
        times.append(time.perf_counter() - start)
        assert generated == tokens, (generated, tokens)
    return tokens / statistics.median(times)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _prompts(batch: int, vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(batch)
    return torch.randint(3, vocab, (batch, 16), generator=generator).tolist()


def plain_vllm(model_dir: str, dtype: str, batches: list[int], tokens: int, repeats: int) -> dict[int, float]:
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype=dtype, seed=0, max_model_len=512, gpu_memory_utilization=0.3)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=1.0, detokenize=False)
    result = {}
    for batch in batches:
        requests = [{"prompt_token_ids": p} for p in _prompts(batch, vocab)]
        result[batch] = _tokens_per_s(
            lambda: sum(len(o.outputs[0].token_ids) for o in llm.generate(requests, params, use_tqdm=False)),
            batch * tokens, repeats)
    llm.llm_engine.engine_core.shutdown()
    return result


def qarl_engine(fmt_name: str, model_dir: str, dtype: str, batches: list[int], tokens: int, repeats: int,
                eager: bool) -> dict[int, float]:
    from qarl.config import GenerationConfig, PolicyConfig
    from qarl.generation import VLLMEngine
    from qarl.policy import build_policy
    from qarl.tasks import ArithmeticTask

    torch.manual_seed(0)
    policy = build_policy(PolicyConfig(model_name=model_dir, dtype=dtype, quant_cfg=fmt_name, quant_calib_size=64),
                          ArithmeticTask(num_train=400, num_eval=32, seed=0).calibration_texts(64), model_dir=model_dir)
    settings = GenerationConfig(max_new_tokens=tokens, max_model_len=512, gpu_memory_utilization=0.3,
                                enforce_eager="true" if eager else "auto", sleep_between_rollouts="off")
    engine = VLLMEngine(model_dir, settings, dtype, 0, quant_format=policy.format)
    engine.refit(policy.model)
    vocab = len(policy.tokenizer)
    result = {}
    for batch in batches:
        prompts = _prompts(batch, vocab)
        result[batch] = _tokens_per_s(
            lambda: sum(len(c.token_ids) for c in engine.generate(prompts, max_new_tokens=tokens, ignore_eos=True)),
            batch * tokens, repeats)
    engine.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="embedded:0.5b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--formats", nargs="+", default=FORMATS)
    parser.add_argument("--eager", action="store_true", help="qarl's engines with enforce_eager")
    parser.add_argument("--no-plain", action="store_true", help="skip plain vLLM")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from qarl.policy import resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    rows = {}
    if not args.no_plain:
        rows["plain vLLM (graphs + compile)"] = plain_vllm(model_dir, args.dtype, args.batches, args.tokens, args.repeats)
        print(rows, flush=True)
        gc.collect()
    for fmt in args.formats:
        name = f"qarl {fmt}" + (" (eager)" if args.eager else "")
        rows[name] = qarl_engine(fmt, model_dir, args.dtype, args.batches, args.tokens, args.repeats, args.eager)
        print(name, rows[name], flush=True)
        gc.collect()  # the engine's and the policy's memory, before the next one starts

    plain = rows.get("plain vLLM (graphs + compile)")
    unquantized = next((r for n, r in rows.items() if n.startswith("qarl none")), None)
    head = " | ".join(f"batch {b} tok/s | vs plain | vs qarl unquantized" for b in args.batches)
    lines = [f"{args.model}, {args.dtype}, {args.tokens} tokens per completion (EOS ignored), "
             f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU'}; `python benchmarks/gpu_rollout.py {' '.join(_argv())}`", "",
             f"| engine | {head} |", "|---|" + "---|---|---|" * len(args.batches)]
    for name, r in rows.items():
        cells = []
        for b in args.batches:
            vs_plain = f"{r[b] / plain[b]:.2f}" if plain else "-"
            vs_unq = f"{r[b] / unquantized[b]:.2f}" if unquantized and name.startswith("qarl") else "-"
            cells.append(f"{r[b]:.0f} | {vs_plain} | {vs_unq}")
        lines.append(f"| {name} | {' | '.join(cells)} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")


def _argv() -> list[str]:
    import sys

    return sys.argv[1:]


if __name__ == "__main__":
    main()
