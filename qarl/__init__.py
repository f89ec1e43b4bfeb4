"""qarl: quantization-aware reinforcement learning of language models (ModelOpt + vLLM)."""

__version__ = "0.1.0"
