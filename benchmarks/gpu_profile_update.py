"""Where a quantized policy update spends its time and memory on a GPU, against the unquantized one.

    python benchmarks/gpu_profile_update.py [--formats none nvfp4_a16] [--model embedded:0.5b]

One micro-batch of 8 completions (64 + 448 tokens), bf16 compute with fp32 master weights: memory
allocated after the forward, after the backward and after the optimizer step, and the torch profiler's
top operators by self CPU time and by CUDA time for one forward + backward.
"""

from __future__ import annotations

import argparse

import torch


def profile(fmt_name: str, model: str) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from qarl.config import PolicyConfig
    from qarl.optim import PolicyOptimizer
    from qarl.policy import build_policy, resolve_model_dir, score_completions
    from qarl.tasks import ArithmeticTask

    cfg = PolicyConfig(model_name=model, dtype="bfloat16", quant_cfg=fmt_name)
    torch.manual_seed(0)
    policy = build_policy(cfg, ArithmeticTask(num_train=64, num_eval=8).calibration_texts(64),
                          model_dir=resolve_model_dir(model), trainable=True)
    optimizer = PolicyOptimizer(policy, 1e-6, 0.0, 1.0)
    gen = torch.Generator().manual_seed(0)
    vocab = len(policy.tokenizer)
    prompts = [torch.randint(2, vocab, (64,), generator=gen).tolist() for _ in range(8)]
    comps = [torch.randint(2, vocab, (448,), generator=gen).tolist() for _ in range(8)]
    pad = policy.tokenizer.pad_token_id

    def step(report: bool = False) -> None:
        gib = lambda: f"{torch.cuda.memory_allocated() / 2**30:.2f} GiB"  # noqa: E731
        scores = score_completions(policy.model, prompts, comps, pad)
        after_forward = gib()
        optimizer.backward(-(scores.logprobs.sum()) / 1e4)
        del scores
        after_backward = gib()
        optimizer.step()
        if report:
            print(f"{fmt_name}: allocated after forward {after_forward}, after backward {after_backward}, "
                  f"after step {gib()}, peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step(report=True)
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    table = prof.key_averages()
    print(table.table(sort_by="self_cpu_time_total", row_limit=15))
    print(table.table(sort_by="cuda_time_total", row_limit=12))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", nargs="+", default=["none", "nvfp4_a16"])
    parser.add_argument("--model", default="embedded:0.5b")
    args = parser.parse_args()
    for fmt in args.formats:
        profile(fmt, args.model)


if __name__ == "__main__":
    main()
