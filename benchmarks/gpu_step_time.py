"""Policy-side cost of fake quantization on a GPU, per format, in one process.

    python benchmarks/gpu_step_time.py [--model embedded:0.5b] [--out FILE.md] [--no-cache]

For the unquantized policy and each shipped format (NVFP4 W4A16, NVFP4 W4A4, FP8 W8A8), on the same
model (default: the embedded Qwen2.5-0.5B-shaped model, random weights), bf16 compute with fp32 master
weights (qarl's default mixed precision), it times with CUDA synchronisation, medians:
  * `qarl.train.policy_update` on 64 completions of 64 prompt + 448 completion tokens, micro-batch 8
    (forward + backward of every micro-batch, the optimizer step, the master -> bf16 copy);
  * a no-grad scoring pass over 8 completions (what old / reference log-probs and evaluation cost);
  * the refit fold right after an optimizer step: every weight as the engine receives it, copied into
    preallocated buffers, against a plain copy of the raw weights into the same buffers;
and reports the peak GPU memory of the update and what the weight cache holds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _timed(fn, repeat: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(fmt_name: str, model: str, cache: bool) -> dict[str, float]:
    from qarl.config import RecipeConfig, load_recipe
    from qarl.generation import Completion
    from qarl.optim import PolicyOptimizer
    from qarl.policy import build_policy, resolve_model_dir, score_completions
    from qarl.quant import folded_weights
    from qarl.quant.weight_cache import cache_bytes
    from qarl.tasks import build_task
    from qarl.train import Rollout, policy_update

    cfg = load_recipe("recipes/qa_grpo_tiny.yaml", [
        f"policy.model_name={model}", "policy.dtype=bfloat16", f"policy.quant_cfg={fmt_name}",
        f"policy.quant_weight_cache={str(cache).lower()}", "trainer.batch_size=64", "trainer.num_generations=8",
        "trainer.micro_batch_size=8", "policy.generation.max_new_tokens=448"], RecipeConfig)
    task = build_task(cfg.task, 0)
    torch.manual_seed(0)
    policy = build_policy(cfg.policy, task.calibration_texts(64), model_dir=resolve_model_dir(model), trainable=True)
    optimizer = PolicyOptimizer(policy, 1e-6, 0.0, 1.0)
    vocab = len(policy.tokenizer)
    gen = torch.Generator().manual_seed(0)
    completions = [Completion(torch.randint(2, vocab, (64,), generator=gen).tolist(),
                              torch.randint(2, vocab, (448,), generator=gen).tolist(), [-1.0] * 448, "length")
                   for _ in range(64)]
    batch = Rollout(problems=[], completions=completions, texts=[], seconds=1.0)
    advantages = torch.randn(64, generator=gen)
    update = _timed(lambda: policy_update(policy, None, optimizer, batch, advantages, cfg), repeat=5)
    torch.cuda.reset_peak_memory_stats()
    policy_update(policy, None, optimizer, batch, advantages, cfg)
    peak = torch.cuda.max_memory_allocated()
    rows = completions[:8]
    pad = policy.tokenizer.pad_token_id

    def scoring() -> None:
        with torch.no_grad():
            score_completions(policy.model, [c.prompt_ids for c in rows], [c.token_ids for c in rows], pad)

    score = _timed(scoring, repeat=10)
    buffers = {n: torch.empty_like(p) for n, p in policy.model.named_parameters()}

    def step_then(fn):  # an optimizer step first, so the fold has to quantize again
        def run() -> None:
            for p in optimizer.params:
                p.grad = torch.zeros_like(p)
            optimizer.step()
            torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            run.seconds.append(time.perf_counter() - start)
        run.seconds = []
        return run

    fold = step_then(lambda: [buffers[n].copy_(t) for n, t in folded_weights(policy.model)])
    plain = step_then(lambda: [buffers[n].copy_(p) for n, p in policy.model.named_parameters()])
    for _ in range(12):
        fold()
        plain()
    return {"update_s": update, "score_s": score, "fold_s": statistics.median(fold.seconds[2:]),
            "copy_s": statistics.median(plain.seconds[2:]), "peak_gib": peak / 2**30,
            "cache_gib": cache_bytes(policy.model) / 2**30}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="embedded:0.5b")
    parser.add_argument("--out", default=None, help="also write the table to this markdown file")
    parser.add_argument("--no-cache", action="store_true", help="ModelOpt's path: quantize at every forward")
    args = parser.parse_args()
    formats = {"unquantized": "none", "NVFP4 W4A16": "nvfp4_a16", "NVFP4 W4A4": "nvfp4_w4a4", "FP8 W8A8": "fp8_w8a8"}
    results = {label: measure(name, args.model, not args.no_cache) for label, name in formats.items()}
    base = results["unquantized"]
    lines = [f"model {args.model}, bf16 compute + fp32 master weights, weight cache {'off' if args.no_cache else 'on'}, "
             f"{torch.cuda.get_device_name()}", "",
             "| format | policy_update | vs unquantized | no-grad scoring (8) | vs unquantized | refit fold | "
             "fold / plain copy | peak memory | weight cache |", "|---|---|---|---|---|---|---|---|---|"]
    for label, r in results.items():
        lines.append(f"| {label} | {r['update_s'] * 1e3:.0f} ms | {r['update_s'] / base['update_s']:.2f} | "
                     f"{r['score_s'] * 1e3:.1f} ms | {r['score_s'] / base['score_s']:.2f} | {r['fold_s'] * 1e3:.2f} ms | "
                     f"{r['fold_s'] / r['copy_s']:.2f} | {r['peak_gib']:.2f} GiB | {r['cache_gib']:.2f} GiB |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
