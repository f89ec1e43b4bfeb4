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
from qarl.generation import VLLMEngine, engine_adapter_rank, engine_mode
from qarl.lora import check_lora, lora_layers
from qarl.models.resolve import resolve_model_dir
from qarl.policy import build_policy, Policy
from qarl.scoring import score_completions
from qarl.quant import resolve_format
from qarl.tasks import build_task, model_prompt_format

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


def run_parity(cfg: RecipeConfig) -> dict[str, dict[str, dict]]:
    """Synced / unsynced / floor mismatch per format, and per format x `parity.lora_modes`.

    Every unquantized-engine measurement comes first, then one engine format at a time: an engine with
    CUDA graphs restarts to change format, so the order keeps that to one start per format."""
    torch.manual_seed(cfg.run.seed)
    task = build_task(cfg.task, cfg.run.seed)
    formats = [f for f in (resolve_format(spec) for spec in cfg.parity.formats) if f is not None]  # bad names fail first
    model_dir = resolve_model_dir(cfg.policy.model_name)
    modes = list(cfg.parity.lora_modes)
    for mode in modes:
        check_lora(dataclasses.replace(cfg.policy, lora=dataclasses.replace(cfg.policy.lora, mode=mode)), model_dir)
    for fmt in formats:  # what the engine cannot serve (an NVFP4 KV cache, ...) is refused before any policy is built
        engine_mode(model_dir, fmt, cfg.policy.generation, cfg.policy.dtype, 0, False, cfg.policy.exact_forward)
    formatting = model_prompt_format(model_dir, cfg.task, cfg.policy.trust_remote_code)
    calib = task.calibration_texts(cfg.policy.quant_calib_size, formatting)
    unquantized = build_policy(cfg.policy, calib, model_dir=model_dir, fmt=None)
    prompts = formatting.batch([p.prompt for p in task.eval[: cfg.parity.num_prompts]])
    n, seed = cfg.parity.max_new_tokens, cfg.run.seed
    # (row name, its format, the quantized policy, the same weights unquantized); LoRA rows carry random adapters
    rows = [(fmt.name, fmt, build_policy(cfg.policy, calib, model_dir=model_dir, fmt=fmt), unquantized) for fmt in formats]
    for mode in modes:
        plain = lora_policy(cfg, calib, model_dir, None, mode)
        rows += [(f"{fmt.name}+{mode}", fmt, lora_policy(cfg, calib, model_dir, fmt, mode), plain) for fmt in formats]

    lora = dataclasses.replace(cfg.policy.lora, mode="qlora") if "qlora" in modes else cfg.policy.lora
    engine = VLLMEngine(model_dir, cfg.policy.generation, cfg.policy.dtype, cfg.run.seed,
                        adapter_rank=engine_adapter_rank(lora), exact=cfg.policy.exact_forward)
    results: dict[str, dict[str, dict]] = {}
    floor, held = None, None
    for name, _, quantized, plain in rows:  # the engine unquantized: the floor, and the unsynced mismatch
        if plain is not held:
            engine.refit(plain.model)
            floor, held = measure(engine, plain, prompts, n, seed), plain
        results[name] = {"unsynced": measure(engine, quantized, prompts, n, seed).as_dict(), "unquantized": floor.as_dict()}
    for fmt in formats:  # the engine synced with each quantized policy
        engine.set_quant_format(fmt)
        for name, row_format, quantized, _ in rows:
            if row_format is fmt:
                engine.refit(quantized.model)
                results[name]["synced"] = measure(engine, quantized, prompts, n, seed).as_dict()
    engine.close()
    return results


def format_table(results: dict[str, dict[str, dict]]) -> str:
    lines = ["| format | synced mean | synced max | flipped | unsynced mean | unquantized mean | unsynced / synced |",
             "|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        s, u, f = r["synced"], r["unsynced"], r["unquantized"]
        ratio = f"{u['mean_abs'] / s['mean_abs']:.0f}x" if s["mean_abs"] else "synced is exactly 0"
        lines.append(f"| {name} | {s['mean_abs']:.2e} | {s['max_abs']:.2e} | {s['flipped_tokens']}/{s['tokens']} | "
                     f"{u['mean_abs']:.2e} | {f['mean_abs']:.2e} | {ratio} |")
    return "\n".join(lines)
