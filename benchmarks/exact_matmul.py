"""Which matmul could the exact forward run: is a row's result the same in a batch of any size, and how fast is it?

    python benchmarks/exact_matmul.py [--shape qwen3-1.7b] [--out FILE]

The exact forward (`policy.exact_forward`) multiplies every linear layer, on the engine's side and the policy's, with
vLLM's batch-invariant persistent Triton matmul, which vLLM's own linear layers run in its batch-invariant mode. On
Hopper, vLLM's mode also runs cuBLAS without split-K (a 1 KiB cuBLASLt workspace), which vLLM takes to be
batch-invariant there. If a row of cuBLAS's product had the same bits at every batch size the
engine and the policy run (decode steps of 1-512 rows, prefills and packed micro-batches of thousands), both sides
could use it. This script checks that, per kernel and per linear-layer shape of a model, on random bf16 data: each
batch's rows against the same rows in the largest batch, bit for bit; then times each kernel at a decode step's
batch and at a micro-batch's. Run it on the GPU machine (it puts its process in vLLM's batch-invariant mode).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from user_shape import SHAPES, VOCAB  # noqa: E402

BATCHES = (1, 3, 8, 17, 64, 200, 256, 512, 2048)  # rows; each checked against the same rows of the largest batch
LARGEST = 8264  # a packed micro-batch of the Qwen3-1.7B recipe


def layer_shapes(shape: dict) -> dict[str, tuple[int, int]]:
    """[out, in] of each distinct linear layer of a decoder as the exact forward runs it (q/k/v and gate/up fused)."""
    hidden, heads, kv = shape["hidden_size"], shape["num_attention_heads"], shape["num_key_value_heads"]
    head = shape.get("head_dim") or hidden // heads
    inter, vocab = shape["intermediate_size"], shape.get("vocab_size", VOCAB)
    return {"qkv": ((heads + 2 * kv) * head, hidden), "o": (hidden, heads * head), "gate_up": (2 * inter, hidden),
            "down": (hidden, inter), "head": (vocab, hidden)}


def kernels() -> dict:
    """The candidates, by name (vLLM's kernel read from vLLM itself: the subject of this benchmark, vLLM 0.26)."""
    from vllm.model_executor.layers.batch_invariant import linear_batch_invariant

    return {"vLLM persistent Triton": linear_batch_invariant, "cuBLAS, no split-K": F.linear}


def invariant(kernel, weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> list[int]:
    """The batch sizes whose rows differ from the same rows of the largest batch."""
    full = kernel(x, weight, bias)
    return [rows for rows in BATCHES if not torch.equal(kernel(x[:rows].clone(), weight, bias), full[:rows])]


def median_ms(kernel, weight: torch.Tensor, x: torch.Tensor, calls: int = 20, repeats: int = 5) -> float:
    """Median over `repeats` of the mean GPU time of `calls` back-to-back calls (launches queue ahead of the GPU, as
    in a model's forward)."""
    for _ in range(3):
        kernel(x, weight, None)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            kernel(x, weight, None)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen3-1.7b", choices=sorted(SHAPES))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    from qarl.generation import exact

    exact.enable_batch_invariance()
    g = torch.Generator(device="cuda").manual_seed(0)
    lines = [f"{args.shape}, bf16, {torch.cuda.get_device_name()}: rows of batches {', '.join(map(str, BATCHES))} "
             f"against the same rows of {LARGEST}; ms a call (20 back to back, median of 5) at 256 rows (a decode "
             f"step) and {LARGEST}", "",
             f"| layer [out, in] | kernel | batches whose rows differ (no bias / bias) | ms at 256 | ms at {LARGEST} |",
             "|---|---|---|---|---|"]
    for name, (out, inp) in layer_shapes(SHAPES[args.shape]).items():
        weight = (torch.randn(out, inp, device="cuda", generator=g) * inp ** -0.5).bfloat16()
        bias = torch.randn(out, device="cuda", generator=g).bfloat16()
        x = torch.randn(LARGEST, inp, device="cuda", generator=g).bfloat16()
        for label, kernel in kernels().items():
            differ = [", ".join(map(str, invariant(kernel, weight, b, x))) or "none" for b in (None, bias)]
            lines.append(f"| {name} [{out}, {inp}] | {label} | {' / '.join(differ)} | "
                         f"{median_ms(kernel, weight, x[:256].clone()):.3f} | {median_ms(kernel, weight, x):.3f} |")
        print(lines[-2], lines[-1], sep="\n", flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
