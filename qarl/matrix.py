"""`qarl matrix`: does the RL gain survive quantization better than post-training quantization (PTQ)?

Every model (a base, and models trained from it: qarl runs or checkpoints, or Hugging Face directories)
is evaluated greedily, in the rollout engine, on every held-out split of the task (the test split, and the
transfer split where the task has one: problems unlike the training ones) at every precision of the matrix:
  full       unquantized;
  FMT METHOD each format after PTQ with each calibration method, on the recipe's calibration data
             (ModelOpt's max calibration, and stronger ones: AWQ's activation-aware smoothing, MSE
             scale search), so "quantization-aware training beats PTQ" is tested against each of them;
  trained    a run trained quantized, at its own trained quantization (its checkpoint's format and amax).
  exported T the same run written by `qarl export` as target T's real low-precision checkpoint and served by vLLM
             with its own kernels (matrix.exports; a GPU, or on CPU a compressed-tensors W4A4 target): what a user
             deploys. A W4A4 export on a GPU without FP4 tensor cores, or on CPU, is served by vLLM's NVFP4 emulation,
             whose activations are 4-bit as trained (vLLM's own choice on such a GPU is weight-only:
             qarl/generation/served_export.py).
A run's trained format is always also a PTQ column, so its transfer to the other formats shows too.

  gain      D(m, p) = acc(m, p) - acc(base, p)            the trained column compares with the base's PTQ
  survival  S(m, p) = D(m, p) - D(m, full)                > 0: quantization kept more of the gain
  share     (acc(m, p) - acc(base, full)) / (acc(GRPO, full) - acc(base, full))   GRPO: the one unquantized
            trained row; the PTQ-relative share D(m, p) / the same denominator is kept under that name

Standard errors: every cell is scored on the same prompts, so differences are paired, the standard
error of a mean of per-prompt differences, sqrt(var(d) / n); for one accuracy that is the binomial
sqrt(p (1 - p) / n). A model given as several seeds is averaged prompt by prompt, and the spread of
its per-seed survival is reported beside (the seed noise that the prompt SE does not contain).
Paired tests: every pair of cells, on those per-prompt seed means, gets the mean difference, its 95 %
paired-bootstrap interval over prompts and the exact sign-flip test's mid-p (McNemar's exact test when
both cells have one seed).

Outputs under `matrix.out`: matrix.json (every number and the hygiene of every cell: answer parse
rate, truncation rate, stop/EOS rate, mean length; per split; and the kernels vLLM served each exported
column with), matrix.md (the tables), matrix.png; .qarl.lock while it runs.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qarl.config import WARM_START, ConfigError, GenerationConfig, RecipeConfig, load_recipe
from qarl.dir_lock import LOCK_FILE, owning
from qarl.run_dir import is_run_or_checkpoint

if TYPE_CHECKING:  # the engine's import is heavy: the checks come first
    from qarl.evaluate import EvalResult

FULL = "full"
TRAINED = "trained"
CONFIG_KEYS_IGNORED = {"_name_or_path", "dtype", "torch_dtype", "transformers_version", "use_cache"}


# -- statistics --------------------------------------------------------------------------------------
def mean_and_se(values: Sequence[float]) -> tuple[float, float]:
    """Mean and standard error sqrt(var / n), var the population variance: for 0/1 scores exactly the
    binomial standard error sqrt(p (1 - p) / n)."""
    if not values:
        raise ValueError("no values")
    n = len(values)
    mean = sum(values) / n
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / n / n)


def per_prompt(results: Sequence[EvalResult]) -> list[float]:
    """Each prompt's score averaged over the seeds of a model (1 = right in every seed)."""
    return [sum(r.correct[i] >= 1.0 for r in results) / len(results) for i in range(len(results[0].correct))]


def gain(model: Sequence[float], base: Sequence[float]) -> tuple[float, float]:
    """Paired gain of per-prompt scores over the base's on the same prompts: mean and SE."""
    return mean_and_se([m - b for m, b in zip(model, base, strict=True)])


def survival(model_q: Sequence[float], base_q: Sequence[float], model_full: Sequence[float],
             base_full: Sequence[float]) -> tuple[float, float]:
    """Gain survival (model_q - base_q) - (model_full - base_full), prompt by prompt: mean and SE."""
    return mean_and_se([mq - bq - mf + bf for mq, bq, mf, bf in zip(model_q, base_q, model_full, base_full, strict=True)])


