"""qarl/torch_compat.py's functions against the installed torch's real internals."""

from __future__ import annotations

import gc
import weakref

import torch
from torch._dynamo import convert_frame

from qarl.torch_compat import drop_bytecode_hooks


class Compiled(torch.nn.Module):
    """Registers its bytecode hook at construction as vLLM's compiled models do; a subclass that runs that
    registration twice (vLLM's MistralModel over LlamaModel) keeps the handle of the second only."""

    def __init__(self, registrations: int):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        for _ in range(registrations):
            self.handle = convert_frame.register_bytecode_hook(self.bytecode_hook)

    def bytecode_hook(self, old_code, new_code) -> None:
        return None


def test_a_model_whose_hook_registered_twice_is_collected_once_its_hooks_are_dropped():
    before = dict(convert_frame._bytecode_hooks)
    try:
        other = Compiled(1)  # another model's hook stays
        model = Compiled(2)
        model.handle.remove()  # what vLLM does once the engine is collected: one handle, one hook
        alive = weakref.ref(model)
        del model
        gc.collect()
        assert alive() is not None  # the hook left in torch's registry holds the model
        assert drop_bytecode_hooks(alive()) == 1
        gc.collect()
        assert alive() is None
        assert drop_bytecode_hooks(other) == 1 and drop_bytecode_hooks(other) == 0
    finally:  # torch's registry is global: leave it as it was
        convert_frame._bytecode_hooks.clear()
        convert_frame._bytecode_hooks.update(before)
