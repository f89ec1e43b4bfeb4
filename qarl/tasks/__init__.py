"""Where prompts come from: the embedded arithmetic task, or a prompt dataset with answers. A task has a train
split, a held-out test split and, optionally, a transfer split (held-out problems unlike the training ones)."""

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


def eval_splits(task: Task, num_test: int, num_transfer: int) -> dict[str, list[Problem]]:
    """The held-out splits an evaluation scores, by name: "test" (the first `num_test` held-out problems) and, where
    the task has a transfer split and `num_transfer` > 0, "transfer" (its first `num_transfer`)."""
    splits = {"test": task.eval[:num_test]}
    if task.transfer and num_transfer > 0:
        splits["transfer"] = task.transfer[:num_transfer]
    return splits


__all__ = ["ArithmeticTask", "DatasetTask", "Problem", "PromptFormat", "Task", "build_task", "eval_splits",
           "model_prompt_format", "prompt_format", "recipe_prompt_format"]
