"""`qarl parity`: does the rollout engine compute the log-probs the policy computes?

For each format: sample completions with vLLM, recompute their log-probs with the policy by teacher
forcing, and report |difference| for (a) synced: both sides quantized, weights and amax sent by a
refit; (b) unsynced: the policy quantized, the engine not (the mismatch that syncing removes);
(c) unquantized: neither side quantized (the floor set by floating point).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from qarl.config import RecipeConfig
from qarl.generation import VLLMEngine
from qarl.lora import check_lora, lora_layers
from qarl.policy import Policy, build_policy, resolve_model_dir, score_completions
from qarl.quant import resolve_format
from qarl.tasks import build_task

# A token whose |Δlogprob| exceeds this is counted as "flipped": some quantization rounding decision
# went the other way on the two sides (the floating-point floor is ~1e-6 and below).
FLIP_THRESHOLD = 1e-4


@dataclass
class Mismatch:
    mean_abs: float
    max_abs: float
    tokens: int
    flipped_tokens: int

    def as_dict(self) -> dict:
        return {"mean_abs": self.mean_abs, "max_abs": self.max_abs, "tokens": self.tokens,
                "flipped_tokens": self.flipped_tokens}


@torch.no_grad()
def measure(engine: VLLMEngine, policy: Policy, prompts: list[list[int]], max_new_tokens: int, seed: int) -> Mismatch:
    """Sample with the engine at temperature 1, score with the policy, compare per token."""
    completions = [c for c in engine.generate(prompts, max_new_tokens=max_new_tokens, temperature=1.0, seed=seed)
                   if c.token_ids]
    scores = score_completions(
        policy.model, [c.prompt_ids for c in completions], [c.token_ids for c in completions],
        pad_id=policy.tokenizer.pad_token_id,
    )
    diffs = torch.cat([(scores.logprobs[i, : len(c.token_ids)].cpu().double()
                        - torch.tensor(c.logprobs, dtype=torch.float64)).abs() for i, c in enumerate(completions)])
    return Mismatch(diffs.mean().item(), diffs.max().item(), diffs.numel(), int((diffs > FLIP_THRESHOLD).sum()))


@torch.no_grad()
def lora_policy(cfg: RecipeConfig, calib: list[str], model_dir: str, fmt, mode: str) -> Policy:
    """The policy with LoRA adapters in `mode` whose B is random (seeded: the same for every format),
    so that the adapters change the outputs and the engine has to reproduce them."""
    settings = dataclasses.replace(cfg.policy, lora=dataclasses.replace(cfg.policy.lora, mode=mode))
    torch.manual_seed(cfg.run.seed)
    policy = build_policy(settings, calib, model_dir=model_dir, fmt=fmt)
    generator = torch.Generator().manual_seed(cfg.run.seed)
    for _, layer in lora_layers(policy.model):
        layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=generator) * 0.05)
    return policy


def synced_and_unsynced(engine: VLLMEngine, fmt, quantized: Policy, plain: Policy, prompts: list[list[int]],
                        max_new_tokens: int, seed: int) -> tuple[Mismatch, Mismatch]:
    """The quantized policy against the engine synced with it, then against the engine holding `plain`
    (the same weights unquantized), which the engine keeps afterwards."""
    engine.set_quant_format(fmt)
    engine.refit(quantized.model)
    synced = measure(engine, quantized, prompts, max_new_tokens, seed)
    engine.set_quant_format(None)
    engine.refit(plain.model)
    return synced, measure(engine, quantized, prompts, max_new_tokens, seed)


def run_parity(cfg: RecipeConfig) -> dict[str, dict[str, dict]]:
    """Synced / unsynced / floor mismatch per format, and per format x `parity.lora_modes`."""
    torch.manual_seed(cfg.run.seed)
    task = build_task(cfg.task, cfg.run.seed)
    formats = [resolve_format(spec) for spec in cfg.parity.formats]  # bad names fail before any work
    model_dir = resolve_model_dir(cfg.policy.model_name)
    for mode in cfg.parity.lora_modes:
        check_lora(dataclasses.replace(cfg.policy, lora=dataclasses.replace(cfg.policy.lora, mode=mode)), model_dir)
    calib = task.calibration_texts(cfg.policy.quant_calib_size)
    unquantized = build_policy(cfg.policy, calib, model_dir=model_dir, fmt=None)
    tokenizer = unquantized.tokenizer
    prompts = [tokenizer(p.prompt).input_ids for p in task.eval[: cfg.parity.num_prompts]]
    engine = VLLMEngine(model_dir, cfg.policy.generation, cfg.policy.dtype, cfg.run.seed)
    n, seed = cfg.parity.max_new_tokens, cfg.run.seed

    engine.set_quant_format(None)
    engine.refit(unquantized.model)
    floor = measure(engine, unquantized, prompts, n, seed)
    results = {}
    for fmt in formats:
        if fmt is None:
            continue
        quantized = build_policy(cfg.policy, calib, model_dir=model_dir, fmt=fmt)
        synced, unsynced = synced_and_unsynced(engine, fmt, quantized, unquantized, prompts, n, seed)
        results[fmt.name] = {"synced": synced.as_dict(), "unsynced": unsynced.as_dict(),
                             "unquantized": floor.as_dict()}
        for mode in cfg.parity.lora_modes:  # the same three measurements with adapters on both sides
            adapted, adapted_plain = (lora_policy(cfg, calib, model_dir, f, mode) for f in (fmt, None))
            synced, unsynced = synced_and_unsynced(engine, fmt, adapted, adapted_plain, prompts, n, seed)
            floor_lora = measure(engine, adapted_plain, prompts, n, seed)  # the engine holds adapted_plain
            results[f"{fmt.name}+{mode}"] = {"synced": synced.as_dict(), "unsynced": unsynced.as_dict(),
                                             "unquantized": floor_lora.as_dict()}
    return results


def format_table(results: dict[str, dict[str, dict]]) -> str:
    lines = ["| format | synced mean | synced max | flipped | unsynced mean | unquantized mean | unsynced / synced |",
             "|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        s, u, f = r["synced"], r["unsynced"], r["unquantized"]
        ratio = u["mean_abs"] / max(s["mean_abs"], 1e-30)
        lines.append(f"| {name} | {s['mean_abs']:.2e} | {s['max_abs']:.2e} | {s['flipped_tokens']}/{s['tokens']} | "
                     f"{u['mean_abs']:.2e} | {f['mean_abs']:.2e} | {ratio:.0f}x |")
    return "\n".join(lines)
