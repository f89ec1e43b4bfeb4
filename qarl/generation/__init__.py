"""The vLLM seam: the rollout engine and what it returns."""

from qarl.generation.vllm_engine import Completion, RefitTiming, VLLMEngine, sleeps_between_rollouts

__all__ = ["Completion", "RefitTiming", "VLLMEngine", "sleeps_between_rollouts"]
