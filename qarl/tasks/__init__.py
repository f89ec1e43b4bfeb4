"""Where prompts come from: the embedded arithmetic task, or a prompt dataset with answers."""

from __future__ import annotations

from qarl.config import ConfigError, TaskConfig
from qarl.tasks.arithmetic import ArithmeticTask, Problem
from qarl.tasks.chat import PromptFormat, model_prompt_format, prompt_format, recipe_prompt_format
from qarl.tasks.dataset import DatasetTask

Task = ArithmeticTask | DatasetTask


def build_task(cfg: TaskConfig, seed: int) -> Task:
    """The task of `cfg`; an arithmetic task draws its problems from `cfg.seed`, else from `seed` (run.seed)."""
    if cfg.name == "arithmetic":
        if cfg.op not in ArithmeticTask.OPS:
            raise ConfigError(f"task.op={cfg.op!r}; choose one of {ArithmeticTask.OPS}")
        return ArithmeticTask(op=cfg.op, num_digits=cfg.num_digits, num_train=cfg.num_train, num_eval=cfg.num_eval,
                              seed=seed if cfg.seed is None else cfg.seed)
    if cfg.name == "dataset":
        return DatasetTask(cfg)
    raise ConfigError(f"unknown task {cfg.name!r}; choose 'arithmetic' (embedded) or 'dataset'")


__all__ = ["ArithmeticTask", "DatasetTask", "Problem", "PromptFormat", "Task", "build_task", "model_prompt_format",
           "prompt_format", "recipe_prompt_format"]
