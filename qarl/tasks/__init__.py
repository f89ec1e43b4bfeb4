"""Tasks with verifiable rewards. The embedded default is arithmetic."""

from qarl.config import ConfigError, TaskConfig
from qarl.tasks.arithmetic import ArithmeticTask, Problem

TASKS = {"arithmetic": ArithmeticTask}


def build_task(cfg: TaskConfig, seed: int) -> ArithmeticTask:
    if cfg.name not in TASKS:
        raise ConfigError(f"unknown task {cfg.name!r}; choose one of {sorted(TASKS)}")
    return TASKS[cfg.name](num_digits=cfg.num_digits, num_train=cfg.num_train, num_eval=cfg.num_eval, seed=seed)


__all__ = ["ArithmeticTask", "Problem", "TASKS", "build_task"]
