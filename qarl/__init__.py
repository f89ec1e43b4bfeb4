"""qarl: quantization-aware reinforcement learning of language models (ModelOpt + vLLM)."""

import os

# No network at run time unless the user configures it: models and datasets come from local paths or
# the local Hugging Face cache. Set HF_HUB_OFFLINE=0 (and HF_DATASETS_OFFLINE=0) to allow hub downloads.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")

__version__ = "0.1.0"
