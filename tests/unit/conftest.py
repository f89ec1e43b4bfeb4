"""The unit tier: pure functions and the tiny model in process, seconds each (tests/conftest.py holds the fixtures
every tier shares). Its tensors are small, so torch computes on one thread here: two threads gain nothing on them,
and on a machine whose other core is busy (a training run beside the tests) each of their parallel regions waits
for the descheduled thread, which made this tier ~8x slower (6 min instead of 45 s on 2 cores)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="package", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
