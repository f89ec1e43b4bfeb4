"""What scoring through the linear head costs: `LinearHeadScores`, eager and with its chunks' fp32 work compiled
(`policy.compile_scores`), against the head called chunk by chunk under checkpoint (the path of a head that is not a
plain linear map), one micro-batch's forward + backward.

    python benchmarks/head_scoring.py --model DIR [--rows 8 --prompt-tokens 100 --completion-tokens 1024] [--repeats 3]
        [--quant-cfg quant_configs/nvfp4_a16.yaml]

A user's vocabulary on CPU: `python benchmarks/user_shape.py make runs/qwen2_2l_151k --shape qwen2-2l-151k` (2 x 128,
151,936 tokens), where the head is most of the work; on a GPU the Qwen3-1.7B shape (`--shape qwen3-1.7b`). The two
paths alternate, the median of `--repeats` timed rounds after a warm-up round, each path's peak memory (the GPU's
allocator; on CPU not measured), whether the eager paths' log-probs are the same bits, and how far the compiled
path's are from them.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a model directory")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--completion-tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default=None, help="policy.dtype (default: bfloat16 on a GPU, float32 on CPU)")
    parser.add_argument("--quant-cfg", default="none", help="policy.quant_cfg (calibrated on the embedded prompts)")
    args = parser.parse_args()

    from qarl.config import PolicyConfig
    from qarl.policy import build_policy
    from qarl.quant import linear_weight
    from qarl.scoring import FUSED_SCORES, score_completions
    from qarl.tasks import ArithmeticTask

    cuda = torch.cuda.is_available()
    cfg = PolicyConfig(model_name=args.model, dtype=args.dtype or ("bfloat16" if cuda else "float32"),
                       quant_cfg=args.quant_cfg)
    policy = build_policy(cfg, ArithmeticTask(num_train=64, num_eval=8).calibration_texts(64), model_dir=args.model,
                          trainable=True)
    head = policy.model.get_output_embeddings()
    assert linear_weight(head) is not None, "this model's head is not a plain linear map"
    gen = torch.Generator().manual_seed(0)
    vocab = policy.model.config.vocab_size
    prompts = [torch.randint(2, vocab, (args.prompt_tokens,), generator=gen).tolist() for _ in range(args.rows)]
    completions = [torch.randint(2, vocab, (args.completion_tokens,), generator=gen).tolist() for _ in range(args.rows)]
    pad = policy.tokenizer.pad_token_id

    def once(path: str) -> tuple[float, float, torch.Tensor]:
        hook = head.register_forward_hook(lambda module, inputs, output: None) if path == "generic" else None
        setattr(head, FUSED_SCORES, path == "compiled")
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        scores = score_completions(policy.model, prompts, completions, pad, temperature=1.0)
        scores.logprobs.sum().backward()
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
        if hook is not None:
            hook.remove()
        policy.model.zero_grad(set_to_none=True)
        return seconds, peak, scores.logprobs.detach()

    timings: dict[str, list[float]] = {"generic": [], "linear": [], "compiled": []}
    peaks: dict[str, float] = {}
    logprobs: dict[str, torch.Tensor] = {}
    for round_ in range(args.repeats + 1):
        for path in timings:
            seconds, peaks[path], logprobs[path] = once(path)
            if round_ > 0:  # the first round warms up
                timings[path].append(seconds)
    tokens = args.rows * (args.prompt_tokens + args.completion_tokens)
    print(f"{args.model}: {args.rows} x ({args.prompt_tokens} + {args.completion_tokens}) tokens, vocabulary {vocab}, "
          f"{cfg.dtype}, {'GPU' if cuda else 'CPU'}; forward + backward of one micro-batch, median of {args.repeats}")
    medians = {path: statistics.median(values) for path, values in timings.items()}
    for path, median in medians.items():
        print(f"  {path:8s} {median:8.3f} s  {tokens / median:9.0f} tokens/s  peak {peaks[path]:.2f} GiB")
    print(f"  linear / generic speed: {medians['generic'] / medians['linear']:.2f}x; log-probs the same bits: "
          f"{torch.equal(logprobs['generic'], logprobs['linear'])}")
    print(f"  compiled / linear speed: {medians['linear'] / medians['compiled']:.2f}x; log-probs max |difference| "
          f"{(logprobs['compiled'] - logprobs['linear']).abs().max().item():.2e}")


if __name__ == "__main__":
    main()
