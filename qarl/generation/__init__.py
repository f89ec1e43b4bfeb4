"""The vLLM seam: the rollout engine and what it returns."""

from qarl.generation.vllm_engine import Completion, RefitTiming, VLLMEngine

__all__ = ["Completion", "RefitTiming", "VLLMEngine"]
