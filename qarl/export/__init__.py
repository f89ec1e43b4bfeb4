"""Export a fake-quantized qarl policy as a real low-precision Hugging Face checkpoint (NVFP4, FP8).

    from qarl.export import export_checkpoint, verify_export
    summary = export_checkpoint("runs/x", "export/nvfp4_w4a16_modelopt.yaml", "out/x-nvfp4")
    report = verify_export("out/x-nvfp4")

The exported weights decode bit for bit to the weights the policy trained and rolled out with: see
qarl/export/encode.py for the contract and export/README.md for measurements.
"""

from qarl.export.core import export_checkpoint, export_policy
from qarl.export.encode import FidelityError
from qarl.export.targets import ExportTarget, load_target, shipped_targets
from qarl.export.verify import verify_export

__all__ = ["ExportTarget", "FidelityError", "export_checkpoint", "export_policy", "load_target",
           "shipped_targets", "verify_export"]
