"""The vLLM seam: the rollout engine and what it returns."""

from qarl.generation.vllm_engine import (Completion, RefitTiming, VLLMEngine, check_expert_inputs, runs_eager,
                                         sleeps_between_rollouts)
from qarl.generation.vllm_lora import adapter_hooks, engine_adapter_rank

__all__ = ["Completion", "RefitTiming", "VLLMEngine", "adapter_hooks", "check_expert_inputs", "engine_adapter_rank",
           "runs_eager", "sleeps_between_rollouts"]
