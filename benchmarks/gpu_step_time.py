"""Policy-side cost of fake quantization on a GPU, per format, in one process.

    python benchmarks/gpu_step_time.py [--model embedded:0.5b] [--out FILE.md] [--no-cache]

For the unquantized policy and each shipped format (NVFP4 W4A16, NVFP4 W4A4, FP8 W8A8), on the same
model (default: the embedded Qwen2.5-0.5B-shaped model, random weights), bf16 compute with fp32 master
weights (qarl's default mixed precision), all four policies resident at once and timed in interleaved
rounds (on a launch-bound model the host's noise moves medians taken one format after another by 2x),
the host thread pinned to one core (`--cpu`), Python's garbage collector off inside each timed call
(it runs between them), with CUDA synchronisation; times are medians, and each
ratio is the median of the same round's ratios, with their quartiles (this run's noise), and the ratio
of the fastest times (best vs best):
  * `qarl.train.policy_update` on 64 completions of 64 prompt + 448 completion tokens, micro-batch 8
    (forward + backward of every micro-batch, the optimizer step, the master -> bf16 copy);
  * a no-grad scoring pass over 8 completions (what old / reference log-probs and evaluation cost);
  * the refit fold right after an optimizer step: every weight as the engine receives it, copied into
    preallocated buffers, against a plain copy of the parameters into the same buffers (with master
    weights the step itself quantizes each weight, in place: that cost is in policy_update);
and reports the GPU memory each policy holds with its optimizer, the update's peak above that, and what
the weight cache holds.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time

import torch


SCORES_PER_ROUND = 6  # a scoring pass is ~35 ms: six a round, for as many samples as the noise needs


def _timed(fn) -> float:
    """Seconds `fn` takes, with Python's garbage collector off inside (as `timeit` does): a collection's pause
    scales with every object of the process, four policies here, and lands on whichever call triggers it."""
    torch.cuda.synchronize()
    gc.disable()
    try:
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - start
    finally:
        gc.enable()


class Subject:
    """One format's policy, optimizer and batch, built once; each `time_*` times one measurement once."""

    def __init__(self, fmt_name: str, model: str, cache: bool):
        from qarl.config import RecipeConfig, load_recipe
        from qarl.generation import Completion
        from qarl.optim import PolicyOptimizer
        from qarl.models.resolve import resolve_model_dir
        from qarl.policy import build_policy
        from qarl.tasks import build_task
        from qarl.run import Rollout

        self.cfg = load_recipe("recipes/qa_grpo_tiny.yaml", [
            f"policy.model_name={model}", "policy.dtype=bfloat16", f"policy.quant_cfg={fmt_name}",
            f"policy.quant_weight_cache={str(cache).lower()}", "trainer.batch_size=64", "trainer.num_generations=8",
            "trainer.micro_batch_size=8", "policy.generation.max_new_tokens=448"], RecipeConfig)
        task = build_task(self.cfg.task, 0)
        torch.manual_seed(0)
        before = torch.cuda.memory_allocated()
        self.policy = build_policy(self.cfg.policy, task.calibration_texts(64), model_dir=resolve_model_dir(model),
                                   trainable=True)
        self.optimizer = PolicyOptimizer(self.policy, 1e-6, 0.0, 1.0)
        vocab = len(self.policy.tokenizer)
        gen = torch.Generator().manual_seed(0)
        self.completions = [Completion(torch.randint(2, vocab, (64,), generator=gen).tolist(),
                                       torch.randint(2, vocab, (448,), generator=gen).tolist(), [-1.0] * 448, "length")
                            for _ in range(64)]
        self.batch = Rollout(problems=[], completions=self.completions, texts=[], seconds=1.0)
        self.advantages = torch.randn(64, generator=gen)
        self.buffers = {n: torch.empty_like(p) for n, p in self.policy.model.named_parameters()}
        self.update()  # AdamW state exists from here on
        self.resident = torch.cuda.memory_allocated() - before - sum(b.numel() * b.element_size() for b in self.buffers.values())
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        self.update()
        self.update_peak = torch.cuda.max_memory_allocated() - start
        self.times: dict[str, list[float]] = {"update": [], "score": [], "fold": [], "copy": []}

    def update(self) -> None:
        from qarl.train import policy_update

        policy_update(self.policy, None, self.optimizer, self.batch, self.advantages, self.cfg)

    def score(self) -> None:
        from qarl.scoring import score_completions

        rows = self.completions[:8]
        with torch.no_grad():
            score_completions(self.policy.model, [c.prompt_ids for c in rows], [c.token_ids for c in rows],
                              self.policy.tokenizer.pad_token_id)

    def step(self) -> None:
        """An optimizer step with zero gradients: the weights change, so a refit after it folds anew."""
        for p in self.optimizer.params:
            p.grad = torch.zeros_like(p)
        self.optimizer.step()
        torch.cuda.synchronize()

    def time_update(self) -> None:
        self.times["update"].append(_timed(self.update))

    def time_score(self) -> None:
        self.times["score"].append(_timed(self.score))

    def time_fold(self) -> None:
        from qarl.quant import folded_weights

        with torch.no_grad():
            self.step()
            self.times["fold"].append(_timed(lambda: [self.buffers[n].copy_(t) for n, t in folded_weights(self.policy.model)]))
            self.step()
            self.times["copy"].append(_timed(lambda: [self.buffers[n].copy_(p) for n, p in self.policy.model.named_parameters()]))

    def samples(self, key: str) -> list[float]:
        """The timings of `key` after the two warm-up rounds (which warm up allocators and caches)."""
        times = self.times[key]
        return times[2 * len(times) // len(self.times["update"]):]

    def medians(self) -> dict[str, float]:
        from qarl.quant.fastpath.weight_cache import cache_bytes

        out = {k: statistics.median(self.samples(k)) for k in self.times}
        return {**out, "resident_gib": self.resident / 2**30, "update_peak_gib": self.update_peak / 2**30,
                "cache_gib": cache_bytes(self.policy.model) / 2**30}


def paired_ratios(samples: list[float], reference: list[float]) -> tuple[float, float, float]:
    """(median, first and third quartile) of the ratios of timings taken side by side, the i-th of each list in
    the same round: the host's drift between rounds cancels, and the quartiles' spread is this run's noise."""
    q1, median, q3 = statistics.quantiles([a / b for a, b in zip(samples, reference)], n=4)
    return median, q1, q3


def paired_ratio(subject: Subject, base: Subject, key: str) -> str:
    """`paired_ratios` of `subject`'s `key` timings over `base`'s."""
    median, q1, q3 = paired_ratios(subject.samples(key), base.samples(key))
    return f"{median:.2f} ({q1:.2f}-{q3:.2f})"


def best_ratio(subject: Subject, base: Subject, key: str) -> str:
    """`subject`'s fastest time over `base`'s: what each costs when nothing else on the host interferes (the
    estimate `timeit` recommends; interference only ever adds time, and a host-bound pass feels all of it)."""
    return f"{min(subject.samples(key)) / min(base.samples(key)):.2f}"


def report(lines: list[str], out: str | None) -> None:
    """Print the table, and write it to `out` as well where one is named."""
    table = "\n".join(lines)
    print(table)
    if out:
        with open(out, "w") as f:
            f.write(table + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="embedded:0.5b")
    parser.add_argument("--out", default=None, help="also write the table to this markdown file")
    parser.add_argument("--no-cache", action="store_true", help="ModelOpt's path: quantize at every forward")
    parser.add_argument("--rounds", type=int, default=12, help="interleaved rounds (the first two are warm-up)")
    parser.add_argument("--cpu", type=int, default=None,
                        help="the CPU core the timed rounds run on (default: the last one this process may use; "
                             "-1: not pinned). These steps wait on their host thread; unpinned, the same unquantized "
                             "update took 591-910 ms within one run on an H100 host")
    args = parser.parse_args()
    formats = {"unquantized": "none", "NVFP4 W4A16": "nvfp4_a16", "NVFP4 W4A4": "nvfp4_w4a4", "FP8 W8A8": "fp8_w8a8"}
    subjects = {label: Subject(name, args.model, not args.no_cache) for label, name in formats.items()}
    cpu = max(os.sched_getaffinity(0)) if args.cpu is None else args.cpu
    if cpu >= 0:  # after the builds, which may compile (ModelOpt's FP8 extension) on every core
        os.sched_setaffinity(0, {cpu})
    for _ in range(args.rounds):  # interleaved: host and GPU noise hits every format alike
        gc.collect()  # between the timed calls, not inside one
        for subject in subjects.values():
            subject.time_update()
        for _ in range(SCORES_PER_ROUND):  # pass by pass: the passes a ratio compares run ~0.1 s apart
            for subject in subjects.values():
                subject.time_score()
        for subject in subjects.values():
            subject.time_fold()
    results = {label: s.medians() for label, s in subjects.items()}
    base = subjects["unquantized"]
    lines = [f"model {args.model}, bf16 compute + fp32 master weights, weight cache {'off' if args.no_cache else 'on'}, "
             f"{torch.cuda.get_device_name()}, {args.rounds - 2} interleaved rounds (scoring: {SCORES_PER_ROUND} passes "
             f"a round), host thread {'on CPU %d' % cpu if cpu >= 0 else 'not pinned'}; times: medians; ratios: median "
             "of the same round's ratios (quartiles)", "",
             "| format | policy_update | vs unquantized | best vs best | no-grad scoring (8) | vs unquantized | "
             "best vs best | refit fold | fold / plain copy | policy + optimizer memory | update peak above it | "
             "weight cache |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, r in results.items():
        subject = subjects[label]
        lines.append(f"| {label} | {r['update'] * 1e3:.0f} ms | {paired_ratio(subject, base, 'update')} | "
                     f"{best_ratio(subject, base, 'update')} | {r['score'] * 1e3:.1f} ms | "
                     f"{paired_ratio(subject, base, 'score')} | {best_ratio(subject, base, 'score')} | {r['fold'] * 1e3:.2f} ms | "
                     f"{r['fold'] / r['copy']:.2f} | {r['resident_gib']:.2f} GiB | {r['update_peak_gib']:.2f} GiB | "
                     f"{r['cache_gib']:.2f} GiB |")
    report(lines, args.out)


if __name__ == "__main__":
    main()
