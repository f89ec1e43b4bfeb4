"""A prompt dataset with reference answers: local JSON Lines, JSON or CSV files (read directly), parquet files or
a hub name (through `datasets`).

Local files are read and checked whole as the command starts (`check_data_files`, before any model), each problem
named by where it is: `FILE:LINE` of a JSON Lines or CSV file, `FILE item N` of a JSON list. An empty file, a
directory, bytes that are not UTF-8, a line that is not JSON, a row without its prompt or answer, or a null one is
one error that says where and what to change.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qarl.config import ConfigError, TaskConfig
from qarl.tasks.arithmetic import Problem

if TYPE_CHECKING:
    from qarl.tasks.chat import PromptFormat

LOCAL_FORMATS = (".jsonl", ".json", ".csv")  # read with the standard library: no `datasets` needed (the GPU kit)
FILE_FORMATS = (*LOCAL_FORMATS, ".parquet")
# policy.quant_calib_data's files, by suffix: the `datasets` builder that reads each (qarl/calibration.py)
CALIBRATION_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text", ".csv": "csv"}


def is_local_file(source: str) -> bool:
    """Whether a data source names a file (by its suffix, or because it exists), not a hub dataset."""
    path = Path(source).expanduser()
    return path.suffix in FILE_FORMATS or path.exists()


def check_local_file(source: str, key: str) -> Path:
    """`source` (set by recipe key `key`) as a data file there to read: not missing, not a directory, not empty."""
    path = Path(source).expanduser()
    if path.is_dir():
        raise ConfigError(f"{key}={source} is a directory; name the data file itself ({', '.join(FILE_FORMATS)})")
    if not path.is_file():
        raise ConfigError(f"{key}={source}: dataset file not found")
    if path.stat().st_size == 0:
        raise ConfigError(f"{key}={source} is empty; a dataset file holds one row (a prompt and its answer) per "
                          "problem")
    return path


def _utf8(path: Path) -> str:
    """The file's text; bytes that are not UTF-8 named by line and column."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line, line_start = data.count(b"\n", 0, e.start) + 1, data.rfind(b"\n", 0, e.start) + 1
        raise ConfigError(f"{path}:{line}:{e.start - line_start + 1}: byte 0x{data[e.start]:02x} is not UTF-8; save "
                          "the file as UTF-8") from None


def _json_rows(path: Path, text: str) -> list[tuple[str, Any]]:
    """(where, row) of a JSON Lines file (an object per line) or a JSON file (a list of objects, or one object)."""
    if path.suffix == ".json":
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{e.lineno}:{e.colno}: not JSON ({e.msg}); a .json dataset is a list of "
                              "objects") from None
        rows = rows if isinstance(rows, list) else [rows]
        return [(f"{path} item {i}", row) for i, row in enumerate(rows, 1)]
    out = []
    for number, line in enumerate(text.split("\n"), 1):  # split("\n"): the line numbers an editor shows
        if not line.strip():
            continue
        try:
            out.append((f"{path}:{number}", json.loads(line)))
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{number}:{e.colno}: not JSON ({e.msg}); each line of a .jsonl file is one "
                              "JSON object") from None
    return out


def _csv_rows(path: Path, text: str) -> list[tuple[str, Any]]:
    """(where, row) of a CSV file with a header line; a cell missing at a row's end reads as None."""
    reader = csv.DictReader(io.StringIO(text, newline=""))
    return [(f"{path}:{reader.line_num}", row) for row in reader]


def _read_local(path: Path) -> list[tuple[str, Any]]:
    text = _utf8(path)
    return _csv_rows(path, text) if path.suffix == ".csv" else _json_rows(path, text)


def _read_with_datasets(source: str, path: Path) -> list[tuple[str, Any]]:
    """(where, row) of a parquet file or a hub dataset, through `datasets`."""
    import datasets

    try:
        data = (datasets.load_dataset("parquet", data_files=str(path), split="train") if path.suffix == ".parquet"
                else datasets.load_dataset(source, split="train"))
    except Exception as e:
        raise ConfigError(f"dataset {source!r} could not be loaded ({type(e).__name__}: {e})") from None
    return [(f"{source} row {i}", row) for i, row in enumerate(data, 1)]


