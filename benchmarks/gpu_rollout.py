"""Rollout throughput on a GPU: plain vLLM against qarl's engine in every shipped format, one process.

    python benchmarks/gpu_rollout.py [--model embedded:0.5b] [--batches 64 512] [--tokens 256] [--eager] [--out F.md]
    python benchmarks/gpu_rollout.py --no-plain --formats nvfp4_w4a4 --exact     # the exact forward's engine
    python benchmarks/gpu_rollout.py --model DIR --formats nvfp4_a16 nvfp4_a16_kv_fp8 --plain-kv-cache fp8 \
        --prompt-tokens 16128 --tokens 256 --batches 16 32                       # an FP8 KV cache at 16k tokens

Every engine serves the same model (default: the embedded Qwen2.5-0.5B-shaped model, random weights,
bf16) and samples `--tokens` tokens per completion whatever it draws (EOS ignored), from 16-token
prompts, at temperature 1. Plain vLLM runs with its defaults (CUDA graphs and compilation) and is asked
what qarl asks of every sample, the sampled token's log-prob and a seed per sample (`--plain-bare`: neither);
qarl's engine runs as a training run would use it: refitted from a ModelOpt-quantized policy of each format
(folded weights and amax), sampling through `VLLMEngine.generate` (per-sample seeds, log-probs).
`--eager` runs qarl's engines with `enforce_eager` for comparison. `--exact` runs them as the exact forward's
engines (`policy.exact_forward`: vLLM's batch-invariant mode, process-wide, so a plain vLLM beside them would run
it too: time them with `--no-plain`, plain vLLM in a process of its own). `--request-options` adds the unquantized
qarl engine driven through vLLM's own `generate` with and without what qarl asks of every sample (the
sampled token's log-prob, a seed per sample), to tell what those cost.

All engines are started first and then timed in interleaved rounds (engine A, B, C, ..., then again), so
that what the host machine does meanwhile hits them alike: one `generate` call per engine and batch size
per round, tokens/s = generated tokens / its wall time, median over `--repeats` rounds after a warm-up round.
`--prompt-tokens N` times decoding after N-token prompts (the cost of a long context: each step reads the
whole cache), and the table gives each engine's KV cache in tokens (as vLLM sized it in its share) and how many
sequences of prompt + completion it holds at once; `--plain-kv-cache fp8` adds plain vLLM with its FP8 cache. A
format with an FP8 KV cache (`nvfp4_a16_kv_fp8`, `fp8_w8a8_kv_fp8`) runs qarl's engine with
`allow_quant_mismatch` on a GPU (vLLM's FP8-cache kernels round the queries too: docs/guides/kv-cache.md).
Some models cannot share a process between engines (vLLM 0.26, the qwen3-moe-2b shape: the second engine's CUDA
graphs fail with "CUDA graph capturing detected at an inappropriate time"); time those one engine per process
(`--formats` with no format: plain vLLM alone; `--no-plain --formats F`: one qarl engine).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

FORMATS = ["none", "nvfp4_a16", "nvfp4_w4a4", "fp8_w8a8"]
PLAIN = "plain vLLM (graphs + compile)"
MEMORY_PER_ENGINE = 0.12  # of the GPU: five engines side by side


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@dataclass
class Engine:
    """One engine to time: generate(batch) -> generated tokens, and the tokens its KV cache holds."""

    generate: Callable[[int], int]
    kv_cache_tokens: int


def _prompts(batch: int, vocab: int, length: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(batch)
    return torch.randint(3, vocab, (batch, length), generator=generator).tolist()


def _max_model_len(tokens: int, prompt_tokens: int) -> int:
    return max(512, prompt_tokens + tokens)  # a prompt and its completion


def plain_vllm(model_dir: str, dtype: str, tokens: int, memory: float, bare: bool = False, prompt_tokens: int = 16,
               kv_cache_dtype: str = "auto") -> Engine:
    """vLLM with its own defaults, asked for each sampled token's log-prob with a seed per sample as qarl asks
    (`bare`: neither)."""
    from vllm import LLM, SamplingParams

    from qarl.generation import vllm_compat

    llm = LLM(model=model_dir, dtype=dtype, seed=0, max_model_len=_max_model_len(tokens, prompt_tokens),
              gpu_memory_utilization=memory, kv_cache_dtype=kv_cache_dtype)
    vocab = len(llm.get_tokenizer())

    def generate(batch: int) -> int:
        params = [SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=1.0, detokenize=False,
                                 logprobs=None if bare else 0, seed=None if bare else i) for i in range(batch)]
        requests = [{"prompt_token_ids": p} for p in _prompts(batch, vocab, prompt_tokens)]
        return sum(len(o.outputs[0].token_ids) for o in llm.generate(requests, params, use_tqdm=False))

    return Engine(generate, vllm_compat.kv_cache_tokens(llm))


def qarl_engine(fmt_name: str, model_dir: str, dtype: str, tokens: int, eager: bool, memory: float,
                request_options: bool = False, qlora: bool = False, packed: bool = False, adapters: bool = True,
                exact: bool = False, prompt_tokens: int = 16) -> dict[str, Engine]:
    """{name: Engine} of qarl's engine refitted from a policy in `fmt_name`;
    `request_options`: also vLLM's own generate on that engine, with each combination of log-probs and seeds;
    `qlora`: the policy has rank-16 qlora adapters (vLLM's LoRA serves them); `packed`: the engine serves the
    qlora base packed (vLLM's 4-bit kernel, qarl/generation/packed_base.py); `adapters=False` (with `packed`): the same
    packed engine without vLLM's LoRA, serving the base as it loaded it (no refit); `exact`: the exact forward's
    engine, refitted from a policy built with it."""
    import tempfile
    from pathlib import Path

    from qarl.config import GenerationConfig, LoraConfig, PolicyConfig
    from qarl.generation import VLLMEngine, vllm_compat
    from qarl.policy import build_policy
    from qarl.quant.formats import quantizes_kv_cache
    from qarl.run import write_packed_base
    from qarl.tasks import ArithmeticTask

    torch.manual_seed(0)
    lora = LoraConfig(mode="qlora" if qlora else "none")
    # the policy only refits the engine: no wider master copy (but fp16's, which cannot train), so that it leaves the
    # engines started after it room
    masters = "float32" if dtype == "float16" else dtype
    policy = build_policy(PolicyConfig(model_name=model_dir, dtype=dtype, master_dtype=masters, quant_cfg=fmt_name,
                                       quant_calib_size=64, lora=lora, exact_forward=exact),
                          ArithmeticTask(num_train=400, num_eval=32, seed=0).calibration_texts(64), model_dir=model_dir)
    settings = GenerationConfig(max_new_tokens=tokens, max_model_len=_max_model_len(tokens, prompt_tokens),
                                gpu_memory_utilization=memory, enforce_eager="true" if eager else "auto",
                                sleep_between_rollouts="off",
                                allow_quant_mismatch=quantizes_kv_cache(policy.format) and torch.cuda.is_available())
    base = write_packed_base(policy, Path(tempfile.mkdtemp(prefix="qarl-base-")) / "base") if packed else None
    if not adapters and not packed:
        raise SystemExit("--no-adapters measures the packed engine without LoRA: pass --qlora --packed-base (a folded "
                         "engine without adapters is the format's engine without --qlora)")
    engine = VLLMEngine(model_dir, settings, dtype, 0, quant_format=policy.format,
                        adapter_rank=lora.rank if qlora and adapters else 0, exact=exact, packed_base=base)
    if adapters:
        engine.refit(policy.model)
    vocab = len(policy.tokenizer)

    kv_tokens = vllm_compat.kv_cache_tokens(engine.llm)

    def generate(batch: int) -> int:
        completions = engine.generate(_prompts(batch, vocab, prompt_tokens), max_new_tokens=tokens, ignore_eos=True)
        return sum(len(c.token_ids) for c in completions)

    name = (f"qarl {fmt_name}" + (" qlora" if qlora and adapters else "") + (" packed base" if packed else "")
            + (" exact forward" if exact else "") + (" (eager)" if eager else ""))
    runners = {name: Engine(generate, kv_tokens)}
    if request_options:
        from vllm import SamplingParams

        def vllm_generate(logprobs: int | None, seeded: bool) -> Callable[[int], int]:
            def run(batch: int) -> int:
                params = [SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=1.0, detokenize=False,
                                         logprobs=logprobs, seed=i if seeded else None) for i in range(batch)]
                requests = [{"prompt_token_ids": p} for p in _prompts(batch, vocab, prompt_tokens)]
                outputs = engine.llm.generate(requests, params, use_tqdm=False)
                return sum(len(o.outputs[0].token_ids) for o in outputs)
            return run

        for logprobs, seeded in [(0, True), (0, False), (None, True), (None, False)]:
            label = f"{'log-probs' if logprobs is not None else 'no log-probs'}, {'seeds' if seeded else 'no seeds'}"
            runners[f"{name}, vLLM generate: {label}"] = Engine(vllm_generate(logprobs, seeded), kv_tokens)
    return runners


def interleaved(engines: dict[str, Engine], batches: list[int], tokens: int,
                repeats: int) -> dict[str, dict[int, float]]:
    """Median tokens/s per engine and batch over `repeats` rounds, each round visiting every engine."""
    times: dict[str, dict[int, list[float]]] = {name: {b: [] for b in batches} for name in engines}
    for round_ in range(repeats + 1):  # round 0 warms up
        for batch in batches:
            for name, engine in engines.items():
                _sync()
                start = time.perf_counter()
                generated = engine.generate(batch)
                _sync()
                assert generated == batch * tokens, (name, generated)
                if round_:
                    times[name][batch].append(time.perf_counter() - start)
    return {name: {b: b * tokens / statistics.median(t[b]) for b in batches} for name, t in times.items()}


def table(rows: dict[str, dict[int, float]], engines: dict[str, Engine], batches: list[int], sequence: int,
          header: str) -> str:
    plain = next((r for n, r in rows.items() if n.startswith(PLAIN)), None)
    unquantized = next((r for n, r in rows.items() if n.startswith("qarl none")), None)
    head = " | ".join(f"batch {b} tok/s | vs plain | vs qarl unquantized" for b in batches)
    lines = [header, "", f"| engine | KV cache tokens | sequences of {sequence} tokens it holds | {head} |",
             "|---|---|---|" + "---|---|---|" * len(batches)]
    for name, r in rows.items():
        cells = []
        for b in batches:
            vs_plain = f"{r[b] / plain[b]:.2f}" if plain else "-"
            vs_unquantized = f"{r[b] / unquantized[b]:.2f}" if unquantized and name.startswith("qarl") else "-"
            cells.append(f"{r[b]:.0f} | {vs_plain} | {vs_unquantized}")
        kv = engines[name].kv_cache_tokens
        lines.append(f"| {name} | {kv:,} | {kv // sequence:,} | {' | '.join(cells)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="embedded:0.5b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=16, help="each prompt's length (a long context: 16128)")
    parser.add_argument("--plain-kv-cache", choices=["fp8"], default=None,
                        help="also plain vLLM with its FP8 KV cache (kv_cache_dtype=fp8)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--formats", nargs="*", default=FORMATS, help="qarl's engines (none: plain vLLM only)")
    parser.add_argument("--eager", action="store_true", help="qarl's engines with enforce_eager")
    parser.add_argument("--exact", action="store_true", help="qarl's engines as the exact forward's (with --no-plain)")
    parser.add_argument("--no-plain", action="store_true", help="skip plain vLLM")
    parser.add_argument("--plain-bare", action="store_true", help="plain vLLM asked for no log-probs and no seeds")
    parser.add_argument("--request-options", action="store_true",
                        help="also the unquantized engine through vLLM's generate, with / without log-probs and seeds")
    parser.add_argument("--qlora", action="store_true", help="qarl's engines serve rank-16 qlora adapters")
    parser.add_argument("--packed-base", action="store_true", help="with --qlora: the engines serve the base packed")
    parser.add_argument("--no-adapters", action="store_true",
                        help="with --qlora --packed-base: the packed engine without vLLM's LoRA (the base only)")
    parser.add_argument("--memory", type=float, default=MEMORY_PER_ENGINE, help="each engine's share of the GPU")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from qarl.models.resolve import resolve_model_dir

    if args.exact and not args.no_plain:
        parser.error("--exact turns on vLLM's batch-invariant mode for the whole process: add --no-plain and time "
                     "plain vLLM in a process of its own")
    model_dir = resolve_model_dir(args.model)
    plain = PLAIN + (", bare" if args.plain_bare else ", log-probs + seeds")
    engines = {} if args.no_plain else {plain: plain_vllm(model_dir, args.dtype, args.tokens, args.memory,
                                                           args.plain_bare, args.prompt_tokens)}
    if args.plain_kv_cache and not args.no_plain:
        engines[f"{plain}, FP8 KV cache"] = plain_vllm(model_dir, args.dtype, args.tokens, args.memory,
                                                       args.plain_bare, args.prompt_tokens, args.plain_kv_cache)
    for fmt in args.formats:
        engines.update(qarl_engine(fmt, model_dir, args.dtype, args.tokens, args.eager, args.memory,
                                   request_options=args.request_options and fmt == "none", qlora=args.qlora,
                                   packed=args.packed_base, adapters=not args.no_adapters, exact=args.exact,
                                   prompt_tokens=args.prompt_tokens))
    rows = interleaved(engines, args.batches, args.tokens, args.repeats)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    result = table(rows, engines, args.batches, args.prompt_tokens + args.tokens,
                   f"{args.model}, {args.dtype}, {args.prompt_tokens}-token prompts, {args.tokens} tokens per "
                   f"completion (EOS ignored), {device}, {'engines interleaved, ' if len(engines) > 1 else ''}median "
                   f"of {args.repeats} rounds; "
                   f"`python benchmarks/gpu_rollout.py {' '.join(sys.argv[1:])}`")
    print(result)
    if args.out:
        with open(args.out, "w") as f:
            f.write(result + "\n")


if __name__ == "__main__":
    main()
