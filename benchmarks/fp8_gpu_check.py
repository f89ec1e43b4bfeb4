"""FP8 (E4M3, per-tensor) fake quant: ModelOpt on CPU (its eager path, what qarl runs on CPU) vs
ModelOpt on CUDA (its CUDA extension), bit for bit.

    python benchmarks/fp8_gpu_check.py --out report.md     # needs a CUDA GPU and nvidia-modelopt
"""

from __future__ import annotations

import argparse

import torch


def cases(generator: torch.Generator):
    def normal(shape, scale=1.0):
        return torch.randn(shape, generator=generator, device="cuda") * scale

    yield "normal", normal((512, 1024))
    yield "weight_0.02", normal((1024, 896), 0.02)
    t = torch.distributions.StudentT(torch.tensor(3.0, device="cuda"))
    yield "student_t3", t.sample((512, 1024))
    rows = normal((256, 1024))
    rows[::7] *= 50
    yield "outlier_rows", rows
    yield "activations_3d", normal((4, 64, 896), 3.0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="fp8_gpu_check.md")
    args = parser.parse_args()
    from modelopt.torch.quantization.nn import TensorQuantizer
    from modelopt.torch.quantization.config import QuantizerAttributeConfig

    generator = torch.Generator(device="cuda").manual_seed(0)
    lines = ["| case | dtype | amax | elements | differing (CPU eager vs CUDA) |", "|---|---|---|---|---|"]
    total = differing = 0
    for name, x32 in cases(generator):
        for dtype in (torch.float32, torch.bfloat16):
            x = x32.to(dtype)
            for label, factor in (("max", 1.0), ("max/2", 0.5), ("2max", 2.0)):
                amax = x.float().abs().amax() * factor
                outputs = {}
                for device in ("cuda", "cpu"):
                    q = TensorQuantizer(QuantizerAttributeConfig(num_bits=(4, 3), axis=None)).to(device)
                    q.amax = amax.to(device)
                    with torch.no_grad():
                        outputs[device] = q(x.to(device)).cpu()
                bits = torch.int32 if dtype == torch.float32 else torch.int16
                diff = int((outputs["cuda"].view(bits) != outputs["cpu"].view(bits)).sum())
                total += x.numel()
                differing += diff
                lines.append(f"| {name} | {str(dtype).split('.')[-1]} | {label} | {x.numel()} | {diff} |")
    lines.insert(0, f"# FP8 fake quant: ModelOpt CPU eager vs CUDA\n\n{torch.cuda.get_device_name()}, torch {torch.__version__}\n\n"
                    f"**{differing} of {total} elements differ.**\n")
    open(args.out, "w").write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