def sign_flip_p(differences: Sequence[int]) -> tuple[float, float]:
    """Two-sided p-values (exact, mid-p) of the paired sign-flip test of integer per-prompt differences: if two rows
    are the same model, each prompt's difference is as likely +d as -d. On 0/1 results (one seed a row) this is
    McNemar's exact test: the signs of the b + c discordant prompts are Bin(b + c, 1/2). The null distribution of the
    sum is exact: one binomial per distinct |d|, convolved. mid-p counts half the probability of the observed sum."""
    import numpy as np

    observed = abs(sum(differences))
    distribution, offset = np.ones(1), 0  # P(sum = i - offset)
    for magnitude, count in Counter(abs(d) for d in differences if d).items():
        spread = np.zeros(2 * magnitude * count + 1)  # count signs, k of them +: sum magnitude * (2k - count)
        spread[::2 * magnitude] = [math.comb(count, k) / 2**count for k in range(count + 1)]
        distribution, offset = np.convolve(distribution, spread), offset + magnitude * count
    sums = np.arange(len(distribution)) - offset
    above, at = distribution[sums > observed].sum(), distribution[sums == observed].sum()
    return min(1.0, float(2 * (above + at))), min(1.0, float(2 * (above + at / 2)))


def bootstrap_interval(differences: Sequence[float], level: float = 0.95, resamples: int = 10_000,
                       seed: int = 0) -> tuple[float, float]:
    """Percentile interval of the mean difference over prompts resampled with replacement (paired: a prompt's two
    results travel together). Drawn as multinomial counts of the distinct differences, which is the same distribution
    as resampling prompts, in a fraction of the time; seeded, so one report gives one interval."""
    import numpy as np

    values, counts = np.unique(np.asarray(differences, dtype=float), return_counts=True)
    n = int(counts.sum())
    means = np.random.default_rng(seed).multinomial(n, counts / n, size=resamples) @ values / n
    low, high = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return float(low), float(high)


def paired_test(a: Sequence[float], b: Sequence[float], seeds_a: int, seeds_b: int) -> dict[str, Any]:
    """Row a against row b on the same prompts, each score a prompt's mean over its row's seeds: the mean difference
    a - b, its 95 % paired-bootstrap interval over prompts, and the exact sign-flip test's p (mid-p; McNemar's when
    both rows have one seed). Seeds are pooled per prompt: the interval is over prompts for these trained seeds; the
    spread between seeds is the survival table's sd."""
    differences = [x - y for x, y in zip(a, b, strict=True)]
    scale = math.lcm(seeds_a, seeds_b)  # every difference is a multiple of 1 / scale
    p_exact, p_mid = sign_flip_p([round(d * scale) for d in differences])
    low, high = bootstrap_interval(differences)
    return {"difference": sum(differences) / len(differences), "ci95": [low, high], "p": p_mid, "p_exact": p_exact,
            "test": "mcnemar" if seeds_a == seeds_b == 1 else "sign-flip"}


# -- what is evaluated -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Precision:
    """A matrix column: unquantized (format None), a format with a PTQ method, or the model's own
    trained quantization."""

    name: str
    format: Any = None  # qarl.quant.QuantFormat
    trained: bool = False  # the model's own trained quantization: fake-quantized, or exported (`export`)
    export: Any = None  # qarl.export.ExportTarget: the column of the runs exported to it


@dataclass
class ModelSource:
    """One evaluated model: where its weights are and, for a checkpoint, how it was trained."""

    path: str
    model_dir: str
    checkpoint: Path | None = None
    trained_format: Any = None  # the checkpoint's QuantFormat; None: trained unquantized (or not by qarl)


@dataclass
class Plan:
    """Everything `qarl matrix` will evaluate, checked before anything heavy runs."""

    cfg: RecipeConfig
    splits: dict[str, list]  # the held-out splits, by name: "test", and "transfer" where the task has one
    prompts: Any  # the PromptFormat every model is asked in (they share the base's tokenizer)
    calibration: list[str]
    models: dict[str, list[ModelSource]]  # "base" first
    precisions: list[Precision]
    trained_precision: dict[str, str] = field(default_factory=dict)  # model -> its trained format's PTQ column

    @property
    def generation(self) -> GenerationConfig:
        """The engines' settings: the recipe's, never sleeping. Nothing trains between a matrix's evaluations, and
        vLLM's sleep-mode allocator serves one engine per process: the engine of a compressed-tensors FP8 export left
        memory in it that the next export's engine refused ("CuMem allocator can only be used for one instance per
        process"; vLLM 0.26, H200)."""
        return replace(self.cfg.policy.generation, sleep_between_rollouts="off")


