"""A prompt dataset with reference answers: local JSON Lines, JSON or CSV files (read directly), parquet files or
a hub name (through `datasets`)."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import TYPE_CHECKING

from qarl.config import ConfigError, TaskConfig
from qarl.tasks.arithmetic import Problem

if TYPE_CHECKING:
    from qarl.tasks.chat import PromptFormat

LOCAL_FORMATS = (".jsonl", ".json", ".csv")  # read with the standard library: no `datasets` needed (the GPU kit)


def _read_local(path: Path) -> list[dict]:
    """Rows of a JSON Lines, JSON (a list of objects) or CSV file."""
    if path.suffix == ".csv":
        with path.open(newline="") as f:
            return list(csv.DictReader(f))
    if path.suffix == ".json":
        rows = json.loads(path.read_text())
        return rows if isinstance(rows, list) else [rows]
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _read_with_datasets(source: str, path: Path) -> list[dict]:
    """Rows of a parquet file or a hub dataset, through `datasets`."""
    import datasets

    data = (datasets.load_dataset("parquet", data_files=str(path), split="train") if path.suffix == ".parquet"
            else datasets.load_dataset(source, split="train"))
    return list(data)


def check_data_files(cfg: TaskConfig) -> None:
    """A dataset task's local files, there before anything loads."""
    if cfg.name != "dataset":
        return
    if not cfg.train_data or not cfg.eval_data:
        raise ConfigError("task.name=dataset needs task.train_data and task.eval_data")
    for key, source in (("task.train_data", cfg.train_data), ("task.eval_data", cfg.eval_data),
                        *((("task.transfer_data", cfg.transfer_data),) if cfg.transfer_data else ())):
        path = Path(source).expanduser()
        if path.suffix in (*LOCAL_FORMATS, ".parquet") and not path.is_file():
            raise ConfigError(f"{key}={source}: dataset file not found")


def load_problems(source: str, prompt_column: str, answer_column: str) -> list[Problem]:
    """Rows of `source` as Problems; a missing file or column is a ConfigError that names it."""
    path = Path(source).expanduser()
    if path.suffix in (*LOCAL_FORMATS, ".parquet") and not path.is_file():
        raise ConfigError(f"dataset file not found: {source}")
    try:
        rows = _read_local(path) if path.suffix in LOCAL_FORMATS else _read_with_datasets(source, path)
    except Exception as e:
        raise ConfigError(f"dataset {source!r} could not be loaded ({type(e).__name__}: {e})") from None
    columns = list(rows[0]) if rows else []
    for column, key in ((prompt_column, "task.prompt_column"), (answer_column, "task.answer_column")):
        if column not in columns:
            raise ConfigError(f"dataset {source!r} has no column {column!r} (columns: {columns}); set {key}")
    return [Problem(prompt=str(r[prompt_column]), answer=str(r[answer_column])) for r in rows]


class DatasetTask:
    """Train, held-out and (optionally) transfer prompts from files; rewards come from trainer.rewards (e.g. gsm8k,
    boxed_math)."""

    name = "dataset"

    def __init__(self, cfg: TaskConfig):
        check_data_files(cfg)
        self.train = load_problems(cfg.train_data, cfg.prompt_column, cfg.answer_column)
        self.eval = load_problems(cfg.eval_data, cfg.prompt_column, cfg.answer_column)
        self.transfer = (load_problems(cfg.transfer_data, cfg.prompt_column, cfg.answer_column) if cfg.transfer_data
                         else [])
        seen = {p.prompt for p in self.train} & {p.prompt for p in self.transfer}
        if seen:
            raise ConfigError(f"task.transfer_data={cfg.transfer_data} repeats training prompts of task.train_data "
                              f"({len(seen)}, e.g. {sorted(seen)[0]!r}): a transfer split must be disjoint from training")

    def calibration_texts(self, n: int, prompts: PromptFormat | None = None) -> list[str]:
        """The training prompts, as `prompts` formats them (raw without)."""
        return [prompts.text(p.prompt) if prompts is not None else p.prompt for p in self.train[:n]]
