"""What one more kernel at each linear layer's input costs a launch-bound forward, by how it is launched.

    python benchmarks/gpu_launch_cost.py [--rounds 12] [--out FILE.md]

A Qwen2.5-0.5B-shaped Qwen2 (random weights, bf16, SDPA) scores 8 sequences of 512 tokens without
gradients: on an H100 host that forward waits on its host (its GPU work is about a third of its wall
time), like qarl's scoring passes. A forward pre-hook on q_proj, o_proj, gate_proj and down_proj of
every layer (96 calls a forward, where the activation formats quantize) runs one of:
  * nothing (no hook) and a hook returning its input: the baseline and the hook's own cost;
  * `x * 2`: one aten op (an allocation and a launch);
  * qarl's FP8 / NVFP4 fake quant through its Python entry (`kernels.gpu.fp8_fake_quant_cuda`,
    `nvfp4_fake_quant_cuda`: Triton's launcher at the first call of a specialization, then the C++
    launcher of qarl/quant/kernels/launch.cpp), and the C++ launcher alone (what a bound input quantizer calls);
  * the same kernels through Triton's launcher at every call (`kernel[grid](...)`).
Forwards of all variants are interleaved in rounds; each ratio is the median of the same round's
ratios to the baseline. Also times each call in a loop over 16 inputs. Needs torch, triton and
transformers only (no ModelOpt: the kernels run without being installed as ModelOpt's ops).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=12, help="interleaved rounds (the first two are warm-up)")
    parser.add_argument("--out", default=None, help="also write the table to this markdown file")
    args = parser.parse_args()
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from qarl.quant.kernels import gpu as gk

    os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})  # see gpu_step_time.py --cpu
    config = Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)
    config._attn_implementation = "sdpa"
    model = Qwen2ForCausalLM(config).to("cuda", torch.bfloat16).eval()
    ids = torch.randint(0, config.vocab_size, (8, 512), device="cuda")
    amax = torch.tensor(4.0, device="cuda")
    nvfp4_kernel, fp8_kernel = gk._kernels()

    def triton_fp8(x: torch.Tensor) -> torch.Tensor:
        y = torch.empty_like(x)
        fp8_kernel[(-(-x.numel() // gk.FP8_BLOCK),)](x, y, amax, x.numel(), BLOCK=gk.FP8_BLOCK, EAGER=False,
                                                      num_warps=gk.FP8_NUM_WARPS)
        return y

    def triton_nvfp4(x: torch.Tensor) -> torch.Tensor:
        y = torch.empty_like(x)
        n_cols = x.shape[-1]
        n_blocks = x.numel() // 16
        nvfp4_kernel[(-(-n_blocks // gk.NVFP4_BLOCKS_PER_PROGRAM),)](
            x, y, amax, n_cols, n_cols // 16, n_blocks, BLOCKS=gk.NVFP4_BLOCKS_PER_PROGRAM, EVEN=True,
            num_warps=gk.NVFP4_NUM_WARPS)
        return y

    probe = torch.randn(8, 512, 896, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(triton_fp8(probe), gk.fp8_fake_quant_cuda(probe, amax))
    assert torch.equal(triton_nvfp4(probe), gk.nvfp4_fake_quant_cuda(probe, amax))
    fp8_launcher = gk._launcher(False, gk.FP8_BLOCK, gk.FP8_NUM_WARPS)
    nvfp4_launcher = gk._launcher(True, gk.NVFP4_BLOCKS_PER_PROGRAM, gk.NVFP4_NUM_WARPS)
    if fp8_launcher is None or nvfp4_launcher is None:
        raise SystemExit("qarl's C++ launcher could not be built (see the warning above)")
    assert torch.equal(fp8_launcher(probe, amax), triton_fp8(probe))
    assert torch.equal(nvfp4_launcher(probe, amax), triton_nvfp4(probe))
    variants = {
        "no hook": None,
        "hook returning its input": lambda x: x,
        "aten op (x * 2)": lambda x: x * 2,
        "qarl FP8 (Python entry, C++ launch)": lambda x: gk.fp8_fake_quant_cuda(x, amax),
        "qarl FP8 (C++ launcher alone)": lambda x: fp8_launcher(x, amax),
        "FP8 through Triton's launcher": triton_fp8,
        "qarl NVFP4 (Python entry, C++ launch)": lambda x: gk.nvfp4_fake_quant_cuda(x, amax),
        "qarl NVFP4 (C++ launcher alone)": lambda x: nvfp4_launcher(x, amax),
        "NVFP4 through Triton's launcher": triton_nvfp4,
    }

    current = {"op": None}
    for layer in model.model.layers:
        for linear in (layer.self_attn.q_proj, layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.down_proj):
            linear.register_forward_pre_hook(lambda module, inputs: None if current["op"] is None
                                             else (current["op"](inputs[0]),))

    def forward() -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            model(input_ids=ids)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, op in variants.items():
            current["op"] = op
            times[name].extend(forward() for _ in range(3))
    current["op"] = None
    base = times["no hook"][6:]
    inputs = [torch.randn(8, 512, 896, device="cuda", dtype=torch.bfloat16) for _ in range(16)]
    lines = [f"{torch.cuda.get_device_name()}, {args.rounds - 2} interleaved rounds of 3 forwards; ratio: median of "
             "the same round's ratios (quartiles)", "",
             "| at each of 96 linear inputs | forward | vs no hook | one call, 8x512x896 bf16 |", "|---|---|---|---|"]
    for name, op in variants.items():
        samples = times[name][6:]
        q1, median, q3 = statistics.quantiles([a / b for a, b in zip(samples, base)], n=4)
        per_call = "-"
        if op is not None:
            for x in inputs * 2:
                op(x)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(64):
                for x in inputs:
                    op(x)
            torch.cuda.synchronize()
            per_call = f"{(time.perf_counter() - start) / 1024 * 1e6:.1f} us"
        lines.append(f"| {name} | {statistics.median(samples) * 1e3:.1f} ms | {median:.3f} ({q1:.3f}-{q3:.3f}) | {per_call} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")


if __name__ == "__main__":
    main()