def resolve_model_source(path: str) -> ModelSource:
    """A qarl run (its newest checkpoint), a checkpoint, or a Hugging Face model directory."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigError(f"model {path!r} does not exist")
    from qarl.checkpoint import checkpoint_format
    from qarl.run_dir import resolve_checkpoint

    if is_run_or_checkpoint(p):
        checkpoint = resolve_checkpoint(p)
        if (checkpoint / "lora.json").is_file():
            raise ConfigError(f"{checkpoint} is a LoRA adapter; qarl matrix and qarl diagnose read whole models. "
                              f"Merge it first: qarl export {checkpoint} --dequantized --out DIR, and give DIR")
        return ModelSource(path, str(checkpoint / "policy"), checkpoint, checkpoint_format(checkpoint))
    if (p / "config.json").is_file():
        return ModelSource(path, str(p))
    raise ConfigError(f"model {path!r} is neither a qarl run/checkpoint nor a Hugging Face model directory")


def _stages(source: ModelSource) -> list[tuple[str, RecipeConfig]]:
    """The recipe of `source`'s run, then of each run it started from, where its policy.model_name names another
    run's checkpoint (a pipeline's later stage: QA-GRPO from a QAD checkpoint, itself from the base), as (the run,
    its recipe); empty for a model no qarl run made."""
    from qarl.run_dir import named_checkpoint

    stages: list[tuple[str, RecipeConfig]] = []
    run, checkpoint, visited = source.path, source.checkpoint, set()
    while checkpoint is not None and checkpoint.resolve() not in visited:
        visited.add(checkpoint.resolve())
        config = checkpoint.parent.parent / "config.yaml"
        if not config.is_file():
            break
        stages.append((run, load_recipe(config, [], RecipeConfig)))
        run = stages[-1][1].policy.model_name
        path = Path(run).expanduser()
        if not path.exists() and path.parent.name == "checkpoints" and path.name.startswith("step_"):
            raise ConfigError(f"{stages[-1][0]} started from the checkpoint {run}, which is gone: the matrix cannot "
                              "tell which base its gain is over. Keep the earlier stage's run, or set matrix.base to "
                              "a model directory")
        checkpoint = named_checkpoint(run, hashes=False) if is_run_or_checkpoint(path) else None
    return stages


def _check_run(source: ModelSource, held_out: set[str], base_key: str | None) -> None:
    """A run, and each earlier stage it started from, must not have trained on the matrix's held-out prompts (a run
    of another task split has), and, when the base is the recipe's warm start, the first stage must have started
    from that very model."""
    from qarl.tasks import build_task
    from qarl.run import initial_model_key

    stages = _stages(source)
    tasks = [build_task(run_cfg.task, run_cfg.run.seed) for _, run_cfg in stages]
    for (run, _), task in zip(stages, tasks):
        seen = {p.prompt for p in task.train} & held_out
        if seen:
            raise ConfigError(f"{run} trained on {len(seen)} of the matrix's held-out prompts (e.g. "
                              f"{sorted(seen)[0]!r}): its task split differs. Train with the matrix recipe's task "
                              "(pin task.seed) or give the matrix that run's task settings.")
    if not stages or base_key is None:
        return
    first, first_cfg = stages[-1]
    if initial_model_key(first_cfg, tasks[-1]) != base_key:
        via = f" (the first stage of {source.path})" if first != source.path else ""
        raise ConfigError(f"{first}{via} did not start from the matrix's base (another model, warm start or "
                          "warm_start.seed): its gain would be measured against the wrong model. Pin "
                          "warm_start.seed in both, or set matrix.base to that run's starting model.")


def _architecture(model_dir: str, trust_remote_code: bool) -> dict:
    from transformers import AutoConfig

    from qarl.models.checks import load_pretrained

    config = load_pretrained(AutoConfig, model_dir, trust_remote_code).to_dict()
    return {k: v for k, v in config.items() if k not in CONFIG_KEYS_IGNORED}


PTQ_METHODS = ("default", "max", "mse", "awq_lite")  # the calibrations whose cells the engine serves exactly


def _check_settings(cfg: RecipeConfig) -> None:
    """The checks that need no library: they answer at once."""
    m = cfg.matrix
    unknown = [method for method in m.ptq_methods if method not in PTQ_METHODS]
    if unknown:
        raise ConfigError(f"matrix.ptq_methods {unknown}: choose among {PTQ_METHODS}")
    if "awq_lite" in m.ptq_methods and cfg.policy.generation.tensor_parallel_size > 1:
        raise ConfigError("AWQ's input scales are not sharded for a tensor-parallel engine: use "
                          "policy.generation.tensor_parallel_size=1 for the matrix, or drop awq_lite")
    if m.num_prompts < 1:
        raise ConfigError(f"matrix.num_prompts={m.num_prompts}: the held-out set is empty")
    earlier = Path(m.out).expanduser() / "matrix.json"
    if earlier.is_file() and not cfg.run.overwrite:
        raise ConfigError(f"matrix.out={m.out} holds an earlier matrix ({earlier}): give another matrix.out, or "
                          "run.overwrite=true to replace it")
    for name, paths in m.models.items():
        if not paths:
            raise ConfigError(f"matrix.models.{name} lists no model")
        if name == "base":
            raise ConfigError("matrix.models: 'base' names the base model (matrix.base); call the model otherwise")
        missing = [p for p in paths if not Path(p).expanduser().exists()]
        if missing:
            raise ConfigError(f"matrix.models.{name}: {missing[0]!r} does not exist")


def _precisions(cfg: RecipeConfig) -> list[Precision]:
    """The unquantized column, then every format x PTQ method, each column once."""
    from qarl.quant import resolve_format
    from qarl.quant.formats import with_calibration

    m = cfg.matrix
    precisions = [Precision(FULL)]
    for spec in m.formats:
        fmt = resolve_format(spec)
        if fmt is None:
            raise ConfigError("matrix.formats lists 'none'; the unquantized column is always there")
        for method in m.ptq_methods:
            precisions.append(Precision(f"{fmt.name} {method}", with_calibration(fmt, method)))
    _check_columns(precisions)
    return precisions


def _check_columns(precisions: list[Precision]) -> None:
    names = [p.name for p in precisions]
    fingerprints = [p.format.fingerprint() for p in precisions if p.format is not None]
    if len(set(names)) != len(names) or len(set(fingerprints)) != len(fingerprints):
        raise ConfigError(f"matrix columns repeat ({names}): list each format and PTQ method once, and give "
                          "formats distinct file names")


def plan_matrix(cfg: RecipeConfig) -> Plan:
    """Resolve and check the whole matrix: formats and methods, models, tokenizers, architectures, block
    sizes, the held-out split, each run's starting model. Every error surfaces here, before any model
    loads, the warm start runs (last) or the engine starts."""
    _check_settings(cfg)
    from qarl.models.checks import tokenizer_differences
    from qarl.models.resolve import resolve_model_dir
    from qarl.generation import check_expert_inputs, check_kv_cache
    from qarl.quant.ops import input_quant_plan
    from qarl.quant.quantize import check_format_fits
    from qarl.tasks import build_task, check_prompt_lengths, eval_splits, model_prompt_format
    from qarl.run import initial_model_dir, initial_model_key

    m = cfg.matrix
    precisions = _precisions(cfg)
    task = build_task(cfg.task, cfg.run.seed)
    if len(task.eval) < m.num_prompts:
        raise ConfigError(f"matrix.num_prompts={m.num_prompts} but the task has {len(task.eval)} held-out "
                          f"problems: raise task.num_eval (or lower matrix.num_prompts)")
    if task.transfer and len(task.transfer) < m.num_transfer_prompts:
        raise ConfigError(f"matrix.num_transfer_prompts={m.num_transfer_prompts} but the task's transfer split has "
                          f"{len(task.transfer)} problems: lower matrix.num_transfer_prompts (0: the test split only)")
    splits = eval_splits(task, m.num_prompts, m.num_transfer_prompts)
    models = {}
    for name, paths in m.models.items():
        models[name] = [resolve_model_source(p) for p in paths]
        trained = {s.trained_format.fingerprint() if s.trained_format else None for s in models[name]}
        if len(trained) > 1:
            raise ConfigError(f"the seeds of matrix.models.{name} were trained in different formats (or some "
                              "unquantized): a row averages seeds of one recipe")
    warm = m.base == WARM_START
    base = None if warm else resolve_model_source(m.base)
    # the warm start keeps its base's tokenizer and architecture: check against the base before making it
    base_dir = resolve_model_dir(cfg.policy.model_name) if warm else base.model_dir
    trust = cfg.policy.trust_remote_code
    held_out = {p.prompt for problems in splits.values() for p in problems}
    base_key = initial_model_key(cfg, task) if warm else None
    reference = _architecture(base_dir, trust)
    for name, sources in models.items():
        for source in sources:
            _check_run(source, held_out, base_key)
            problems_found = tokenizer_differences(base_dir, source.model_dir, trust)
            if problems_found:
                raise ConfigError(f"matrix model {source.path} does not share the base's tokenizer "
                                  f"({base_dir}): {'; '.join(problems_found)}. The matrix compares models "
                                  "trained from one base on one task.")
            if _architecture(source.model_dir, trust) != reference:
                raise ConfigError(f"matrix model {source.path} has another architecture than the base "
                                  f"({base_dir}); the matrix compares models trained from one base")
    trained_precision = {}
    for name, sources in models.items():  # a trained format is a PTQ column too: the base's "trained" counterpart
        fmt = sources[0].trained_format
        if fmt is None:
            continue
        column = next((p for p in precisions if p.format is not None
                       and p.format.fingerprint() == fmt.fingerprint()), None)
        if column is None:
            column = Precision(f"{fmt.name} {fmt.algorithm if isinstance(fmt.algorithm, str) else 'default'}", fmt)
            precisions.append(column)
        trained_precision[name] = column.name
    _check_columns(precisions)
    if trained_precision:
        precisions.append(Precision(TRAINED, trained=True))
    precisions += _export_columns(cfg, models)
    for precision in precisions:
        if precision.format is not None:
            check_format_fits(base_dir, precision.format, trust)
            engine_plan = input_quant_plan(base_dir, precision.format, trust)  # what the engine can serve
            check_expert_inputs(engine_plan, precision.format)
            check_kv_cache(base_dir, engine_plan, precision.format, False, cfg.policy.dtype,
                           allow_mismatch=cfg.policy.generation.allow_quant_mismatch)
    prompts = model_prompt_format(base_dir, cfg.task, trust)
    check_prompt_lengths(prompts, splits, cfg.policy.generation)  # before any model loads
    if warm:
        base = ModelSource(WARM_START, initial_model_dir(cfg, task))
    return Plan(cfg, splits, prompts, task.calibration_texts(cfg.policy.quant_calib_size, prompts),
                {"base": [base], **models}, precisions, trained_precision)


# -- evaluation --------------------------------------------------------------------------------------
def _policy(plan: Plan, source: ModelSource, precision: Precision):
    from qarl.checkpoint import load_policy_checkpoint
    from qarl.policy import build_policy

    if precision.trained:
        return load_policy_checkpoint(source.checkpoint, plan.cfg.policy)
    return build_policy(plan.cfg.policy, plan.calibration, model_dir=source.model_dir, fmt=precision.format)


def _export_columns(cfg: RecipeConfig, models: dict[str, list[ModelSource]]) -> list[Precision]:
    """A column per export target of matrix.exports that some trained row's format fits."""
    from qarl.export.targets import load_target

    columns = []
    for spec in cfg.matrix.exports:
        target = load_target(spec)
        if not any(_writes(target, sources[0]) for sources in models.values()):
            raise ConfigError(f"matrix.exports: target {target.name} writes no trained row's format")
        columns.append(Precision(f"exported {target.name}", trained=True, export=target))
    return columns


