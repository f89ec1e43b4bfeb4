"""Export a fake-quantized qarl policy as a real low-precision Hugging Face checkpoint (NVFP4, FP8).

    from qarl.export import export_checkpoint, verify_export
    summary = export_checkpoint("runs/x", "export/nvfp4_w4a16_modelopt.yaml", "out/x-nvfp4")
    report = verify_export("out/x-nvfp4")

The exported weights decode bit for bit to the weights the policy trained and rolled out with: see
qarl/quant/codes.py for the contract and export/README.md for measurements.
"""

from importlib import import_module
from typing import Any

# Imported on first use, so that `qarl --help` (which registers `qarl export` from qarl.export.cli) does
# not pay for torch and ModelOpt.
_WHERE = {"export_checkpoint": "core", "export_policy": "core", "FidelityError": "encode", "ExportTarget": "targets",
          "load_target": "targets", "shipped_targets": "targets", "verify_export": "verify"}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'qarl.export' has no attribute {name!r}")
    return getattr(import_module(f"qarl.export.{_WHERE[name]}"), name)
