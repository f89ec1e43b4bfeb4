"""How far a W4A16 no-grad scoring pass is from its floor: the same policy with parts of its quantized path
replaced by plain torch calls.

    python benchmarks/gpu_scoring_floor.py [--rounds 12] [--out FILE]

With bf16 compute and fp32 master weights every quantized weight holds its own fake-quantized value and
W4A16's input, output and attention quantizers are disabled, so a quantized layer computes exactly what
`F.linear` (`F.embedding`, the model's own attention) computes on its parameters: the variants below differ
from qarl's path only in host time. Timed like `gpu_step_time.py` (the unquantized policy and the W4A16 one
resident, passes interleaved one by one, the garbage collector off inside each timed call, the host thread
pinned to one core); each ratio is the median of pass-by-pass ratios to the unquantized pass (quartiles),
and the ratio of the fastest passes. GPU only.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics

import torch
import torch.nn.functional as F

from gpu_step_time import SCORES_PER_ROUND, Subject, _timed, paired_ratios, report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="embedded:0.5b")
    parser.add_argument("--rounds", type=int, default=12, help="rounds of interleaved passes (the first two are warm-up)")
    parser.add_argument("--out", default=None, help="also write the table to this markdown file")
    args = parser.parse_args()

    from qarl.quant.fastpath import lean_forward as lean

    def plain_linear(self, input):
        return F.linear(input, self._parameters["weight"], self._parameters.get("bias"))

    def plain_attention(self, *args, **kwargs):
        return self._qarl_attention_cls.forward(self, *args, **kwargs)

    def plain_embedding(self, input):
        return F.embedding(input, self._parameters["weight"], self.padding_idx, None, self.norm_type,
                           self.scale_grad_by_freq, self.sparse)

    qarl_path = (lean.LeanLinear.forward, lean.LeanAttention.forward, lean.LeanEmbedding.forward)
    variants = {
        "qarl (lean forward)": qarl_path,
        "plain F.linear": (plain_linear, *qarl_path[1:]),
        "+ plain attention": (plain_linear, plain_attention, qarl_path[2]),
        "+ plain embedding": (plain_linear, plain_attention, plain_embedding),
    }

    def use(forwards) -> None:
        lean.LeanLinear.forward, lean.LeanAttention.forward, lean.LeanEmbedding.forward = forwards

    base, w4a16 = Subject("none", args.model, True), Subject("nvfp4_a16", args.model, True)
    held = sum(1 for m in w4a16.policy.model.modules() if m.__dict__.get("_qarl_held") is not None)
    if held == 0:
        raise SystemExit("no quantized weight holds its value: this is not the path the floor compares")
    os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
    times: dict[str, list[float]] = {"unquantized": [], **{name: [] for name in variants}}
    try:
        for _ in range(args.rounds):
            gc.collect()
            for _ in range(SCORES_PER_ROUND):
                times["unquantized"].append(_timed(base.score))
                for name, forwards in variants.items():
                    use(forwards)
                    times[name].append(_timed(w4a16.score))
                use(qarl_path)
    finally:
        use(qarl_path)
    warm = 2 * SCORES_PER_ROUND
    ref = times["unquantized"][warm:]
    lines = [f"model {args.model}, NVFP4 W4A16 with {held} held weights, bf16 compute + fp32 masters, "
             f"{torch.cuda.get_device_name()}, {args.rounds - 2} rounds x {SCORES_PER_ROUND} passes", "",
             "| no-grad scoring pass (8 completions) | median | vs unquantized (quartiles) | best vs best |",
             "|---|---|---|---|"]
    for name, samples in times.items():
        samples = samples[warm:]
        median, q1, q3 = paired_ratios(samples, ref)
        lines.append(f"| {name} | {statistics.median(samples) * 1e3:.2f} ms | {median:.3f} ({q1:.3f}-{q3:.3f}) | "
                     f"{min(samples) / min(ref):.3f} |")
    report(lines, args.out)


if __name__ == "__main__":
    main()
