"""What stands between one micro-batch of the policy update and a CUDA graph (issue 74, the first measurement):
the host synchronizations of its forward + backward, where each comes from, then one capture of the whole
micro-batch (`torch.cuda.graph` around the forward, the sum of log-probs and `backward()`) and, if it is captured,
its replay against the eager pass: the log-probs' and the gradients' bits, and the time of each.

    python benchmarks/graph_probe.py [--model DIR] [--format quant_configs/nvfp4_w4a4.yaml] [--exact]
        [--completions 8 --prompt-tokens 100 --completion-tokens 1024] [--out FILE.json]

The model and micro-batch as `benchmarks/exact_step_time.py` builds them (random token ids, bf16 compute, fp32
masters). A capture fails at the first operation a graph cannot hold (a synchronization, a host copy, an
allocation outside its pool): its error and the qarl frame it came from are the result then. On a GPU only.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_step_time import _timed  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="embedded:0.5b")
    parser.add_argument("--format", default="quant_configs/nvfp4_w4a4.yaml")
    parser.add_argument("--exact", action="store_true", help="policy.exact_forward=true")
    parser.add_argument("--completions", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--completion-tokens", type=int, default=1024)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    import torch

    from qarl.config import PolicyConfig
    from qarl.models.resolve import resolve_model_dir
    from qarl.policy import build_policy
    from qarl.scoring import score_completions
    from qarl.tasks import ArithmeticTask
    from qarl.transfer import host_waits, qarl_frame

    task = ArithmeticTask(num_train=400, num_eval=32, seed=0)
    cfg = PolicyConfig(model_name=args.model, quant_cfg=args.format, dtype="bfloat16", exact_forward=args.exact)
    policy = build_policy(cfg, task.calibration_texts(32), model_dir=resolve_model_dir(cfg.model_name), trainable=True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 100, (args.prompt_tokens,), generator=g).tolist() for _ in range(args.completions)]
    completions = [torch.randint(3, 100, (args.completion_tokens,), generator=g).tolist()
                   for _ in range(args.completions)]
    params = [p for p in policy.model.parameters() if p.requires_grad]

    def step() -> torch.Tensor:
        logprobs = score_completions(policy.model, prompts, completions, 0, pack=not args.exact).logprobs
        logprobs.sum().backward()
        return logprobs

    def zero_grads() -> None:  # in place: a captured backward accumulates into these very tensors
        for p in params:
            if p.grad is not None:
                p.grad.zero_()

    report: dict = {"model": args.model, "format": args.format, "exact_forward": args.exact,
                    "micro_batch": [args.completions, args.prompt_tokens, args.completion_tokens]}
    for _ in range(3):  # warm-up: allocators, autotuning, compiled kernels, the gradients' buffers
        zero_grads()
        step()
    zero_grads()
    eager = step().detach().clone()
    eager_grads = [p.grad.clone() for p in params]
    report["eager_ms"] = 1e3 * _timed(lambda: (zero_grads(), step()))
    syncs = host_waits(lambda: (zero_grads(), step()))
    report["synchronizations"] = {"count": sum(syncs.values()), "by_frame": dict(syncs.most_common())}
    print(f"eager {report['eager_ms']:.1f} ms; {sum(syncs.values())} synchronizations:")
    for frame, count in syncs.most_common():
        print(f"  {count:4d}  {frame}")

    graph = torch.cuda.CUDAGraph()
    zero_grads()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(side):
            step()  # a pass on the capture stream first (its cuBLAS workspace, lazy state)
        torch.cuda.current_stream().wait_stream(side)
        zero_grads()
        with torch.cuda.graph(graph):
            captured = step()
    except Exception as error:  # the result: what a capture cannot hold, and where
        report["capture"] = {"error": f"{type(error).__name__}: {error}"[:2000],
                             "at": qarl_frame(traceback.extract_tb(error.__traceback__))}
        print(f"capture failed at {report['capture']['at']}: {report['capture']['error'][:400]}")
    else:
        zero_grads()
        graph.replay()
        torch.cuda.synchronize()
        same_logprobs = torch.equal(captured, eager)
        same_grads = all(torch.equal(p.grad, want) for p, want in zip(params, eager_grads))
        worst = max(((p.grad.float() - want.float()).abs().max().item() for p, want in zip(params, eager_grads)),
                    default=0.0)
        report["capture"] = {"replay_ms": 1e3 * _timed(lambda: (zero_grads(), graph.replay())),
                             "logprobs_equal": same_logprobs, "gradients_equal": same_grads,
                             "max_gradient_difference": worst}
        print(f"captured: replay {report['capture']['replay_ms']:.1f} ms against eager {report['eager_ms']:.1f} ms; "
              f"log-probs equal {same_logprobs}, gradients equal {same_grads} (max difference {worst:.3g})")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
