"""`qarl.transfer`: the one-copy host-to-device transfer keeps each tensor's values and shape and refuses tensors of
mixed dtypes (a GPU copy would promote them silently; the GPU side is tests/integration/test_gpu_host_syncs.py), and
waits are named by their place in qarl's code."""

from __future__ import annotations

import traceback

import pytest
import torch

from qarl.transfer import frame_name, qarl_frame, to_device


def test_to_device_keeps_each_tensor_and_refuses_mixed_dtypes():
    tensors = [torch.arange(6).view(2, 3), torch.tensor([7]), torch.zeros(0, dtype=torch.long)]
    moved = to_device(tensors, torch.device("cpu"))
    assert all(torch.equal(a, b) and a.shape == b.shape and a.dtype == b.dtype for a, b in zip(moved, tensors))
    assert to_device([], torch.device("cpu")) == []
    with pytest.raises(ValueError, match="one dtype"):
        to_device([torch.zeros(2), torch.zeros(2, dtype=torch.long)], torch.device("cpu"))


def test_a_wait_is_named_by_its_place_in_qarl_and_outside_it():
    import qarl.scoring

    inside = traceback.FrameSummary(qarl.scoring.__file__, 12, "teacher_forced")
    outside = traceback.FrameSummary(torch.__file__, 3, "load")
    here = traceback.FrameSummary(__file__, 5, "test")  # a checkout's tests are not qarl's code
    assert frame_name(inside) == "qarl/scoring.py:12 teacher_forced"
    assert frame_name(outside) == "torch/__init__.py:3 load"
    assert qarl_frame([inside, here, outside]) == "qarl/scoring.py:12 teacher_forced"
    assert qarl_frame([here, outside]) == "torch/__init__.py:3 load"
