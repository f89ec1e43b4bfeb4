"""Where prompts come from: the embedded arithmetic task, or a prompt dataset with answers."""

from __future__ import annotations

from pathlib import Path

from qarl.config import ConfigError, TaskConfig
from qarl.tasks.arithmetic import ArithmeticTask, Problem
from qarl.tasks.chat import (PromptFormat, check_prompt_lengths, model_prompt_format, prompt_format,
                             recipe_prompt_format)
from qarl.tasks.dataset import LOCAL_FORMATS, DatasetTask

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


def sample_answer(cfg: TaskConfig, seed: int) -> str:
    """The first training problem's answer where it is known before anything heavy loads (the embedded task, a local
    JSON Lines, JSON or CSV file), else a number: what the rewards are called on once before a run
    (qarl/rewards.py `WeightedRewards.check_on_sample`)."""
    if cfg.name == "dataset" and Path(cfg.train_data).suffix not in LOCAL_FORMATS:
        return "42"
    return build_task(cfg, seed).train[0].answer


__all__ = ["ArithmeticTask", "DatasetTask", "Problem", "PromptFormat", "Task", "build_task", "check_prompt_lengths",
           "model_prompt_format", "prompt_format", "recipe_prompt_format", "sample_answer"]