def _writes(target: Any, source: ModelSource) -> bool:
    """Whether export `target` writes the format `source` was trained in (an unquantized row: never)."""
    from qarl.export.targets import check_target_matches

    if source.trained_format is None:
        return False
    try:
        check_target_matches(source.trained_format, target)
    except ConfigError:
        return False
    return True


def _exported(plan: Plan, name: str, index: int, source: ModelSource, precision: Precision, rewards: Any
              ) -> tuple[dict[str, EvalResult], dict[str, int]]:
    """`source`'s checkpoint exported to the column's target, then evaluated in an engine started from the export
    (vLLM's own low-precision kernels, in the trained format: qarl/generation/served_export.py; no fake quantization,
    no refit); the results per split, and the kernels that computed its linear layers."""
    from qarl.evaluate import evaluate_splits
    from qarl.export import export_checkpoint
    from qarl.generation import VLLMEngine

    out = Path(plan.cfg.matrix.out) / "exports" / f"{name}_{index}_{precision.export.name}"
    export_checkpoint(source.checkpoint, precision.export, out, overwrite=True)
    engine = VLLMEngine(out, plan.generation, plan.cfg.policy.dtype, plan.cfg.run.seed)
    try:
        return evaluate_splits(engine, plan.prompts, plan.splits, rewards), engine.served_kernels
    finally:
        engine.close()


