"""Training on several nodes, simulated on this host: two torchrun agents, each one "node" of one process, meet at a
c10d rendezvous (as agents on two machines would, `docs/guides/megatron.md`) and train the Megatron backend's QA-GRPO
as one world of two data-parallel ranks (gloo), the vLLM engine spanning both. The run reports the world it found
(`-m slow`)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from qarl.metrics import read_metrics

from tests.loops import GRPO

# two short steps: one micro-batch per data-parallel rank, no evaluation
SHORT = ["trainer.steps=2", "trainer.batch_size=8", "trainer.micro_batch_size=4", "eval.every=0",
         "policy.backend=megatron", "policy.tensor_parallel_size=1"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # two ranks of one world in one agent: test_megatron_train.py (tp2); here torchrun's rendezvous
def test_two_nodes_train_as_one_world_and_report_it(tmp_path: Path):
    endpoint = f"127.0.0.1:{free_port()}"
    command = GRPO.command(tmp_path / "run", *SHORT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    logs = [tmp_path / f"node{node}.log" for node in (0, 1)]
    agents = []
    try:
        for node, log in enumerate(logs):
            with log.open("w") as out:
                agents.append(subprocess.Popen(
                    [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
                     "--nproc_per_node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, *command[1:]],
                    env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
        codes = [agent.wait(timeout=600) for agent in agents]
    finally:  # a node left waiting at the rendezvous or hung: its agent and workers
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
    output = "".join(log.read_text() for log in logs)
    assert codes == [0, 0], output[-4000:]
    host = socket.gethostname()
    assert output.count("world: ") == 1
    assert f"world: 2 processes on 2 nodes (hosts {host}, {host}), tensor parallel 1, data parallel 2\n" in output
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1]
    assert {k: v for k, v in rows[0].items() if k.startswith("world/")} == {
        "world/processes": 2, "world/nodes": 2, "world/tensor_parallel": 1, "world/data_parallel": 2}
    assert not any(k.startswith("world/") for k in rows[1])
