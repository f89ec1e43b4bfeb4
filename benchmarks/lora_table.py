"""The LoRA table of docs/guides/lora.md: per run, trainable parameters, optimizer memory, refit bytes, mismatch,
held-out accuracy (quantized and not) and wall time.

    python benchmarks/lora_table.py NAME=RUN_DIR[:WALL_SECONDS] ...

Accuracy comes from `qarl eval` on the run's newest checkpoint (quantized: the engine synced with its
amax; unquantized: the same weights and adapter without quantizers).
"""

from __future__ import annotations

import sys
from pathlib import Path

from qarl.run_dir import latest_checkpoint
from qarl.evaluate import run_eval
from qarl.metrics import read_metrics


def trainable_params(checkpoint: Path) -> int:
    from safetensors.torch import load_file

    adapter = checkpoint / "adapter" / "adapter_model.safetensors"
    if adapter.is_file():
        return sum(t.numel() for t in load_file(str(adapter)).values())
    return sum(t.numel() for f in (checkpoint / "policy").glob("*.safetensors") for t in load_file(str(f)).values())


def row(name: str, run_dir: Path, wall: str) -> str:
    rows = read_metrics(run_dir / "metrics.jsonl")
    steps = [r for r in rows if "perf/refit_bytes" in r or "mismatch/kl" in r]
    refit = sum(r.get("perf/refit_bytes", 0.0) for r in steps) / max(len(steps), 1)
    mismatch = sum(r["mismatch/kl"] for r in steps) / max(len(steps), 1)
    start = next((r["eval/accuracy"] for r in rows if r.get("eval/accuracy") is not None), float("nan"))  # eval.every=0
    params = trainable_params(latest_checkpoint(run_dir))
    accuracy = run_eval(str(run_dir), [])
    quantized = accuracy.get("quantized", float("nan"))
    return (f"| {name} | {params:,} | {2 * 4 * params / 2**20:.2f} MiB | {refit / 2**10:,.0f} KiB | {mismatch:.1e} | "
            f"{start:.3f} -> {quantized:.3f} | {accuracy['unquantized']:.3f} | {wall} |")


def main(specs: list[str]) -> None:
    print("| run | trainable params | AdamW state | refit bytes / step | mismatch/kl | held-out acc. (quantized) "
          "| unquantized | wall time |")
    print("|---|---|---|---|---|---|---|---|")
    for spec in specs:
        name, _, rest = spec.partition("=")
        run_dir, _, wall = rest.partition(":")
        print(row(name, Path(run_dir), wall or "-"), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
