"""A compiled vLLM engine of a model class vLLM compiles twice over (MistralModel over LlamaModel, Qwen3Model over
Qwen2Model) is given back once qarl drops the bytecode hook vLLM's shutdown leaves (qarl/torch_compat.py): real
vLLM (CPU build) with its compilation on, which qarl's own CPU engine never uses (it is eager on CPU)."""

from __future__ import annotations

import gc
import weakref

import pytest

from qarl.generation import vllm_compat
from qarl.models.resolve import resolve_model_dir
from qarl.torch_compat import drop_bytecode_hooks


@pytest.mark.slow
@pytest.mark.parametrize("family, hooks", [("mistral", 2), ("qwen3", 2), ("qwen2", 1)])
def test_a_compiled_engine_is_collected_once_its_hooks_are_dropped(monkeypatch, family, hooks):
    """vLLM removes one hook a model, through the handle it keeps, when the engine itself is collected; a model
    compiled twice over has two (checked here), so without the drop one would keep it alive."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    model_name = "embedded:tiny" if family == "qwen2" else f"embedded:tiny-{family}"
    llm = LLM(model=resolve_model_dir(model_name), enforce_eager=False, dtype="float32", max_model_len=64,
              gpu_memory_utilization=0.05)
    model = vllm_compat.runner_model(vllm_compat.worker_runner(vllm_compat.in_process_worker(llm)))
    closed = [weakref.ref(module) for module in model.modules()]  # a hook holds the inner model, not the outer
    vllm_compat.shutdown_engine(llm)
    assert drop_bytecode_hooks(model) == hooks
    del llm, model
    gc.collect()
    gc.collect()
    assert not [ref() for ref in closed if ref() is not None]
