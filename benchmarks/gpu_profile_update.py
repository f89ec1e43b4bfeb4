"""Where a quantized policy update spends its time and memory on a GPU, against the unquantized one.

    python benchmarks/gpu_profile_update.py [--formats none nvfp4_a16] [--model embedded:0.5b] [--score] [--lora qlora]
        [--rows 8 --prompt-tokens 64 --completion-tokens 448] [--compile norms mlp layers scores] [--pack]

One micro-batch (by default 8 completions of 64 + 448 tokens; a user's shape: `--model runs/qwen3_1p7b_shape --rows 8
--prompt-tokens 100 --completion-tokens 1024`), bf16 compute with fp32 master weights: memory
allocated after the forward, after the backward and after the optimizer step, and the torch profiler's
top operators by self CPU time and by CUDA time for one forward + backward and the optimizer step.
`--score`: the profile of one no-grad scoring pass over the same micro-batch instead (what old and
reference log-probs cost), with its wall time, the GPU's busy time in it and the host's Python functions by
own time (cProfile).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from collections.abc import Callable

import torch


def host_functions(fn: Callable[[], object], top: int) -> str:
    """The `top` Python functions by own time in one call of `fn` (cProfile, which inflates them), a line each."""
    profiler = cProfile.Profile()
    profiler.runcall(fn)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return "\n".join(line for line in text.getvalue().splitlines()[6:] if line.strip())


def profile(fmt_name: str, model: str, score: bool, lora: str = "none", rows: int = 8, prompt_tokens: int = 64,
            completion_tokens: int = 448, compiled: tuple[str, ...] = (), pack: bool = False) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from qarl.config import LoraConfig, PolicyConfig
    from qarl.optim import PolicyOptimizer
    from qarl.models.resolve import resolve_model_dir
    from qarl.policy import build_policy
    from qarl.scoring import score_completions
    from qarl.tasks import ArithmeticTask

    cfg = PolicyConfig(model_name=model, dtype="bfloat16", quant_cfg=fmt_name, lora=LoraConfig(mode=lora),
                       compile_norms="norms" in compiled, compile_mlp="mlp" in compiled,
                       compile_layers="layers" in compiled, compile_scores="scores" in compiled)
    torch.manual_seed(0)
    policy = build_policy(cfg, ArithmeticTask(num_train=64, num_eval=8).calibration_texts(64),
                          model_dir=resolve_model_dir(model), trainable=True)
    optimizer = PolicyOptimizer(policy, 1e-6, 0.0, 1.0)
    gen = torch.Generator().manual_seed(0)
    vocab = len(policy.tokenizer)
    prompts = [torch.randint(2, vocab, (prompt_tokens,), generator=gen).tolist() for _ in range(rows)]
    comps = [torch.randint(2, vocab, (completion_tokens,), generator=gen).tolist() for _ in range(rows)]
    pad = policy.tokenizer.pad_token_id

    def step(report: bool = False) -> None:
        gib = lambda: f"{torch.cuda.memory_allocated() / 2**30:.2f} GiB"  # noqa: E731
        scores = score_completions(policy.model, prompts, comps, pad, pack=pack)
        after_forward = gib()
        optimizer.backward(-(scores.logprobs.sum()) / 1e4)
        del scores
        after_backward = gib()
        optimizer.step()
        if report:
            print(f"{fmt_name}: allocated after forward {after_forward}, after backward {after_backward}, "
                  f"after step {gib()}, peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")

    def scoring() -> None:
        with torch.no_grad():
            score_completions(policy.model, prompts, comps, pad, pack=pack)

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    step(report=True)
    torch.cuda.synchronize()
    print(f"{fmt_name} lora={lora}: one update (forward + backward + step) {(time.perf_counter() - start) * 1e3:.1f} ms")
    if score:
        for _ in range(3):
            scoring()
        torch.cuda.synchronize()
        start = time.perf_counter()
        scoring()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        scoring() if score else step()
        torch.cuda.synchronize()
    table = prof.key_averages()
    if score:
        busy = sum(e.self_device_time_total for e in table) / 1e3
        print(f"{fmt_name}: scoring pass {wall * 1e3:.1f} ms wall, GPU busy {busy:.1f} ms (profiled run)")
        print(host_functions(scoring, top=25))
    print(table.table(sort_by="self_cpu_time_total", row_limit=25))
    print(table.table(sort_by="self_cuda_time_total", row_limit=25))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", nargs="+", default=["none", "nvfp4_a16"])
    parser.add_argument("--model", default="embedded:0.5b")
    parser.add_argument("--score", action="store_true", help="profile a no-grad scoring pass instead of the update")
    parser.add_argument("--lora", default="none", choices=["none", "qlora", "merged"], help="policy.lora.mode")
    parser.add_argument("--rows", type=int, default=8, help="completions in the micro-batch")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--completion-tokens", type=int, default=448)
    parser.add_argument("--compile", nargs="*", default=[], choices=["norms", "mlp", "layers", "scores"],
                        help="policy.compile_norms / compile_mlp / compile_layers / compile_scores")
    parser.add_argument("--pack", action="store_true",
                        help="the rows packed into one without padding (trainer.max_tokens_per_micro_batch > 0)")
    args = parser.parse_args()
    for fmt in args.formats:
        profile(fmt, args.model, args.score, args.lora, args.rows, args.prompt_tokens, args.completion_tokens,
                tuple(args.compile), args.pack)


if __name__ == "__main__":
    main()
