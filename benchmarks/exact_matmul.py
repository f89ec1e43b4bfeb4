"""Which matmul could the exact forward run: is a row's result the same in a batch of any size, what does a call cost?

    python benchmarks/exact_matmul.py [--shape qwen3-1.7b] [--out FILE]

The exact forward (`policy.exact_forward`) multiplies every linear layer, on the engine's side and the policy's, with
`F.linear` in vLLM's batch-invariant mode, which on Hopper runs cuBLASLt without split-K (a 1 KiB workspace). A kernel
can serve it only if a row of its product has the same bits at every batch size the engine and the policy run (decode
steps of 1-512 rows, prefills and packed micro-batches of thousands). This script checks that, per kernel and per
linear-layer shape of a model, on random bf16 data: each batch's rows against the same rows in the largest batch, bit
for bit. The candidates: cuBLASLt as vLLM's mode sets it, cuBLAS (not Lt) with any bias added after the product,
under the workspace settings a run ends up with (torch refuses it in this mode: split-K off needs cuBLASLt; its row
says so), and vLLM's persistent Triton matmul (its mode's kernel on Ampere).
Then each kernel's cost at a decode step's batch and at a micro-batch's, two ways: GPU time, from a CUDA graph of
back-to-back calls (what the engine's decode steps replay), and host time, the wall time of one eager launch (what
the policy's eager forward and backward pay per matmul; a kernel shorter than that leaves the GPU waiting). Run it on
the GPU machine (it puts its process in vLLM's batch-invariant mode).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
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
    """The candidates, by name (vLLM's kernel read from vLLM itself: the subject of this benchmark, vLLM 0.26). The
    cuBLAS library is a process-wide preference, set before each call."""
    from vllm.model_executor.layers.batch_invariant import linear_batch_invariant

    def on(library: str, bias_after: bool = False):
        def kernel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            torch.backends.cuda.preferred_blas_library(library)
            if bias_after and bias is not None:
                return F.linear(x, weight) + bias
            return F.linear(x, weight, bias)
        return kernel

    # torch sends a matmul with a bias of more than one row to cuBLASLt whatever the preference (its fused bias),
    # and a one-row one to the preferred library: cuBLAS is tried with its bias added after the product
    return {"cuBLASLt, no split-K (vLLM's mode)": on("cublaslt"), "cuBLAS, no split-K, bias added after": on(
        "cublas", bias_after=True), "vLLM persistent Triton": linear_batch_invariant}


def invariant(kernel, weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> list[int]:
    """The batch sizes whose rows differ from the same rows of the largest batch. On a stream of its own, as the
    engine captures its graphs: torch gives each stream its own cuBLAS workspace, sized when first used."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        full = kernel(x, weight, bias)
        differ = [rows for rows in BATCHES if not torch.equal(kernel(x[:rows].clone(), weight, bias), full[:rows])]
    torch.cuda.current_stream().wait_stream(stream)
    return differ


def gpu_ms(kernel, weight: torch.Tensor, x: torch.Tensor, calls: int = 20, repeats: int = 5) -> float:
    """GPU time a call: `calls` back-to-back calls captured in one CUDA graph, replayed `repeats` times (median),
    so no host launch is timed."""
    for _ in range(3):  # heuristics and autotuning before the capture
        kernel(x, weight, None)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(calls):
                kernel(x, weight, None)
    except RuntimeError as error:  # a kernel the engine could not put in its decode graphs: said in the table
        print(f"  not capturable in a CUDA graph: {error}", flush=True)
        return float("nan")
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def host_us(kernel, weight: torch.Tensor, x: torch.Tensor, calls: int = 20, repeats: int = 5) -> float:
    """Host time a call launched eagerly: the wall time of `calls` launches, not waiting for the GPU (its queue
    holds them), median of `repeats`."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            kernel(x, weight, None)
        times.append((time.perf_counter() - start) / calls * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen3-1.7b", choices=sorted(SHAPES))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    from qarl.generation import exact

    # twice, as a run enters it (qarl, then the engine's worker): the second time vLLM sets CUBLAS_WORKSPACE_CONFIG
    # to ":4096:8" and leaves it, cuBLAS's (not Lt's) workspace from then on
    exact.enable_batch_invariance()
    exact.enable_batch_invariance()
    g = torch.Generator(device="cuda").manual_seed(0)
    lines = [f"{args.shape}, bf16, {torch.cuda.get_device_name()}: rows of batches {', '.join(map(str, BATCHES))} "
             f"against the same rows of {LARGEST}; GPU ms a call (a CUDA graph of 20, median of 5 replays) and host µs "
             f"a call (20 eager launches, median of 5) at 256 rows (a decode step) and {LARGEST}", "",
             f"| layer [out, in] | kernel | batches whose rows differ (no bias / bias) | GPU ms at 256 | GPU ms at "
             f"{LARGEST} | host µs at 256 | host µs at {LARGEST} |",
             "|---|---|---|---|---|---|---|"]
    candidates = kernels()
    for name, (out, inp) in layer_shapes(SHAPES[args.shape]).items():
        weight = (torch.randn(out, inp, device="cuda", generator=g) * inp ** -0.5).bfloat16()
        bias = torch.randn(out, device="cuda", generator=g).bfloat16()
        x = torch.randn(LARGEST, inp, device="cuda", generator=g).bfloat16()
        for label, kernel in candidates.items():
            try:
                differ = [", ".join(map(str, invariant(kernel, weight, b, x))) or "none" for b in (None, bias)]
            except RuntimeError as error:  # a kernel torch will not run in this mode: the row says why
                lines.append(f"| {name} [{out}, {inp}] | {label} | refused: {error} | | | | |")
                print(lines[-1], flush=True)
                continue
            decode = x[:256].clone()
            lines.append(f"| {name} [{out}, {inp}] | {label} | {' / '.join(differ)} | "
                         f"{gpu_ms(kernel, weight, decode):.3f} | {gpu_ms(kernel, weight, x):.3f} | "
                         f"{host_us(kernel, weight, decode):.0f} | {host_us(kernel, weight, x):.0f} |")
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
