"""`memory/host_peak_rss_gib` in every metrics row: the process's peak resident memory so far, as the kernel counts it
(ru_maxrss), so that host memory growing with the batch shows in the run's own metrics (CPU runs, the host side of
GPU runs)."""

from __future__ import annotations

import os

import numpy as np

from qarl.metrics import HOST_PEAK_KEY, MetricsLog, host_peak_rss_gib, read_metrics


def test_every_row_carries_the_peak_and_it_follows_a_real_allocation(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl", resume_step=None)
    log.write({"step": 0, "reward/mean": 0.5})
    touched = np.ones(2**28 // 8)  # 256 MiB, every page written: resident
    resident_while_touched = _resident_gib()
    log.write({"step": 1})
    del touched
    log.write({"step": 2})
    log.close()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    peaks = [row[HOST_PEAK_KEY] for row in rows]
    assert len(peaks) == 3 and peaks[0] > 0.05
    assert peaks[1] >= resident_while_touched - 0.01  # at least what was resident then, the 256 MiB included
    assert peaks[2] >= peaks[1]  # a peak: freed memory does not lower it
    assert abs(host_peak_rss_gib() - peaks[2]) < 0.05


def _resident_gib() -> float:
    """This process's resident memory now (Linux /proc/self/statm: pages)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def test_a_row_that_measured_its_own_peak_keeps_it(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl", resume_step=None)
    log.write({"step": 0, HOST_PEAK_KEY: 1.25})
    assert read_metrics(tmp_path / "metrics.jsonl")[0][HOST_PEAK_KEY] == 1.25
