"""Calibration data for the quantizers' amax: `policy.quant_calib_data` -> texts -> token batches."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from qarl.config import ConfigError, PolicyConfig
from qarl.tasks.dataset import CALIBRATION_BUILDERS


def load_calibration_texts(cfg: PolicyConfig, task_texts: list[str]) -> list[str]:
    """`quant_calib_data`: "task" (the task's prompts), a local file, or a datasets hub name."""
    source = cfg.quant_calib_data
    if source == "task":
        texts = task_texts
    else:
        path = Path(source).expanduser()
        try:
            import datasets

            if path.suffix in CALIBRATION_BUILDERS or path.exists():
                if not path.is_file():
                    raise ConfigError(f"calibration data file not found: {source}")
                data = datasets.load_dataset(CALIBRATION_BUILDERS.get(path.suffix, "json"), data_files=str(path),
                                             split="train")
            else:
                data = datasets.load_dataset(source, split="train")
        except ConfigError:
            raise
        except Exception as e:
            raise ConfigError(
                f"calibration data {source!r} could not be loaded ({type(e).__name__}: {e}). Use "
                "policy.quant_calib_data=task, a local .jsonl/.parquet/.txt file, or a reachable hub dataset."
            ) from None
        column = cfg.quant_calib_text_column if cfg.quant_calib_text_column in data.column_names else "text"
        if column not in data.column_names:
            raise ConfigError(
                f"calibration data {source!r} has no column {cfg.quant_calib_text_column!r} (columns: "
                f"{data.column_names}); set policy.quant_calib_text_column"
            )
        texts = [str(t) for t in data[column][: cfg.quant_calib_size]]
    texts = texts[: cfg.quant_calib_size]
    if not texts:
        raise ConfigError(f"calibration data {source!r} is empty")
    return texts


def calibration_batches(
    texts: list[str], tokenizer: PreTrainedTokenizerBase, cfg: PolicyConfig, device: torch.device,
    padding_side: str | None = None,
) -> Iterator[dict[str, torch.Tensor]]:
    """`texts` tokenized in batches of `cfg.quant_batch_size`, padded on the tokenizer's side (or `padding_side`)."""
    for start in range(0, len(texts), cfg.quant_batch_size):
        enc = tokenizer(
            texts[start : start + cfg.quant_batch_size],
            return_tensors="pt",
            padding=True,
            padding_side=padding_side or tokenizer.padding_side,
            truncation=True,
            max_length=cfg.quant_sequence_length,
        )
        yield {k: v.to(device) for k, v in enc.items()}
