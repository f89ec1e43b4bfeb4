"""What packing a frozen base leaves cached on a GPU: the codes staged in host memory until every weight is freed
(qarl's `pack_frozen_weights`) against the codes left where they were encoded, among the blocks the caching allocator
holds freed: the weights packed before, and (`--scratch-gib`) a calibration pass's activations, freed and cached.

    python benchmarks/gpu_pack_memory.py [--layers 28] [--width 4096] [--scratch-gib 8]
"""

from __future__ import annotations

import argparse
from unittest import mock

import torch


def measure(staged: bool, layers: int, width: int, scratch_gib: float) -> str:
    import modelopt.torch.quantization as mtq

    from qarl.quant import pack_frozen_weights, packed, resolve_format

    torch.cuda.empty_cache()
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    model = model.to("cuda", torch.bfloat16)
    x = torch.randn(4, width, device="cuda", dtype=torch.bfloat16)
    mtq.quantize(model, resolve_format("quant_configs/nvfp4_a16.yaml").modelopt_cfg, forward_loop=lambda m: m(x))
    model.requires_grad_(False)
    weights = layers * width * width * 2
    scratch = torch.empty(int(scratch_gib * 2**30), dtype=torch.uint8, device="cuda")  # calibration's logits, say
    del scratch  # freed, still cached
    with mock.patch.object(packed, "_move_codes", packed._move_codes if staged else (lambda q, d: None)):
        pack_frozen_weights(model)
    torch.cuda.empty_cache()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    del model
    return (f"{'staged' if staged else 'in place'}: bf16 weights {weights / 2**30:.2f} GiB -> allocated "
            f"{allocated / 2**30:.2f} GiB, reserved {reserved / 2**30:.2f} GiB, cached {(reserved - allocated) / 2**30:.2f} GiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--scratch-gib", type=float, default=8.0)
    args = parser.parse_args()
    for staged in (False, True):
        print(measure(staged, args.layers, args.width, args.scratch_gib), flush=True)


if __name__ == "__main__":
    main()