Results = dict[str, dict[str, dict[str, list["EvalResult"]]]]  # {split: {model: {precision: one per seed}}}
Kernels = dict[str, dict[str, int]]  # {exported column: {vLLM kernel: linear layers, over its models and seeds}}


def evaluate_matrix(plan: Plan) -> tuple[Results, Kernels]:
    """{split: {model: {precision: one EvalResult per seed}}}, every split of a cell in one batch, the cells grouped
    by the engine's format (one switch each): the trained column first, by trained format, then precision by
    precision; and the vLLM kernels each exported column was served with."""
    from qarl.console import progress_bar
    from qarl.evaluate import evaluate_splits
    from qarl.generation import VLLMEngine
    from qarl.rewards import WeightedRewards

    cfg = plan.cfg
    rewards = WeightedRewards.from_specs(cfg.trainer.rewards, cfg.trainer.reward_error)
    cells = []  # (engine format, model, source, precision), grouped by engine format
    for precision in plan.precisions:
        for name, sources in plan.models.items():
            for source in sources:
                if precision.export is not None:
                    continue  # evaluated apart, each in an engine of its own (below)
                if not precision.trained:
                    if precision.format is None or source.trained_format is None:  # a row trained quantized is
                        cells.append((precision.format, name, source, precision))  # asked in its own format only
                elif source.trained_format is not None:
                    cells.append((source.trained_format, name, source, precision))
    # trained cells first: a checkpoint that cannot load fails before the long part
    cells.sort(key=lambda c: (not c[3].trained, c[0].fingerprint() if c[0] is not None else ""))
    results: Results = {split: {name: {} for name in plan.models} for split in plan.splits}

    def add(name: str, precision: Precision, by_split: dict[str, EvalResult]) -> None:
        for split, result in by_split.items():
            results[split][name].setdefault(precision.name, []).append(result)

    engine = VLLMEngine(plan.models["base"][0].model_dir, plan.generation, cfg.policy.dtype, cfg.run.seed,
                        quant_format=cells[0][0])  # grouped by format: a graph engine restarts once per format
    for fmt, name, source, precision in progress_bar(cells, desc="matrix cells", unit="cell"):
        engine.set_quant_format(fmt)  # the same format again changes nothing
        policy = _policy(plan, source, precision)
        engine.refit(policy.model)
        add(name, precision, evaluate_splits(engine, plan.prompts, plan.splits, rewards))
    exports = [p for p in plan.precisions if p.export is not None]
    if exports:
        engine.close()  # one engine at a time: each export starts its own
    kernels: Kernels = {}
    for precision in exports:
        for name, sources in plan.models.items():
            for index, source in enumerate(sources):
                if _writes(precision.export, source):
                    by_split, served = _exported(plan, name, index, source, precision, rewards)
                    add(name, precision, by_split)
                    kernels.setdefault(precision.name, Counter()).update(served)
    return results, kernels


