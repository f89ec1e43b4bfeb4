"""Refit time: folded weights + input amax (a refit) vs raw unquantized weights loaded into the same engine.

    python benchmarks/refit_time.py                 # tiny and 20m embedded models, NVFP4 W4A4
    python benchmarks/refit_time.py --size 20m --format fp8_w8a8

Each size runs in its own process (one vLLM engine per process). Medians over --repeats refits,
the two kinds interleaved so that machine noise hits them alike; the amax share is measured inside each
refit (RefitTiming's weights / amax split).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def measure(size: str, fmt_name: str, repeats: int) -> dict:
    import torch

    from qarl.config import GenerationConfig, PolicyConfig
    from qarl.generation import VLLMEngine
    from qarl.models.resolve import resolve_model_dir
    from qarl.policy import build_policy
    from qarl.tasks import ArithmeticTask

    model_dir = resolve_model_dir(f"embedded:{size}")
    texts = ArithmeticTask(num_train=64, num_eval=8).calibration_texts(32)
    quantized = build_policy(PolicyConfig(quant_cfg=fmt_name, quant_calib_size=32), texts, model_dir=model_dir)
    plain = build_policy(PolicyConfig(quant_cfg="none"), texts, model_dir=model_dir, fmt=None)
    engine = VLLMEngine(model_dir, GenerationConfig(max_new_tokens=4), dtype="float32", seed=0,
                        quant_format=quantized.format)
    kinds = {
        "weights+amax": lambda: engine.refit(quantized.model),
        "raw weights (no folding)": lambda: engine.model.load_weights(
            [(n, p.detach()) for n, p in plain.model.named_parameters()]),
    }
    times: dict[str, list[float]] = {k: [] for k in kinds}
    split: list[float] = []  # (weights + amax) / weights inside one refit: immune to load between calls
    for _ in range(3):
        for fn in kinds.values():
            fn()
    for _ in range(repeats):
        for name, fn in kinds.items():
            start = time.perf_counter()
            timing = fn()
            times[name].append(time.perf_counter() - start)
            if name == "weights+amax":
                split.append(timing.total_s / timing.weights_s)
    median = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    params = sum(p.numel() for p in plain.model.parameters())
    return {"size": size, "params": params, "format": fmt_name, "threads": torch.get_num_threads(),
            "median_s": median, "ratio_amax_within_refit": sorted(split)[len(split) // 2],
            "ratio_vs_raw": median["weights+amax"] / median["raw weights (no folding)"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", choices=["tiny", "20m"])
    parser.add_argument("--format", default="nvfp4_w4a4")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    if args.size:
        print(json.dumps(measure(args.size, args.format, args.repeats)))
        return
    rows = []
    for size in ["tiny", "20m"]:
        out = subprocess.run([sys.executable, __file__, "--size", size, "--format", args.format,
                              "--repeats", str(args.repeats)], check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    print("| model | params | weights+amax | raw weights | +amax ratio (within a refit) | vs raw |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        m = r["median_s"]
        print(f"| {r['size']} | {r['params'] / 1e6:.1f}M | {m['weights+amax'] * 1e3:.1f} ms | "
              f"{m['raw weights (no folding)'] * 1e3:.1f} ms | {r['ratio_amax_within_refit']:.4f} | {r['ratio_vs_raw']:.2f} |")


if __name__ == "__main__":
    main()