def _problem(where: str, row: Any, prompt_column: str, answer_column: str, source: str, first: bool) -> Problem:
    """One row as a Problem: an object whose prompt and answer are text or numbers, neither null nor missing."""
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: a row is an object with {prompt_column!r} and {answer_column!r}, not "
                          f"{type(row).__name__} {str(row)[:40]!r}")
    texts = []
    for column, key in ((prompt_column, "task.prompt_column"), (answer_column, "task.answer_column")):
        if column not in row:
            if first:
                raise ConfigError(f"dataset {source!r} has no column {column!r} (columns: {list(row)}); set {key}")
            raise ConfigError(f"{where}: this row has no {column!r} ({key}); every row needs a prompt and an answer")
        value = row[column]
        if value is None:
            raise ConfigError(f"{where}: {column!r} has no value (null, or an empty CSV cell at the row's end); give "
                              "every row a prompt and an answer, or drop the row")
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{where}: {column!r} is a {type(value).__name__} ({str(value)[:40]!r}); a prompt or "
                              "answer is text (or a number)")
        texts.append(str(value))
    return Problem(prompt=texts[0], answer=texts[1], where=where)


def load_problems(source: str, prompt_column: str, answer_column: str, key: str = "task.train_data") -> list[Problem]:
    """Rows of `source` (set by recipe key `key`) as Problems, every row checked; each fault is a ConfigError that
    names the file, the line (or item) and the fix."""
    path = Path(source).expanduser()
    if is_local_file(source):
        check_local_file(source, key)
    rows = _read_local(path) if path.suffix in LOCAL_FORMATS else _read_with_datasets(source, path)
    if not rows:
        raise ConfigError(f"{key}={source} holds no rows; a dataset file holds one row (a prompt and its answer) per "
                          "problem")
    return [_problem(where, row, prompt_column, answer_column, source, i == 0) for i, (where, row) in enumerate(rows)]


def _sources(cfg: TaskConfig) -> tuple[tuple[str, str], ...]:
    """(recipe key, source) of the train and held-out data, both required, and of the transfer data where set."""
    if not cfg.train_data or not cfg.eval_data:
        raise ConfigError("task.name=dataset needs task.train_data and task.eval_data")
    transfer = (("task.transfer_data", cfg.transfer_data),) if cfg.transfer_data else ()
    return ("task.train_data", cfg.train_data), ("task.eval_data", cfg.eval_data), *transfer


def check_data_files(cfg: TaskConfig) -> None:
    """A dataset task's local files, read and checked whole before anything loads (the CLI, in well under a second
    for a GSM8K-sized file); parquet files and hub datasets are checked as they load, through `datasets`."""
    if cfg.name != "dataset":
        return
    local = [(key, source, check_local_file(source, key)) for key, source in _sources(cfg) if is_local_file(source)]
    loaded = {key: load_problems(source, cfg.prompt_column, cfg.answer_column, key)  # every file there before any
              for key, source, path in local if path.suffix in LOCAL_FORMATS}      # is read
    if "task.train_data" in loaded and "task.transfer_data" in loaded:
        check_transfer_disjoint(cfg, loaded["task.train_data"], loaded["task.transfer_data"])


def check_transfer_disjoint(cfg: TaskConfig, train: list[Problem], transfer: list[Problem]) -> None:
    """A transfer split measures problems unlike the training ones: none of its prompts may be a training prompt."""
    seen = {p.prompt for p in train} & {p.prompt for p in transfer}
    if seen:
        raise ConfigError(f"task.transfer_data={cfg.transfer_data} repeats training prompts of task.train_data "
                          f"({len(seen)}, e.g. {sorted(seen)[0]!r}): a transfer split must be disjoint from "
                          "training")


def check_calibration_file(source: str) -> None:
    """`policy.quant_calib_data` naming a local file: there, a file, not empty, before anything loads (its texts are
    read through `datasets` when the policy is calibrated)."""
    path = Path(source).expanduser()
    if source != "task" and (path.suffix in CALIBRATION_BUILDERS or path.exists()):
        check_local_file(source, "policy.quant_calib_data")


class DatasetTask:
    """Train, held-out and (optionally) transfer prompts from files; rewards come from trainer.rewards (e.g. gsm8k,
    boxed_math)."""

    name = "dataset"

    def __init__(self, cfg: TaskConfig):
        loaded = {key: load_problems(source, cfg.prompt_column, cfg.answer_column, key)
                  for key, source in _sources(cfg)}
        self.train, self.eval = loaded["task.train_data"], loaded["task.eval_data"]
        self.transfer = loaded.get("task.transfer_data", [])
        check_transfer_disjoint(cfg, self.train, self.transfer)

    def calibration_texts(self, n: int, prompts: PromptFormat | None = None) -> list[str]:
        """The training prompts, as `prompts` formats them (raw without)."""
        return [prompts.text(p.prompt) if prompts is not None else p.prompt for p in self.train[:n]]
