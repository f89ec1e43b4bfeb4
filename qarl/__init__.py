"""qarl: quantization-aware reinforcement learning of language models (ModelOpt + vLLM)."""

import os

# No network at run time unless the user configures it: models and datasets come from local paths or
# the local Hugging Face cache. Set HF_HUB_OFFLINE=0 (and HF_DATASETS_OFFLINE=0) to allow hub downloads.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
# MKL's strict reproducibility: an fp32 CPU matmul's rows then round alike whatever the row and thread counts, so the
# CPU engine's decode steps (a few rows) compute what the policy's scoring (a tall product) does. Without it MKL may
# sum a short product in another order (two threads, 1024 x 256: rows 16-175 differ;
# tests/unit/test_cpu_matmul_rows.py).
# MKL reads it at its first call: a program that multiplies before importing qarl sets it itself.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

__version__ = "0.1.0"