# -- the report --------------------------------------------------------------------------------------
def _hygiene(results: list[EvalResult]) -> dict[str, float | None]:
    rows = [r.hygiene() for r in results]
    return {k: (None if rows[0][k] is None else sum(r[k] for r in rows) / len(rows)) for k in rows[0]}


def summarize(plan: Plan, results: Results) -> dict[str, Any]:
    """The report as one JSON-able dict: the columns, the models, the row shares are of (`reference`), and per split
    (`splits`: "test", "transfer") accuracy, gain and survival with their SEs, per-seed numbers, hygiene, shares and
    the paired tests."""
    reference = _share_reference(plan)
    return {"precisions": [p.name for p in plan.precisions],
            "models": {m: {"sources": [s.path for s in sources], "seeds": len(sources),
                           "checkpoints": [str(s.checkpoint) if s.checkpoint else None for s in sources],
                           "trained_format": (sources[0].trained_format.name if sources[0].trained_format else None)}
                       for m, sources in plan.models.items()},
            "reference": reference,
            "splits": {split: _split_report(plan, by_model, reference) for split, by_model in results.items()}}


def _split_report(plan: Plan, results: dict[str, dict[str, list[EvalResult]]], reference: str | None
                  ) -> dict[str, Any]:
    """One split's tables: {model: {precision: ...}} for accuracy, gain, survival, the shares, and the paired tests."""
    scores = {m: {p: per_prompt(r) for p, r in cells.items()} for m, cells in results.items()}
    base = scores["base"]
    report: dict[str, Any] = {"num_prompts": len(base[FULL]), "accuracy": {}, "gain": {}, "survival": {}}
    for m, cells in results.items():
        report["accuracy"][m] = {}
        for p, per_seed in cells.items():
            mean, se = mean_and_se(scores[m][p])
            report["accuracy"][m][p] = {"mean": mean, "se": se, "per_seed": [r.accuracy for r in per_seed],
                                        **_hygiene(per_seed)}
        if m == "base":
            continue
        report["gain"][m], report["survival"][m] = {}, {}
        for p in cells:
            base_p = plan.trained_precision[m] if p == TRAINED or p.startswith("exported ") else p
            g, g_se = gain(scores[m][p], base[base_p])
            report["gain"][m][p] = {"mean": g, "se": g_se}
            if p == FULL:
                continue
            s, s_se = survival(scores[m][p], base[base_p], scores[m][FULL], base[FULL])
            seeds = [survival(*(per_prompt([r]) for r in (cells[p][i], results["base"][base_p][0], cells[FULL][i],
                                                            results["base"][FULL][0])))[0] for i in range(len(cells[p]))]
            seed_sd = (math.sqrt(sum((x - s) ** 2 for x in seeds) / (len(seeds) - 1)) if len(seeds) > 1 else None)
            report["survival"][m][p] = {"mean": s, "se": s_se, "per_seed": seeds, "seed_sd": seed_sd}
    report["share"], report["ptq_relative_share"] = _shares(report["accuracy"], report["gain"], reference)
    report["paired"] = paired_comparisons(plan, results, scores)
    return report


def _share_reference(plan: Plan) -> str | None:
    """The row whose gain the shares are of: the one trained row that is not quantized (GRPO in bf16); None where
    there is not exactly one."""
    unquantized = [m for m, sources in plan.models.items() if m != "base" and sources[0].trained_format is None
                   and sources[0].checkpoint is not None]
    return unquantized[0] if len(unquantized) == 1 else None


