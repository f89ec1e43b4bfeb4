"""Which process of a torchrun world this is, for the few things one process does for all of them.

Under `torchrun` every process runs the same loop on its own shard (the Megatron backend's tensor parallelism)
and sees the same rollouts, rewards and losses; the main process (rank 0) alone writes the metrics, the plots
and the shared files of a checkpoint. Without torchrun, or before torch.distributed starts, this process is
the whole world.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main_process() -> bool:
    return rank() == 0


def local_device() -> torch.device:
    """This process's own device: under torchrun with CUDA the GPU of its local rank (`cuda:LOCAL_RANK`), else the
    CPU. A bare `torch.device("cuda")` is whichever GPU is current, GPU 0 on every rank until something calls
    `torch.cuda.set_device`: rank 1's inputs would land on GPU 0 and its model on GPU 1."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    local_rank, gpus = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
    if local_rank >= gpus:
        raise RuntimeError(f"local rank {local_rank} has no GPU of its own: this node sees {gpus} GPU(s); launch at "
                           f"most {gpus} processes a node (torchrun --nproc_per_node)")
    return torch.device("cuda", local_rank)


def barrier() -> None:
    """Wait for every process of the world (nothing to wait for in a world of one)."""
    if world_size() > 1:
        dist.barrier()


@contextmanager
def exclusive(lock_file: Path) -> Iterator[None]:
    """Hold an exclusive lock on `lock_file` (beside a cache entry): processes that share a cache (torchrun's
    ranks, two runs on one machine) make an entry one at a time, and the later ones find it made."""
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_file, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
