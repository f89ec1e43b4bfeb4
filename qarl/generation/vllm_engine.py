"""The rollout engine: vLLM in this process, fed the policy's fake-quantized weights and its amax.

Why it quantizes exactly like the policy:
  * weights arrive pre-folded: the policy runs each weight through its own ModelOpt weight quantizer
    and sends the result, so vLLM multiplies with the very tensors the policy's forward uses;
  * ModelOpt's vLLM plugin puts input quantizers into vLLM's (fused) linear layers, configured from
    the same QuantizeConfig with the weight quantizers switched off, and every refit copies the
    policy's per-tensor input amax into them (q/k/v and gate/up already share one amax on the policy).
A refit writes into the running engine's parameters; nothing restarts and nothing is read from disk.

The engine runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so a refit is a tensor copy, not a
serialization; the caller's entry point must be guarded by `if __name__ == "__main__":`.
"""

from __future__ import annotations

import os
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from qarl.config import ConfigError, GenerationConfig
from qarl.generation.adapters import EngineAdapters
from qarl.quant import QuantFormat, folded_weights


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

    @property
    def total_s(self) -> float:
        return self.weights_s + self.amax_s


def _keep_cpu_weights_plain() -> None:
    """On CPU, vLLM repacks linear and embedding weights into oneDNN handles after loading and frees
    `layer.weight`; a later in-place refit would then write into nothing. Keep them as plain tensors
    used through torch.nn.functional.linear (the same math, and the engine stays refittable)."""
    from vllm.model_executor.layers import utils as vllm_layer_utils

    def plain_linear(layer: nn.Module, remove_weight: bool) -> None:
        layer.cpu_linear = torch.nn.functional.linear

    vllm_layer_utils.dispatch_cpu_unquantized_gemm = plain_linear


SLEEP_MODES = ("auto", "on", "off")


def sleeps_between_rollouts(cfg: GenerationConfig) -> bool:
    """Whether the engine sleeps while the policy trains: "auto" = on a GPU. vLLM's sleep mode needs
    CUDA, so "on" without it is refused (before any engine starts)."""
    mode = {"true": "on", "false": "off"}.get(str(cfg.sleep_between_rollouts).lower(), str(cfg.sleep_between_rollouts))
    if mode not in SLEEP_MODES:  # YAML reads a bare on/off as a boolean: both spellings are accepted
        raise ConfigError(f"policy.generation.sleep_between_rollouts={cfg.sleep_between_rollouts!r}; choose one of {SLEEP_MODES}")
    if mode == "on" and not torch.cuda.is_available():
        raise ConfigError("policy.generation.sleep_between_rollouts=on needs a CUDA GPU (vLLM's sleep mode); "
                          "use auto or off on this machine")
    return mode != "off" and torch.cuda.is_available()


