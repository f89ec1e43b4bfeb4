"""Teacher-forced log-probs of the HF backend against the Megatron backend: the same model, the same batch,
each dtype and shipped format, at the TP size torchrun gives (one process per GPU).

    torchrun --nproc_per_node TP benchmarks/megatron_parity.py --model embedded:0.5b --out results.md

Every rank builds its Megatron shard; rank 0 also builds the HF backend on its device and writes a
markdown table: mean and max |Δ log-prob| of the next tokens, HF vs Megatron, and the dtype's floor
(the HF backend in this dtype against itself in fp32, unquantized). Both sides are calibrated on the
same token batches. Runs on CPU too (gloo), which is how it was checked before the GPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

FORMATS = ["none", "quant_configs/nvfp4_a16.yaml", "quant_configs/nvfp4_w4a4.yaml", "quant_configs/fp8_w8a8.yaml"]


def next_token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def main() -> None:
    from transformers import AutoModelForCausalLM

    from qarl.backends.convert import gpt_shape, read_hf_config
    from qarl.backends.megatron import build_megatron_model
    from qarl.distributed import local_device
    from qarl.models.resolve import resolve_model_dir
    from qarl.quant import quantize_policy, resolve_format

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="embedded:0.5b")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    model_dir = resolve_model_dir(args.model)
    device = local_device()  # this rank's own GPU (a bare "cuda" is GPU 0 on every rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    tp = int(os.environ.get("WORLD_SIZE", 1))
    shape = gpt_shape(read_hf_config(model_dir))
    ids = torch.randint(2, shape.vocab, (args.batch, args.length), generator=torch.Generator().manual_seed(0)).to(device)
    calibration = lambda: [{"input_ids": ids[i:i + 4]} for i in range(0, args.batch, 4)]  # noqa: E731

    def hf_logprobs(dtype: torch.dtype, fmt) -> torch.Tensor:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
        if fmt is not None:
            quantize_policy(model, fmt, calibration)
        with torch.no_grad():
            return next_token_logprobs(model(input_ids=ids).logits, ids)

    cases = [(d, f) for d in args.dtypes.split(",") for f in FORMATS]
    # The HF side first, before torch.distributed starts: with a process group up, ModelOpt's calibration of
    # a plain model would all-reduce its amax over the whole world while the other ranks do something else.
    reference = {}
    if int(os.environ.get("RANK", 0)) == 0:
        reference = {case: hf_logprobs(getattr(torch, case[0]), resolve_format(case[1])) for case in cases}
    rows = []
    for dtype_name, fmt_name in cases:
        fmt = resolve_format(fmt_name)
        start = time.perf_counter()
        built = build_megatron_model(model_dir, tp, getattr(torch, dtype_name), device, fmt=fmt, calibration=calibration)
        with torch.no_grad():
            megatron = next_token_logprobs(built.logits(ids), ids)
        del built
        if dist.get_rank() == 0:
            delta = (megatron - reference[dtype_name, fmt_name]).abs()
            floor = (reference[dtype_name, "none"] - reference.get(("float32", "none"), reference[dtype_name, "none"]))
            rows.append((dtype_name, fmt.name if fmt else "unquantized", delta.mean().item(), delta.max().item(),
                         floor.abs().mean().item()))
            print(*rows[-1], f"{time.perf_counter() - start:.1f} s", flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if dist.get_rank() == 0:
        name = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
        command = f"torchrun --nproc_per_node {tp} benchmarks/megatron_parity.py {' '.join(sys.argv[1:])}"
        lines = [f"Command: `{command}`", "", f"HF backend vs Megatron backend, {args.model}, {args.batch} x {args.length} tokens, TP={tp}, {name}",
                 "", "| dtype | format | mean abs Δ log-prob | max abs Δ | floor: HF in this dtype vs HF fp32, unquantized |",
                 "|---|---|---|---|---|"]
        lines += [f"| {d} | {f} | {m:.2e} | {x:.2e} | {fl:.2e} |" for d, f, m, x, fl in rows]
        text = "\n".join(lines) + "\n"
        print(text)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(text)
    dist.barrier()


if __name__ == "__main__":
    main()