def _shares(accuracy: dict[str, dict[str, dict]], gains: dict[str, dict[str, dict]], reference: str | None
            ) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
    """The share of GRPO's gain, one definition everywhere: a cell's gain over the unquantized base, over the
    reference row's (GRPO in bf16) gain over the unquantized base,
        share(m, p) = (acc(m, p) - acc(base, full)) / (acc(ref, full) - acc(base, full));
    and, under its own name, the PTQ-relative share: the cell's `gain` (over the base at the same precision; the
    trained column: over the base's PTQ in that format) over the same denominator. Empty without a reference or where
    it gained nothing."""
    if reference is None or accuracy[reference][FULL]["mean"] == accuracy["base"][FULL]["mean"]:
        return {}, {}
    base = accuracy["base"][FULL]["mean"]
    full_gain = accuracy[reference][FULL]["mean"] - base
    share = {m: {p: (cell["mean"] - base) / full_gain for p, cell in cells.items()} for m, cells in accuracy.items()}
    relative = {m: {p: cell["mean"] / full_gain for p, cell in cells.items()} for m, cells in gains.items()}
    return share, relative


def _cell_format(plan: Plan, model: str, precision: str) -> str | None:
    """The fingerprint of the format a cell is evaluated in (None: unquantized)."""
    column = next(p for p in plan.precisions if p.name == precision)
    fmt = plan.models[model][0].trained_format if column.trained else column.format
    return fmt.fingerprint() if fmt is not None else None


def paired_comparisons(plan: Plan, results: dict[str, dict[str, list[EvalResult]]],
                       scores: dict[str, dict[str, list[float]]]) -> list[dict[str, Any]]:
    """Every pair of cells (model, precision) of a split, the later cell as `a` (a trained row against the base,
    QA-GRPO against GRPO): `paired_test` over the shared prompts, and whether both cells are in one format
    (`same_format`: the comparisons matrix.md lists, with those against the unquantized base)."""
    order = [p.name for p in plan.precisions]
    cells = [(m, p) for m, by_precision in results.items() for p in order if p in by_precision]
    pairs = []
    for j, (model_a, precision_a) in enumerate(cells):
        for model_b, precision_b in cells[:j]:
            test = paired_test(scores[model_a][precision_a], scores[model_b][precision_b],
                               len(results[model_a][precision_a]), len(results[model_b][precision_b]))
            pairs.append({"a": [model_a, precision_a], "b": [model_b, precision_b], **test, "same_format":
                          _cell_format(plan, model_a, precision_a) == _cell_format(plan, model_b, precision_b)})
    return pairs


def _points(value: float, se: float, signed: bool = False) -> str:
    return f"{100 * value:+.1f} ± {100 * se:.1f}" if signed else f"{100 * value:.1f} ± {100 * se:.1f}"


def markdown(report: dict[str, Any]) -> str:
    """The tables of every split: accuracy, gain over the base, gain survival, the shares of GRPO's gain, evaluation
    hygiene, paired comparisons; the kernels vLLM served the exports with."""
    precisions = report["precisions"]
    header = "| model | " + " | ".join(precisions) + " |\n|---|" + "---|" * len(precisions)

    def label(m: str) -> str:
        info = report["models"][m]
        notes = [n for n in (info["trained_format"], f"{info['seeds']} seeds" if info["seeds"] > 1 else None) if n]
        return f"{m} ({', '.join(notes)})" if notes else m

    def table(rows: dict[str, dict[str, Any]], signed: bool = False, extra: str = "") -> str:
        lines = [header]
        for m, cells in rows.items():
            row = []
            for p in precisions:
                c = cells.get(p)
                if isinstance(c, float):  # a share
                    row.append(f"{100 * c:.0f} %")
                    continue
                text = _points(c["mean"], c["se"], signed) if c else "–"
                if c and extra and c.get(extra) is not None:
                    text += f" (sd {100 * c[extra]:.1f})"
                row.append(text)
            lines.append(f"| {label(m)} | " + " | ".join(row) + " |")
        return "\n".join(lines)

    def hygiene(split: dict[str, Any]) -> str:
        lines = ["| model | precision | accuracy | parse rate | truncated | stopped (EOS) | mean length |",
                 "|---|---|---|---|---|---|---|"]
        for m, cells in split["accuracy"].items():
            for p in precisions:
                c = cells.get(p)
                if c:
                    parse = f"{100 * c['parse_rate']:.1f}" if c["parse_rate"] is not None else "n/a"
                    lines.append(f"| {m} | {p} | {100 * c['mean']:.1f} | {parse} | {100 * c['truncation_rate']:.1f} | "
                                 f"{100 * c['stop_rate']:.1f} | {c['mean_length']:.2f} |")
        return "\n".join(lines)

    def paired(split: dict[str, Any]) -> str:
        lines = ["| A | B | A − B (points) | 95 % interval | p | test |", "|---|---|---|---|---|---|"]
        for c in split["paired"]:
            if c["same_format"] or c["b"] == ["base", FULL]:
                low, high = c["ci95"]
                lines.append(f"| {', '.join(c['a'])} | {', '.join(c['b'])} | {100 * c['difference']:+.1f} | "
                             f"{100 * low:+.1f} to {100 * high:+.1f} | {c['p']:.2g} | {c['test']} |")
        return "\n".join(lines)

    reference, parts = report["reference"], []
    for name, split in report["splits"].items():
        n = split["num_prompts"]
        parts += [f"## The {name} split ({n} prompts)",
                  f"### Held-out accuracy (%, greedy, n = {n} prompts, ± SE: binomial for one seed, over prompts for "
                  "seed means)", table(split["accuracy"])]
        if split["gain"]:  # a base alone: its PTQ columns only
            parts += ["### Gain over the base at the same precision (points, ± paired SE; *trained*: vs the base's "
                      "PTQ in that format)", table(split["gain"], signed=True),
                      "### Gain survival: gain at the precision minus gain unquantized (points, ± paired SE; sd: "
                      "across seeds)", table(split["survival"], signed=True, extra="seed_sd")]
        if split["share"]:
            parts += [f"### Share of {reference}'s gain: (accuracy - the base's unquantized accuracy) / "
                      f"({reference}'s unquantized accuracy - the base's)", table(split["share"]),
                      f"### PTQ-relative share (not the share): gain over the base at the same precision (*trained*: "
                      f"the base's PTQ in that format) / {reference}'s unquantized gain",
                      table(split["ptq_relative_share"])]
        parts += ["### Evaluation hygiene (%, mean over seeds)", hygiene(split)]
        if len(split["accuracy"]) > 1 or len(precisions) > 1:
            parts += ["### Paired comparisons (A − B on the same prompts, each prompt's result averaged over a row's "
                      "seeds; 95 % paired-bootstrap interval over prompts; p: exact sign-flip test, mid-p, McNemar's "
                      "with one seed a row). Pairs in one format and against the unquantized base; every pair: "
                      "matrix.json", paired(split)]
    if report.get("served_kernels"):
        parts += ["## The exports' kernels (vLLM's, for their linear layers: layers over models and seeds)",
                  "\n".join(f"- {column}: " + ", ".join(f"{kernel} ({layers})" for kernel, layers in kernels.items())
                            for column, kernels in report["served_kernels"].items())]
    return "\n\n".join(parts)