class VLLMEngine:
    """`generate(prompts, ...)` -> completions with log-probs; `refit(model)` -> engine equals policy."""

    def __init__(self, model_dir: str | Path, cfg: GenerationConfig, dtype: str, seed: int):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # per-step notices would drown the progress bar
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(cfg.kv_cache_gib))))
        from vllm import LLM

        if not torch.cuda.is_available():
            _keep_cpu_weights_plain()
        self.cfg = cfg
        self.sleeps = sleeps_between_rollouts(cfg)
        self._asleep = False
        self.llm = LLM(
            model=str(model_dir),
            dtype=dtype,
            seed=seed,
            enforce_eager=True,
            max_model_len=cfg.max_model_len,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            tensor_parallel_size=cfg.tensor_parallel_size,
            logprobs_mode="processed_logprobs",
            trust_remote_code=False,
            enable_sleep_mode=self.sleeps,
        )
        self.model: nn.Module = self.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
        self.format: QuantFormat | None = None
        self._quantized = False
        self._links: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._held_from: weakref.ref | None = None  # the policy model the engine's weights came from
        self._held: dict[str, tuple[int, int]] = {}  # its frozen weights the engine holds: name -> (ptr, version)
        self.adapters = EngineAdapters(self.model)

    # -- quantization -------------------------------------------------------------------------
    def set_quant_format(self, fmt: QuantFormat | None) -> None:
        """Configure the engine's input quantizers for `fmt` (None: no quantization). Refit after."""
        import modelopt.torch.quantization as mtq

        from qarl.quant import gpu_kernels, nvfp4_cpu

        nvfp4_cpu.install()
        gpu_kernels.install()  # the same bits as ModelOpt's GPU kernels, fast (no-op without CUDA)
        if fmt is not None:
            mtq.quantize(self.model, fmt.with_weights_disabled())
            self._quantized = True
        elif self._quantized:
            mtq.set_quantizer_by_cfg(self.model, [{"quantizer_name": "*", "enable": False}])
        self.format = fmt
        self._links.clear()

    def _policy_name(self, engine_name: str) -> str:
        """The policy layer whose amax an engine layer takes: a fused layer takes its first part's
        (the parts share one amax on the policy side)."""
        parent, _, leaf = engine_name.rpartition(".")
        parts = getattr(self.model, "packed_modules_mapping", {}).get(leaf)
        return f"{parent}.{parts[0]}" if parts else engine_name

    def _input_quantizer_links(self, policy_model: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
        """(engine input quantizer, policy input quantizer) pairs, found once per policy model and format."""
        links = self._links.get(policy_model)
        if links is None:
            policy_modules = dict(policy_model.named_modules())
            links = []
            for name, module in self.model.named_modules():
                quantizer = getattr(module, "input_quantizer", None)
                if quantizer is None or not quantizer.is_enabled:
                    continue
                source = getattr(policy_modules.get(self._policy_name(name)), "input_quantizer", None)
                if source is None or not source.is_enabled or source.amax is None:
                    raise RuntimeError(
                        f"engine layer {name} quantizes its input but the policy has no input amax for "
                        f"{self._policy_name(name)}: policy and generation quant configs differ"
                    )
                links.append((quantizer, source))
            self._links[policy_model] = links
        return links

    # -- colocation ---------------------------------------------------------------------------
    def sleep(self) -> None:
        """Release the GPU for the policy's update: weights to host memory, KV cache freed (no-op
        unless sleeping is on). The ModelOpt quantizers' amax buffers were allocated after vLLM's
        weights and stay on the GPU."""
        if self.sleeps and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = True

    def wake(self) -> None:
        """Take the GPU back (weights and KV cache); the caller's freed cached blocks go first."""
        if self._asleep:
            torch.cuda.empty_cache()
            self.llm.wake_up()
            self._asleep = False

    # -- refit --------------------------------------------------------------------------------
    def _weights_to_send(self, policy_model: nn.Module, modules: dict[str, nn.Module]) -> set[str]:
        """Every weight, except frozen ones the engine already holds from this very policy model.

        A frozen parameter (requires_grad=False: LoRA's base) changes only by a tracked in-place write,
        which bumps its version; one whose served weight is computed from trainable adapters (merged
        LoRA) is always sent. So a qlora refit sends the base once and then only what changed."""
        same_source = self._held_from is not None and self._held_from() is policy_model
        held = self._held if same_source else {}
        send, now = set(), {}
        for name, param in policy_model.named_parameters():
            owner = modules.get(name.rpartition(".")[0])
            computed = hasattr(owner, "served_weight") and not getattr(owner, "serves_adapter", False)
            if param.requires_grad or computed:
                send.add(name)
                continue
            now[name] = (param.data_ptr(), param._version)
            if held.get(name) != now[name]:
                send.add(name)
        self._held_from, self._held = weakref.ref(policy_model), now
        return send

    @torch.no_grad()
    def refit(self, policy_model: nn.Module, sync_amax: bool = True) -> RefitTiming:
        """Load the policy's (folded) weights, its qlora adapters and, if `sync_amax`, its input amax
        into the engine. Frozen weights the engine already holds from this policy model are skipped."""
        from qarl.lora import served_adapters

        self.wake()
        start = time.perf_counter()
        moved = 0
        weights = []
        modules = dict(policy_model.named_modules())
        for name, tensor in folded_weights(policy_model, only=self._weights_to_send(policy_model, modules)):
            weights.append((name, tensor))
            moved += tensor.numel() * tensor.element_size()
        if weights:
            self.model.load_weights(weights)
        del weights
        moved += self.adapters.load(served_adapters(policy_model), modules)
        loaded = time.perf_counter()
        if sync_amax:
            for engine_quantizer, policy_quantizer in self._input_quantizer_links(policy_model):
                if engine_quantizer.amax is None or engine_quantizer.amax.shape != policy_quantizer.amax.shape:
                    engine_quantizer.amax = policy_quantizer.amax  # the first refit creates the buffer
                else:  # later ones write into it: the engine's tensors never change identity
                    engine_quantizer.amax.copy_(policy_quantizer.amax)
                moved += policy_quantizer.amax.numel() * policy_quantizer.amax.element_size()
                moved += self._sync_smoothing(engine_quantizer, policy_quantizer)
        self.llm.reset_prefix_cache()  # cached KV was computed by the old weights
        return RefitTiming(weights_s=loaded - start, amax_s=time.perf_counter() - loaded, bytes=moved)

    def _sync_smoothing(self, engine_quantizer: nn.Module, policy_quantizer: nn.Module) -> int:
        """Copy the policy input's AWQ/SmoothQuant scale (quantized inputs only: a weight-only scale
        arrives folded into the weight), or drop one a previous policy left; returns bytes moved."""
        scale = policy_quantizer.pre_quant_scale
        if scale is None:
            if hasattr(engine_quantizer, "_pre_quant_scale"):
                del engine_quantizer._pre_quant_scale
            return 0
        if self.cfg.tensor_parallel_size > 1:
            raise ConfigError("a policy with AWQ/SmoothQuant input scales (calibration algorithm awq_* or "
                              "smoothquant) needs policy.generation.tensor_parallel_size=1: the scales are not sharded")
        engine_quantizer._enable_pre_quant_scale = True
        engine_quantizer.pre_quant_scale = scale  # ModelOpt's setter: a buffer once, then copies into it
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
    ) -> list[Completion]:
        """Sample `num_samples` completions per prompt (prompt-major order), with per-token log-probs.

        Each sample gets its own seed (seed + index), so a run is reproducible sample by sample.
        """
        from vllm import SamplingParams

        self.wake()
        params, requests = [], []
        for i, prompt in enumerate(p for p in prompts for _ in range(num_samples)):
            params.append(
                SamplingParams(
                    n=1,
                    max_tokens=max_new_tokens or self.cfg.max_new_tokens,
                    temperature=0.0 if greedy else (temperature if temperature is not None else self.cfg.temperature),
                    top_p=1.0 if greedy else self.cfg.top_p,
                    logprobs=0,
                    seed=seed + i,
                )
            )
            requests.append({"prompt_token_ids": list(prompt)})
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        completions = []
        for request, out in zip(requests, outputs):
            sample = out.outputs[0]
            logprobs = [step[token].logprob for step, token in zip(sample.logprobs, sample.token_ids)]
            completions.append(
                Completion(request["prompt_token_ids"], list(sample.token_ids), logprobs, sample.finish_reason)
            )
        return completions
