"""The vLLM seam: the rollout engine and what it returns."""

from qarl.generation.vllm_engine import Completion, RefitTiming, VLLMEngine, runs_eager, sleeps_between_rollouts

__all__ = ["Completion", "RefitTiming", "VLLMEngine", "runs_eager", "sleeps_between_rollouts"]
