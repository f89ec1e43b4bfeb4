"""Which device a torchrun process computes on, without a GPU: CUDA is faked (availability, device count, the current
device), since what is tested is the choice of device, not the device. On two GPUs, rank 1 once built its inputs on
GPU 0 (a bare `torch.device("cuda")`) beside its model on GPU 1, and benchmarks/megatron_parity.py failed in the
embedding."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from qarl.distributed import local_device
from qarl.models.resolve import default_device
from tests.conftest import REPO



@pytest.fixture
def two_gpus(monkeypatch) -> list[torch.device]:
    """Local rank 1 of a node with two (fake) GPUs; the devices `torch.cuda.set_device` is asked for."""
    made_current: list[torch.device] = []
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", made_current.append)
    return made_current


def test_each_rank_computes_on_its_own_gpu(two_gpus):
    assert local_device() == default_device() == torch.device("cuda", 1)


def test_a_rank_without_a_gpu_of_its_own_is_refused(two_gpus, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(RuntimeError, match="local rank 2 has no GPU of its own"):
        local_device()


def test_without_cuda_every_rank_computes_on_the_cpu(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert local_device() == default_device() == torch.device("cpu")


def test_the_megatron_parity_benchmark_puts_rank_1s_inputs_on_gpu_1(two_gpus, monkeypatch):
    """The benchmark's token batch goes where rank 1's model goes, and that GPU is made current (for what allocates
    on `torch.cuda.current_device()`). The first move of a tensor ends the run before any model loads."""

    class Moved(Exception):
        pass

    def move(tensor: torch.Tensor, device: torch.device | str, *args: object, **kwargs: object) -> torch.Tensor:
        raise Moved(torch.device(device))

    spec = importlib.util.spec_from_file_location("megatron_parity", REPO / "benchmarks" / "megatron_parity.py")
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    monkeypatch.setattr(sys, "argv", ["megatron_parity.py", "--model", "embedded:tiny"])
    monkeypatch.setattr(torch.Tensor, "to", move)
    with pytest.raises(Moved) as moved:
        benchmark.main()
    assert moved.value.args[0] == torch.device("cuda", 1)
    assert two_gpus == [torch.device("cuda", 1)]
