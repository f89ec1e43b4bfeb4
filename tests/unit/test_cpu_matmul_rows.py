"""The CPU engine's matmuls round as the policy's: the BLAS sums a short product (a decode step's few rows) in another
order than a tall one (the policy's scoring of a whole micro-batch: rows 1-11 of these products differ here), so the
engine computes short ones as tall (`vllm_compat.tall_linear`), and qarl sets MKL's strict reproducibility
(`MKL_CBWR`, qarl/__init__.py), without which MKL on two threads sums a 1024 x 256 product of 16-175 rows in yet another
order (the realistic Gemma 3's o_proj and down_proj: its CPU parity drifted). A machine whose BLAS still rounds some
row count up to 200 otherwise fails this test."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qarl.generation.vllm_compat import tall_linear

# SmolLM2's fused q/k/v and down projection; a tiny model's; the realistic Gemma 3's o/down_proj and Qwen2's down_proj
SHAPES = [(576, 960), (1536, 576), (64, 384), (1024, 256), (1024, 512)]


def test_short_cpu_matmuls_are_computed_as_the_rows_of_a_tall_one():
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # as the engine and the policy run (this tier's conftest runs one thread)
    try:
        for inputs, outputs in SHAPES:
            weight, bias, x = torch.randn(outputs, inputs), torch.randn(outputs), torch.randn(512, inputs)
            tall = F.linear(x, weight, bias)
            for rows in (*range(1, 200), 300, 511):
                assert torch.equal(tall_linear(x[:rows], weight, bias), tall[:rows]), (inputs, outputs, rows)
            assert torch.equal(F.linear(x[:300].view(10, 30, inputs), weight, bias).view(300, outputs), tall[:300])
    finally:
        torch.set_num_threads(threads)


def test_the_engines_start_up_probe_finds_the_rows_agree():
    """`short_matmuls_round_as_tall`, which an engine on CPU checks at its start (and warns, naming MKL_CBWR, where it
    fails: a program that multiplied before importing qarl), holds in a qarl process on two threads."""
    from qarl.generation.vllm_compat import short_matmuls_round_as_tall

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert short_matmuls_round_as_tall()
    finally:
        torch.set_num_threads(threads)
