"""A prompt dataset with reference answers, loaded through `datasets` (local files or a hub name)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from qarl.config import ConfigError, TaskConfig
from qarl.tasks.arithmetic import Problem

if TYPE_CHECKING:
    from qarl.tasks.chat import PromptFormat

_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def load_problems(source: str, prompt_column: str, answer_column: str) -> list[Problem]:
    """Rows of `source` as Problems; a missing file or column is a ConfigError that names it."""
    import datasets

    path = Path(source).expanduser()
    try:
        if path.suffix in _BUILDERS:
            if not path.is_file():
                raise ConfigError(f"dataset file not found: {source}")
            data = datasets.load_dataset(_BUILDERS[path.suffix], data_files=str(path), split="train")
        else:
            data = datasets.load_dataset(source, split="train")
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"dataset {source!r} could not be loaded ({type(e).__name__}: {e})") from None
    for column, key in ((prompt_column, "task.prompt_column"), (answer_column, "task.answer_column")):
        if column not in data.column_names:
            raise ConfigError(f"dataset {source!r} has no column {column!r} (columns: {data.column_names}); set {key}")
    return [Problem(prompt=str(p), answer=str(a)) for p, a in zip(data[prompt_column], data[answer_column])]


class DatasetTask:
    """Train and held-out prompts from files; rewards come from trainer.rewards (e.g. gsm8k, boxed_math)."""

    name = "dataset"

    def __init__(self, cfg: TaskConfig):
        if not cfg.train_data or not cfg.eval_data:
            raise ConfigError("task.name=dataset needs task.train_data and task.eval_data")
        self.train = load_problems(cfg.train_data, cfg.prompt_column, cfg.answer_column)
        self.eval = load_problems(cfg.eval_data, cfg.prompt_column, cfg.answer_column)

    def calibration_texts(self, n: int, prompts: PromptFormat | None = None) -> list[str]:
        """The training prompts, as `prompts` formats them (raw without)."""
        return [prompts.text(p.prompt) if prompts is not None else p.prompt for p in self.train[:n]]
