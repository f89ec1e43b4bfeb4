"""One copy of the rollout weights against two, on a GPU, one engine in one process (policy.generation.share_weights).

    python benchmarks/gpu_share_weights.py [--model embedded:0.5b] [--format nvfp4_a16] [--rounds 3] [--out F.md]

A bf16 policy with fp32 masters (the GPU default) and a colocated engine with CUDA graphs go through the steps of
a training run, sleep -> update (a scoring pass, backward, AdamW step) -> wake -> refit -> rollout, in modes
interleaved round by round so that what the host does meanwhile hits them alike:
  * copied: the engine's own weights, refit copies every weight, vLLM's sleep offloads them to host memory;
  * shared: the policy's compute weights are the engine's (shared_weights.py), the sleep releases the KV cache;
  * shared + gc: the same, with the full garbage collection vLLM's own sleep runs (gc.collect) after the release.
Per mode: medians of sleep+wake, update, refit and rollout seconds, the rollout's full (generation-2) garbage
collections and their time, and device memory in use after the rollout and after the update.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time

import torch

MODES = ("copied", "shared", "shared + gc")


class GcTimer:
    """Full (generation-2) garbage collections while counting, and the seconds they took."""

    def __init__(self):
        self.count, self.seconds, self._start, self.on = 0, 0.0, 0.0, False
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if not self.on or info["generation"] != 2:
            return
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.count += 1
            self.seconds += time.perf_counter() - self._start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="embedded:0.5b")
    parser.add_argument("--format", default="nvfp4_a16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cycles", type=int, default=2, help="timed cycles per mode and round (after one untimed)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from qarl.config import GenerationConfig, PolicyConfig
    from qarl.generation import VLLMEngine
    from qarl.optim import PolicyOptimizer
    from qarl.models.resolve import resolve_model_dir
    from qarl.policy import build_policy
    from qarl.scoring import score_completions
    from qarl.tasks import ArithmeticTask

    model_dir = resolve_model_dir(args.model)
    torch.manual_seed(0)
    policy = build_policy(PolicyConfig(model_name=model_dir, dtype="bfloat16", master_dtype="float32",
                                       quant_cfg=args.format, quant_calib_size=64),
                          ArithmeticTask(num_train=400, num_eval=32, seed=0).calibration_texts(64), model_dir=model_dir,
                          trainable=True)
    optimizer = PolicyOptimizer(policy, 1e-6, 0.0, 1.0)
    engine = VLLMEngine(model_dir, GenerationConfig(max_new_tokens=args.tokens, max_model_len=512), "bfloat16", 0,
                        quant_format=policy.format)
    shared = engine._shared  # the modes switch it off and on (a benchmark's reach into the engine)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, len(policy.tokenizer), (args.batch, 16), generator=gen).tolist()
    gc_timer = GcTimer()
    times = {mode: {k: [] for k in ("sleep_wake", "update", "refit", "rollout", "gc2", "gc2_s", "mem_rollout", "mem_update")}
             for mode in MODES}

    def cycle(mode: str, record: bool) -> None:
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.sleep()
        if mode == "shared + gc":
            gc.collect()
        torch.cuda.synchronize()
        slept = time.perf_counter()
        scores = score_completions(policy.model, prompts[:16], [p[:8] * 8 for p in prompts[:16]],
                                   policy.tokenizer.pad_token_id)
        optimizer.backward(-scores.logprobs.mean())
        optimizer.step()
        torch.cuda.synchronize()
        updated = time.perf_counter()
        free, total = torch.cuda.mem_get_info()
        mem_update = (total - free) / 2**30
        engine.wake()
        woke = time.perf_counter()
        engine.refit(policy.model)
        torch.cuda.synchronize()
        refitted = time.perf_counter()
        gc_timer.count, gc_timer.seconds, gc_timer.on = 0, 0.0, True
        completions = engine.generate(prompts, max_new_tokens=args.tokens, ignore_eos=True, seed=0)
        gc_timer.on = False
        done = time.perf_counter()
        assert sum(len(c.token_ids) for c in completions) == args.batch * args.tokens
        free, total = torch.cuda.mem_get_info()
        if record:
            row = times[mode]
            row["sleep_wake"].append(slept - start + woke - updated)
            row["update"].append(updated - slept)
            row["refit"].append(refitted - woke)
            row["rollout"].append(done - refitted)
            row["gc2"].append(gc_timer.count)
            row["gc2_s"].append(gc_timer.seconds)
            row["mem_rollout"].append((total - free) / 2**30)
            row["mem_update"].append(mem_update)

    def switch(mode: str) -> None:
        if mode == "copied":
            shared.unlink()
            engine._shared = None
        else:
            engine._shared = shared

    for round_ in range(args.rounds + 1):  # round 0 warms up every mode
        for mode in MODES:
            switch(mode)
            cycle(mode, record=False)
            for _ in range(args.cycles):
                cycle(mode, record=round_ > 0)
        print(f"round {round_} done", file=sys.stderr)

    lines = [f"# One copy of the rollout weights, {args.model}, {args.format}, bf16 + fp32 masters, CUDA graphs, colocated",
             "", f"`python benchmarks/gpu_share_weights.py --model {args.model} --format {args.format} --rounds {args.rounds}`"
             f" ({torch.cuda.get_device_name()}); medians of {args.rounds} rounds x {args.cycles} cycles, modes interleaved;"
             f" rollout: {args.batch} completions x {args.tokens} tokens.", "",
             "| mode | sleep + wake s | update s | refit s | rollout s | rollout tokens/s | full GCs in rollout | their s "
             "| GiB in use after rollout | after update |", "|---|---|---|---|---|---|---|---|---|---|"]
    for mode in MODES:
        row = {k: statistics.median(v) for k, v in times[mode].items()}
        lines.append(f"| {mode} | {row['sleep_wake']:.4f} | {row['update']:.4f} | {row['refit']:.4f} | {row['rollout']:.4f} "
                     f"| {args.batch * args.tokens / row['rollout']:.0f} | {row['gc2']:.1f} | {row['gc2_s']:.4f} "
                     f"| {row['mem_rollout']:.2f} | {row['mem_update']:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    engine.close()


if __name__ == "__main__":
    main()