def plot(report: dict[str, Any], out: Path) -> Path:
    """Per split (a row of panels): accuracy per precision and model (left) and gain survival (right), with SE
    error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    precisions, splits = report["precisions"], report["splits"]
    keys = ["accuracy", "survival"] if any(split["survival"] for split in splits.values()) else ["accuracy"]
    fig, axes = plt.subplots(len(splits), len(keys), figsize=(7 * len(keys), 4.6 * len(splits)), squeeze=False)
    for row, (name, split) in zip(axes, splits.items()):
        for ax, key in zip(row, keys):
            columns = precisions if key == "accuracy" else [p for p in precisions if p != FULL]
            models = list(split[key])
            width = 0.8 / max(len(models), 1)
            for i, m in enumerate(models):
                xs = [j + (i - (len(models) - 1) / 2) * width for j, p in enumerate(columns) if p in split[key][m]]
                cells = [split[key][m][p] for p in columns if p in split[key][m]]
                ax.bar(xs, [100 * c["mean"] for c in cells], width, yerr=[100 * c["se"] for c in cells], capsize=2,
                       label=m, color=f"C{list(report['models']).index(m)}")  # one color per model in every panel
            ax.set_xticks(range(len(columns)))
            ax.set_xticklabels(columns, rotation=30, ha="right", fontsize=8)
            ax.grid(axis="y", alpha=0.3)
            ax.axhline(0, color="black", lw=0.6)
            ax.set_title(f"{name}: accuracy (%), n = {split['num_prompts']}" if key == "accuracy" else
                         f"{name}: gain survival, Δ at precision − Δ unquantized (points)", fontsize=10)
    axes[0][0].legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def run_matrix(cfg: RecipeConfig) -> tuple[dict[str, Any], Path]:
    """Plan (all checks), evaluate every cell, write matrix.json / matrix.md / matrix.png to matrix.out, which this
    process owns meanwhile (qarl/dir_lock.py: a second matrix into it is refused at once, naming this one)."""
    start = time.perf_counter()
    out = Path(cfg.matrix.out).expanduser()
    with owning(out / LOCK_FILE, f"matrix.out={cfg.matrix.out}", cfg.run.overwrite, "run.overwrite=true",
                "choose another matrix.out"):
        plan = plan_matrix(cfg)
        results, kernels = evaluate_matrix(plan)
        report = summarize(plan, results)
        report["served_kernels"] = kernels
        report["seconds"] = time.perf_counter() - start
        (out / "matrix.json").write_text(json.dumps(report, indent=1))
        (out / "matrix.md").write_text(markdown(report) + "\n")
        plot(report, out / "matrix.png")
    return report, out
