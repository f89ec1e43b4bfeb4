"""The vLLM seam: the rollout engine and what it returns."""

from qarl.generation.packed_base import PackedBase, serves_packed_base
from qarl.generation.vllm_engine import (Completion, RefitTiming, VLLMEngine, check_expert_inputs, check_kv_cache,
                                         engine_mode, holds_kv_cache_scales, sleeps_between_rollouts)
from qarl.generation.vllm_lora import engine_adapter_rank, merges_adapters, training_engine_rank

__all__ = ["Completion", "PackedBase", "RefitTiming", "VLLMEngine", "check_expert_inputs", "check_kv_cache",
           "engine_adapter_rank",
           "engine_mode", "holds_kv_cache_scales", "merges_adapters", "serves_packed_base", "sleeps_between_rollouts",
           "training_engine_rank"]
