"""Held-out accuracy: greedy completions from the rollout engine, scored by the task's verifier.

`qarl eval CHECKPOINT_OR_MODEL` reports it for the quantized policy (the engine synced with the
checkpoint's quantizers and amax) and for the same master weights unquantized.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qarl.config import ConfigError, RecipeConfig, load_recipe
from qarl.console import timed
from qarl.models.resolve import check_model_name, resolve_model_dir
from qarl.rewards import ANSWER_PARSERS, WeightedRewards
from qarl.run_dir import is_run_or_checkpoint
from qarl.tasks import Problem, PromptFormat, build_task, check_prompt_lengths, model_prompt_format

if TYPE_CHECKING:
    from qarl.generation import VLLMEngine


@dataclass
class EvalResult:
    """Greedy held-out results, one entry per problem: the verifier's score (1 = right), whether the
    completion held a readable answer (None: the verifier has no parser), why it stopped, its length."""

    correct: list[float]
    parsed: list[bool] | None
    finish_reasons: list[str]
    lengths: list[int]

    @property
    def accuracy(self) -> float:
        return sum(c >= 1.0 for c in self.correct) / max(len(self.correct), 1)

    def hygiene(self) -> dict[str, float | None]:
        """Why answers failed, not only how many: parse rate, truncation (max tokens hit), stop/EOS rate,
        mean completion length in tokens."""
        n = max(len(self.correct), 1)
        return {"parse_rate": sum(self.parsed) / n if self.parsed is not None else None,
                "truncation_rate": sum(r == "length" for r in self.finish_reasons) / n,
                "stop_rate": sum(r == "stop" for r in self.finish_reasons) / n,
                "mean_length": sum(self.lengths) / n}

    def part(self, start: int, stop: int) -> EvalResult:
        """The results of problems start..stop-1."""
        return EvalResult(self.correct[start:stop], None if self.parsed is None else self.parsed[start:stop],
                          self.finish_reasons[start:stop], self.lengths[start:stop])


def evaluate(engine: VLLMEngine, prompts: PromptFormat, problems: list[Problem], rewards: WeightedRewards,
             label: str = "evaluation") -> EvalResult:
    """Greedy completions of `problems` from the engine (refitted by the caller), formatted by `prompts`, scored by
    the first reward (the verifier); a progress bar named `label` counts the completions."""
    completions = engine.generate(prompts.batch([p.prompt for p in problems]), greedy=True,
                                  stop_token_ids=prompts.stop_ids, progress=label)
    texts = prompts.tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
    parser = ANSWER_PARSERS.get(rewards.verifier_name)
    return EvalResult(correct=rewards.verify(texts, [p.answer for p in problems]),
                      parsed=[parser(t) for t in texts] if parser is not None else None,
                      finish_reasons=[c.finish_reason for c in completions],
                      lengths=[len(c.token_ids) for c in completions])


SPLIT_PREFIX = {"test": "eval", "transfer": "eval_transfer"}  # a split's metrics: eval/accuracy, eval_transfer/...


def evaluate_splits(engine: VLLMEngine, prompts: PromptFormat, splits: dict[str, list[Problem]],
                    rewards: WeightedRewards, label: str = "evaluation") -> dict[str, EvalResult]:
    """`evaluate` of every split (qarl.tasks.eval_splits) in one batch of completions (one bar, `label`), the results
    per split."""
    results = evaluate(engine, prompts, [p for problems in splits.values() for p in problems], rewards, label)
    out, start = {}, 0
    for name, problems in splits.items():
        out[name] = results.part(start, start + len(problems))
        start += len(problems)
    return out


def split_metrics(results: dict[str, EvalResult]) -> dict[str, float]:
    """A metrics row's held-out part: each split's accuracy and hygiene under its prefix (eval/accuracy,
    eval/truncation_rate, ..., eval_transfer/accuracy, ...); no parse rate where the verifier has no parser."""
    row = {}
    for name, result in results.items():
        prefix = SPLIT_PREFIX[name]
        row[f"{prefix}/accuracy"] = result.accuracy
        row.update({f"{prefix}/{key}": value for key, value in result.hygiene().items() if value is not None})
    return row


def _recipe_for(target: Path, overrides: list[str]) -> RecipeConfig:
    """The recipe a checkpoint was trained with (its run's config.yaml), else the defaults."""
    for candidate in (target / "config.yaml", target.parent.parent / "config.yaml", target.parent / "config.yaml"):
        if candidate.is_file():
            return load_recipe(candidate, overrides, RecipeConfig)
    return load_recipe(Path(__file__).parent / "recipe_defaults.yaml", overrides, RecipeConfig)


def check_not_quantized(path: Path) -> None:
    """`qarl eval` reads a model in full precision and quantizes it as the recipe says; a quantized checkpoint (an
    export: quantization_config in its config.json) is refused, naming what evaluates one."""
    config = path / "config.json"
    quantization = json.loads(config.read_text()).get("quantization_config") if config.is_file() else None
    if quantization:
        method = quantization.get("quant_algo") or quantization.get("quant_method") or "quantized"
        raise ConfigError(f"{path} is a quantized checkpoint ({method}; an export?): qarl eval takes a qarl run "
                          "directory, a checkpoint or a full-precision model. Evaluate the checkpoint it was exported "
                          f"from (qarl eval CHECKPOINT), compare the export with it by `qarl export --verify {path} "
                          "--checkpoint CHECKPOINT` (--vllm: served by vLLM), or measure its accuracy served by vLLM "
                          "with `qarl matrix` (matrix.exports, a GPU)")


def run_eval(target: str, overrides: list[str]) -> dict[str, Any]:
    """Accuracy of a checkpoint (or run directory: its newest checkpoint, or model) quantized and unquantized, and
    which checkpoint (path, step, run id) or model was read. The recipe is loaded and checked before anything heavy."""
    path = Path(target)
    if not path.is_dir() or (path / "config.json").is_file():  # a model (run and checkpoint directories hold none)
        check_not_quantized(path)
        check_model_name(target, "qarl eval's target (a run directory, a checkpoint or a model)")
    cfg = _recipe_for(path, overrides) if path.is_dir() else load_recipe(
        Path(__file__).parent / "recipe_defaults.yaml", [f"policy.model_name={target}", *overrides], RecipeConfig)
    from qarl.checkpoint import checkpoint_format, checkpoint_model_dir, load_policy_checkpoint
    from qarl.run_dir import resolve_checkpoint
    from qarl.generation import VLLMEngine, engine_adapter_rank
    from qarl.policy import build_policy
    from qarl.quant import resolve_format
    from qarl.run_dir import checkpoint_run_id, checkpoint_step

    is_checkpoint = is_run_or_checkpoint(path)
    # evaluation runs in one process on the HF backend, whichever backend trained it (its checkpoints are HF ones)
    # eager: a run's config.yaml holds the decided fast settings ("on"), which evaluation has no use for
    cfg = dataclasses.replace(cfg, policy=dataclasses.replace(cfg.policy, backend="hf", tensor_parallel_size=1,
                                                              compile_layers="off", compile_scores="off"))
    task = build_task(cfg.task, cfg.run.seed)
    rewards = WeightedRewards.from_specs(cfg.trainer.rewards, cfg.trainer.reward_error)
    problems = task.eval[: cfg.eval.num_prompts]
    if is_checkpoint:
        checkpoint = resolve_checkpoint(path)
        model_dir = str(checkpoint_model_dir(checkpoint))
    elif path.is_dir() and not (path / "config.json").is_file():
        raise ConfigError(f"{path} is neither a qarl checkpoint/run directory nor a Hugging Face model")
    else:
        model_dir = str(path) if path.is_dir() else resolve_model_dir(cfg.policy.model_name)
    prompts = model_prompt_format(model_dir, cfg.task, cfg.policy.trust_remote_code)
    check_prompt_lengths(prompts, {"eval": problems}, cfg.policy.generation)  # before the model loads
    if is_checkpoint:
        print(f"evaluating checkpoint {checkpoint} (step {checkpoint_step(checkpoint)})")
        with timed(f"loading {checkpoint}, quantized and not"):  # (the first load imports ModelOpt)
            quantized = load_policy_checkpoint(checkpoint, cfg.policy)
            plain = load_policy_checkpoint(checkpoint, cfg.policy, quantized=False)  # with its adapter, if LoRA
        fmt = checkpoint_format(checkpoint)
    else:
        fmt = resolve_format(cfg.policy.quant_cfg)
        plain = build_policy(cfg.policy, [], model_dir=model_dir, fmt=None)
        quantized = build_policy(cfg.policy, task.calibration_texts(cfg.policy.quant_calib_size, prompts),
                                 model_dir=model_dir)
    engine = VLLMEngine(model_dir, cfg.policy.generation, cfg.policy.dtype, cfg.run.seed, quant_format=fmt,
                        adapter_rank=engine_adapter_rank(plain.lora))  # a checkpoint's own adapters
    results: dict[str, Any] = {"checkpoint": str(checkpoint), "step": checkpoint_step(checkpoint),
                               "run_id": checkpoint_run_id(checkpoint)} if is_checkpoint else {"model": model_dir}
    if fmt is not None:
        engine.refit(quantized.model)
        results["quantized"] = evaluate(engine, prompts, problems, rewards, f"evaluating {fmt.name}").accuracy
        results["format"] = fmt.name
    engine.set_quant_format(None)
    engine.refit(plain.model)
    results["unquantized"] = evaluate(engine, prompts, problems, rewards, "evaluating unquantized").accuracy
    results["num_prompts"] = len(problems)
    return results
