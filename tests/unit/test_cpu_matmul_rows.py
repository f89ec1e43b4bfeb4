"""The CPU engine's matmuls round as the policy's: the BLAS sums a short product (a decode step's few rows) in another
order than a tall one (the policy's scoring of a whole micro-batch: rows 1-11 of these products differ here), so the
engine computes short ones as tall (`vllm_compat.tall_linear`). A machine whose BLAS changes its order above
CPU_TALL_ROWS rows fails this test."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qarl.generation.vllm_compat import CPU_TALL_ROWS, tall_linear

SHAPES = [(576, 960), (1536, 576), (64, 384)]  # SmolLM2's fused q/k/v and down projection; a tiny model's


def test_short_cpu_matmuls_are_computed_as_the_rows_of_a_tall_one():
    torch.manual_seed(0)
    for inputs, outputs in SHAPES:
        weight, bias, x = torch.randn(outputs, inputs), torch.randn(outputs), torch.randn(512, inputs)
        tall = F.linear(x, weight, bias)
        for rows in (*range(1, CPU_TALL_ROWS + 2), 100, 511):
            assert torch.equal(tall_linear(x[:rows], weight, bias), tall[:rows]), (inputs, outputs, rows)
        assert torch.equal(F.linear(x[:300].view(10, 30, inputs), weight, bias).view(300, outputs), tall[:300])

