"""What each chunk of the linear head's scoring costs: the fp32 functions `LinearHeadScores` runs per chunk of logits,
eager and compiled as it compiles them (`qarl.scoring.compiled_once`), one at a time.

    python benchmarks/score_kernels.py [--rows 512] [--vocab 151936] [--batch-invariant] [--out FILE]

The functions: `token_scores` (the default path's forward: picked log-prob and entropy), `picked_logits_grad` (its
backward: the log-softmax again, then the gradient; also the exact forward's first form, with the entropy alone from a
log-softmax, `log_softmax_entropy` here), `entropy_and_logsumexp` (the exact forward's forward: entropy and
log-normalizer, the picked log-prob being the engine's kernel's) and `picked_grad_from_logsumexp` (its backward, from
that normalizer). Each on one chunk of bf16 logits ([rows, vocabulary], the default chunk of 512 rows at the
Qwen3-1.7B shape's vocabulary), the GPU time a call (CUDA events over back-to-back calls, median of rounds), and that
time in units of one copy of the chunk into fp32 (a bf16 read and an fp32 write at the device's bandwidth), so a
kernel far from that floor stands out. `--batch-invariant` first puts the process in vLLM's batch-invariant mode,
as the exact forward does (its aten overrides reach the eager functions). On CPU it runs too, as a smoke check (wall
time).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch


def timed_ms(fn, args: tuple, calls: int = 10, rounds: int = 5) -> float:
    """Median over `rounds` of the mean time of `calls` back-to-back calls, after a warm-up (compilation)."""
    fn(*args)
    cuda = args[0].is_cuda
    times = []
    for _ in range(rounds):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            began = time.perf_counter()
        for _ in range(calls):
            fn(*args)
        if cuda:
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / calls)
        else:
            times.append((time.perf_counter() - began) * 1e3 / calls)
    return statistics.median(times)


def log_softmax_entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The entropy as the exact forward's scoring first computed it (-sum p log p from a log-softmax; one of its two
    compiled kernels took 3.7 ms a chunk on an H200, benchmarks/results/gpu/exact_scoring/), for comparison."""
    from qarl.scoring import log_softmax_fp32

    with torch.no_grad():
        log_probs = log_softmax_fp32(logits, temperature)
        return -(log_probs.exp() * log_probs).sum(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=512, help="rows of a chunk (policy.logprob_chunk_tokens)")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--batch-invariant", action="store_true", help="in vLLM's batch-invariant mode (GPU)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.batch_invariant:
        from qarl.generation import exact

        exact.enable_batch_invariance()
    from qarl.scoring import (compiled_once, entropy_and_logsumexp, picked_grad_from_logsumexp, picked_logits_grad,
                              token_scores)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=device).manual_seed(0)
    logits = (torch.randn(args.rows, args.vocab, device=device, generator=g) * 3).bfloat16()
    targets = torch.randint(0, args.vocab, (args.rows,), device=device, generator=g)
    grad_picked = torch.randn(args.rows, device=device, generator=g)
    logsumexp = torch.logsumexp(logits.float(), dim=-1)
    cases = {"token_scores": (token_scores, (logits, targets, 1.0)),
             "picked_logits_grad": (picked_logits_grad, (logits, targets, grad_picked, 1.0)),
             "log_softmax_entropy (the first form)": (log_softmax_entropy, (logits, 1.0)),
             "entropy_and_logsumexp": (entropy_and_logsumexp, (logits, 1.0)),
             "picked_grad_from_logsumexp": (picked_grad_from_logsumexp, (logits, targets, grad_picked, logsumexp, 1.0))}
    pass_ms = float("nan")
    if device == "cuda":  # the floor's unit: the chunk read in bf16 and written in fp32, a copy at full bandwidth
        buffer = torch.empty(args.rows, args.vocab, device=device)
        pass_ms = timed_ms(lambda b: b.copy_(logits), (buffer,))
    mode = "vLLM's batch-invariant mode" if args.batch_invariant else "default mode"
    lines = [f"one chunk of [{args.rows}, {args.vocab}] bf16 logits, {device} "
             f"({torch.cuda.get_device_name() if device == 'cuda' else 'wall time'}), {mode}; ms a call, median of 5 "
             f"rounds of 10; a copy of the chunk into fp32: {pass_ms:.3f} ms", "",
             "| function | eager ms | compiled ms | compiled / copy |", "|---|---|---|---|"]
    for name, (fn, call_args) in cases.items():
        eager, compiled = timed_ms(fn, call_args), timed_ms(compiled_once(fn), call_args)
        lines.append(f"| {name} | {eager:.3f} | {compiled:.3f} | {compiled / pass_ms:.1f} |")
        print(lines[-1], flush=True)
    print("", *lines, sep="\n")
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
