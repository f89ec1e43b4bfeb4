"""Where prompts come from: the embedded arithmetic task, or a prompt dataset with answers. A task has a train
split, a held-out test split and, optionally, a transfer split (held-out problems unlike the training ones)."""

from __future__ import annotations

from pathlib import Path

from qarl.config import ConfigError, GenerationConfig, TaskConfig
from qarl.tasks.arithmetic import ArithmeticTask, Problem
from qarl.tasks.chat import PromptFormat, model_prompt_format, prompt_format, recipe_prompt_format
from qarl.tasks.dataset import LOCAL_FORMATS, DatasetTask, load_problems

Task = ArithmeticTask | DatasetTask


def build_task(cfg: TaskConfig, seed: int) -> Task:
    """The task of `cfg`; an arithmetic task draws its problems from `cfg.seed`, else from `seed` (run.seed)."""
    if cfg.name == "arithmetic":
        if cfg.op not in ArithmeticTask.OPS:
            raise ConfigError(f"task.op={cfg.op!r}; choose one of {ArithmeticTask.OPS}")
        try:
            return ArithmeticTask(op=cfg.op, num_digits=cfg.num_digits, num_train=cfg.num_train,
                                  num_eval=cfg.num_eval, seed=seed if cfg.seed is None else cfg.seed)
        except ValueError as e:  # too few distinct problems for the split asked
            raise ConfigError(str(e)) from None
    if cfg.name == "dataset":
        return DatasetTask(cfg)
    raise ConfigError(f"unknown task {cfg.name!r}; choose 'arithmetic' (embedded) or 'dataset'")


def eval_splits(task: Task, num_test: int, num_transfer: int) -> dict[str, list[Problem]]:
    """The held-out splits an evaluation scores, by name: "test" (the first `num_test` held-out problems) and, where
    the task has a transfer split and `num_transfer` > 0, "transfer" (its first `num_transfer`)."""
    splits = {"test": task.eval[:num_test]}
    if task.transfer and num_transfer > 0:
        splits["transfer"] = task.transfer[:num_transfer]
    return splits


def sample_answer(cfg: TaskConfig, seed: int) -> str:
    """The first training problem's answer where it is known before anything heavy loads (the embedded task, a local
    JSON Lines, JSON or CSV file), else a number: what the rewards are called on once before a run
    (qarl/rewards.py `WeightedRewards.check_on_sample`)."""
    if cfg.name != "dataset":
        return build_task(cfg, seed).train[0].answer
    if Path(cfg.train_data).suffix not in LOCAL_FORMATS:
        return "42"
    return load_problems(cfg.train_data, cfg.prompt_column, cfg.answer_column)[0].answer


def check_prompt_lengths(prompts: PromptFormat, splits: dict[str, list[Problem]], generation: GenerationConfig
                         ) -> dict[str, int]:
    """Every prompt of `splits` (name -> the problems a command will ask), in the model's tokens, fits the engine's
    window beside a whole completion: `max_model_len - max_new_tokens`. Checked once the tokenizer has read them and
    before the model loads; the engine would refuse such a prompt only when it is first sampled, possibly hours in.
    The refusal names the longest prompt (its file and line), how many are too long, and the keys to change. Returns
    each split's longest prompt, in tokens."""
    room = generation.max_model_len - generation.max_new_tokens
    longest = {}
    for split, problems in splits.items():
        lengths = [len(ids) for ids in prompts.batch([p.prompt for p in problems])]
        if not lengths:
            continue
        worst = max(range(len(lengths)), key=lengths.__getitem__)
        longest[split] = lengths[worst]
        if lengths[worst] > room:
            where = problems[worst].where or f"{split} problem {worst + 1}"
            too_long = sum(n > room for n in lengths)
            raise ConfigError(
                f"{too_long} of {len(lengths)} {split} prompts are longer than the {room} tokens "
                f"policy.generation.max_model_len={generation.max_model_len} leaves beside max_new_tokens="
                f"{generation.max_new_tokens}; the longest ({where}) is {lengths[worst]} tokens: raise "
                f"policy.generation.max_model_len to {lengths[worst] + generation.max_new_tokens}, lower "
                "policy.generation.max_new_tokens, or shorten those prompts")
    return longest


__all__ = ["ArithmeticTask", "DatasetTask", "Problem", "PromptFormat", "Task", "build_task", "check_prompt_lengths",
           "eval_splits", "model_prompt_format", "prompt_format", "recipe_prompt_format", "sample_answer"]
