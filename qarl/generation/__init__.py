"""The vLLM seam: the rollout engine and what it returns."""

from qarl.generation.packed_base import PackedBase, serves_packed_base
from qarl.generation.vllm_engine import (Completion, RefitTiming, VLLMEngine, check_expert_inputs, runs_eager,
                                         sleeps_between_rollouts)
from qarl.generation.vllm_lora import adapter_hooks, check_merged_adapters, engine_adapter_rank, merges_adapters

__all__ = ["Completion", "PackedBase", "RefitTiming", "VLLMEngine", "adapter_hooks", "check_expert_inputs",
           "check_merged_adapters", "engine_adapter_rank", "merges_adapters", "runs_eager", "serves_packed_base",
           "sleeps_between_rollouts"]
