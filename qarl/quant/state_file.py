"""A checkpoint's quantizer state file: the calibrated amax, and which of ModelOpt's FP8 kernels they trained under.

ModelOpt's CPU and CUDA FP8 kernels round 448 / amax differently (`qarl.quant.codes.fp8_kernel_scale`), so the same
amax quantizes a weight, an input or a key to other codes on the two devices. A checkpoint records its kernel so that
an export on the other device writes the codes and scales the run trained and rolled out with.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from qarl.quant.codes import device_kernel
from qarl.quant.formats import QuantFormat, format_to_yaml

QUANTIZER_STATE = "quantizer_state.safetensors"
FP8_KERNEL = "fp8_kernel"  # its metadata key


def write_quant_state(out_dir: Path, state: dict[str, torch.Tensor], fmt: QuantFormat, device: torch.device) -> None:
    """The quantizer state (amax) and format of a policy that computes on `device`, into a checkpoint directory."""
    save_file(state, str(out_dir / QUANTIZER_STATE), metadata={FP8_KERNEL: device_kernel(device)})
    (out_dir / "quant_format.yaml").write_text(format_to_yaml(fmt))


def trained_fp8_kernel(checkpoint: Path) -> str | None:
    """The FP8 kernel ("cuda" or "cpu") a checkpoint's quantizers trained under; None: unquantized, or written
    before checkpoints recorded it."""
    path = checkpoint / QUANTIZER_STATE
    if not path.is_file():
        return None
    with safe_open(str(path), "pt") as f:
        return (f.metadata() or {}).get(FP8_KERNEL)
