"""`qarl diagnose MODEL [MODEL ...]`: how quantizable is each layer, and did training change it?

Per linear layer that the formats quantize (and per expert's gate, up and down projection of a Mixture-of-Experts
layer, on the rows routed to that expert), on the recipe's calibration data:
  weights      kurtosis (3 for a Gaussian), outlier fraction (|w - mean| > 3 std; 0.27 % for a Gaussian);
  activations  the same two statistics of the layer's inputs;
  error        relative reconstruction error ||Q(t) - t|| / ||t|| of the weight and of the inputs in NVFP4
               and in FP8 (ModelOpt's own quantizers, max-calibrated), and of the layer's output when both
               are quantized: ||Q(x) Q(W)^T - x W^T|| / ||x W^T||, the ranking of which layers hurt most;
               with `--also QUANT_CFG ...`, the weight, input and output errors of more formats beside them (W4A4
               with per-token or 4-over-6 scales, mixed formats: what a method does to each layer; a layer a
               mixed format leaves unquantized has errors 0 there, and counts in the layer means; so does a layer
               only an `--also` format quantizes, in the others).
Several models (e.g. the base, then runs trained from it) are compared layer by layer: before vs after.
Writes diagnose.json, diagnose.md and diagnose.png to --out.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qarl.config import ConfigError, LoraConfig, RecipeConfig

if TYPE_CHECKING:  # torch loads in the functions: a bad path is answered before it
    import torch

FORMATS = {"nvfp4": "quant_configs/nvfp4_w4a4.yaml", "fp8": "quant_configs/fp8_w8a8.yaml"}
MAX_TOKENS = 8192  # activation rows kept per layer


def moments(t: torch.Tensor) -> dict[str, float]:
    """Kurtosis and the fraction of entries more than 3 standard deviations from the mean."""
    x = t.detach().double().flatten()
    centered = x - x.mean()
    std = centered.pow(2).mean().sqrt()
    return {"kurtosis": float(centered.pow(4).mean() / std.pow(4)),
            "outlier_fraction": float((centered.abs() > 3 * std).double().mean())}


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return float((approx.double() - exact.double()).norm() / exact.double().norm().clamp_min(1e-30))


def layer_inputs(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]], names: set[str]) -> dict[str, torch.Tensor]:
    """The inputs of the named linear layers over the calibration batches, as [tokens, width] rows
    (padding rows dropped), at most MAX_TOKENS per layer."""
    import torch

    captured: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    masks: list[torch.Tensor] = []
    modules = dict(model.named_modules())
    hooks = [modules[n].register_forward_hook(lambda m, args, out, n=n: captured[n].append(args[0].detach()))
             for n in names]
    try:
        with torch.no_grad():
            for batch in batches:
                masks.append(batch["attention_mask"].bool())
                model(**batch)
    finally:
        for h in hooks:
            h.remove()
    return {n: torch.cat([x[mask] for x, mask in zip(xs, masks)])[:MAX_TOKENS] for n, xs in captured.items()}


MIN_EXPERT_ROWS = 8  # an expert the calibration data routes fewer tokens to is left out of the report


def expert_inputs(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The inputs of each expert's gate, up and down projection (by checkpoint name) over the calibration batches: the
    rows routed to the expert, and act(gate) x up of those rows, at most MAX_TOKENS each; experts with fewer than
    MIN_EXPERT_ROWS rows are left out."""
    import torch

    from qarl.models.experts import expert_layers, is_fused_experts

    model_type = model.config.model_type
    captured: dict[str, list[torch.Tensor]] = {}
    mask: list[torch.Tensor] = []  # the current batch's non-padding tokens, flattened as the experts see them

    def capture(module: torch.nn.Module, args: tuple, kwargs: dict, prefix: str) -> None:
        tokens = len(mask[-1])  # (a CPU policy's MoE block appends rows of its own after them: models/cpu_moe.py)
        hidden = (args[0] if args else kwargs["hidden_states"])[:tokens]
        index = (args[1] if len(args) > 1 else kwargs["top_k_index"])[:tokens]
        for expert in range(module.gate_up_proj.shape[0]):
            rows = hidden[(index == expert).any(-1) & mask[-1]]
            gate, up = torch.nn.functional.linear(rows, module.gate_up_proj[expert]).chunk(2, dim=-1)
            (gate_name, _), (up_name, _) = expert_layers(prefix, "gate_up_proj", expert, 2, model_type)
            (down_name, _), = expert_layers(prefix, "down_proj", expert, 1, model_type)
            for name, x in ((gate_name, rows), (up_name, rows), (down_name, module.act_fn(gate) * up)):
                captured.setdefault(name, []).append(x.detach())

    hooks = [m.register_forward_pre_hook(lambda m, args, kwargs, prefix=f"{n}.": capture(m, args, kwargs, prefix),
                                         with_kwargs=True)
             for n, m in model.named_modules() if is_fused_experts(m)]
    try:
        with torch.no_grad():
            for batch in batches:
                mask.append(batch["attention_mask"].bool().flatten())
                model(**batch)
    finally:
        for h in hooks:
            h.remove()
    inputs = {n: torch.cat(xs)[:MAX_TOKENS] for n, xs in captured.items()}
    return {n: x for n, x in inputs.items() if len(x) >= MIN_EXPERT_ROWS}


def format_keys(also: list[str]) -> dict[str, str]:
    """FORMATS and the `--also` quant configs, by the key their columns carry (a config's file stem); a name that is
    neither a file nor a ModelOpt config name is refused here, before anything heavy is imported."""
    from qarl.quant_cfg import find_quant_yaml, shipped_names

    for spec in also:
        if find_quant_yaml(spec) is None and not spec.endswith("_CFG"):
            raise ConfigError(f"--also {spec}: no such quant config file; shipped: {', '.join(shipped_names())} (a "
                              "name or a path), or a ModelOpt config name (..._CFG)")
    extra = {Path(spec).stem: spec for spec in also}
    own = {Path(spec).stem for spec in FORMATS.values()} | set(FORMATS)
    if len(extra) != len(also) or own & set(extra):
        raise ConfigError(f"--also {' '.join(also)}: name each quant config once, and none of the formats diagnosed "
                          f"anyway ({', '.join(FORMATS.values())})")
    return FORMATS | extra


def diagnose_model(cfg: RecipeConfig, model_dir: str, calibration: list[str],
                   formats: dict[str, str] = FORMATS) -> dict[str, dict[str, Any]]:
    """{layer: statistics} of one model (see the module docstring) in each of `formats` (`format_keys`)."""
    import torch

    from qarl.calibration import calibration_batches
    from qarl.models.experts import split_expert_weights
    from qarl.policy import build_policy
    from qarl.quant import resolve_format
    from qarl.quant.quantize import quantized_weights

    settings = dataclasses.replace(cfg.policy, lora=LoraConfig())  # the weights' own errors: no adapters
    plain = build_policy(settings, [], model_dir=model_dir, fmt=None)
    batches = list(calibration_batches(calibration, plain.tokenizer, cfg.policy, plain.device))
    quantized = {key: build_policy(settings, calibration, model_dir=model_dir, fmt=resolve_format(spec))
                 for key, spec in formats.items()}
    layers = {key: {w.name: w for w in quantized_weights(p.model)} for key, p in quantized.items()}
    names = set.union(*(set(v) for v in layers.values()))  # a layer a mixed format leaves unquantized: exact there
    plain_modules = dict(plain.model.named_modules())
    inputs = {**layer_inputs(plain.model, batches, names & set(plain_modules)), **expert_inputs(plain.model, batches)}
    weights = split_expert_weights(plain.model, dict(plain.model.named_parameters()))
    order = [n for n in dict.fromkeys(m.rpartition(".")[0] for m in weights) if n in names and n in inputs]
    report = {}
    with torch.no_grad():
        for name in order:
            weight, x = weights[f"{name}.weight"], inputs[name]
            row = {**{f"weight_{k}": v for k, v in moments(weight).items()},
                   **{f"input_{k}": v for k, v in moments(x).items()}}
            exact = x @ weight.T
            for key in formats:
                layer = layers[key].get(name)
                if layer is None:  # unquantized in this format (nvfp4_w4a4_down_bf16's down_proj): no error
                    row.update({f"{kind}_error_{key}": 0.0 for kind in ("weight", "input", "output")})
                    continue
                qw, qx = layer.quantized(), layer.input_quantizer(x)
                row[f"weight_error_{key}"] = relative_error(qw, weight)
                row[f"input_error_{key}"] = relative_error(qx, x)
                row[f"output_error_{key}"] = relative_error(qx @ qw.T, exact)
            report[name] = row
    return report


def markdown(report: dict[str, dict[str, dict[str, Any]]]) -> str:
    """Per model, per layer: the statistics, layers sorted by NVFP4 output error (worst first); then each
    statistic's layer mean per model and, with several models, its change from the first model."""
    columns = [("weight_kurtosis", "W kurt", 1), ("weight_outlier_fraction", "W >3σ %", 100),
               ("input_kurtosis", "X kurt", 1), ("input_outlier_fraction", "X >3σ %", 100),
               ("weight_error_nvfp4", "W err NVFP4 %", 100), ("weight_error_fp8", "W err FP8 %", 100),
               ("input_error_nvfp4", "X err NVFP4 %", 100), ("input_error_fp8", "X err FP8 %", 100),
               ("output_error_nvfp4", "out err NVFP4 %", 100), ("output_error_fp8", "out err FP8 %", 100)]
    first_row = next(iter(next(iter(report.values())).values()))
    extra = [key.removeprefix("output_error_") for key in first_row
             if key.startswith("output_error_") and key.removeprefix("output_error_") not in FORMATS]
    columns += [c for key in extra for c in ((f"weight_error_{key}", f"W err {key} %", 100),
                                              (f"input_error_{key}", f"X err {key} %", 100),
                                              (f"output_error_{key}", f"out err {key} %", 100))]
    parts = []
    for model, layers in report.items():
        lines = [f"### {model}: layers by NVFP4 W4A4 output error (worst first)",
                 "| layer | " + " | ".join(c[1] for c in columns) + " |", "|---|" + "---|" * len(columns)]
        for name, row in sorted(layers.items(), key=lambda kv: -kv[1]["output_error_nvfp4"]):
            lines.append(f"| {name} | " + " | ".join(f"{row[k] * s:.2f}" for k, _, s in columns) + " |")
        parts.append("\n".join(lines))
    first = next(iter(report))
    mean = lambda layers, k: sum(r[k] for r in layers.values()) / len(layers)  # noqa: E731
    title = f"### Layer means, change from {first}" if len(report) > 1 else "### Layer means"
    lines = [title, "| model | " + " | ".join(c[1] for c in columns) + " |", "|---|" + "---|" * len(columns)]
    for model, layers in report.items():
        cells = [f"{mean(layers, k) * s:.2f}" + ("" if model == first else
                 f" ({(mean(layers, k) - mean(report[first], k)) * s:+.2f})") for k, _, s in columns]
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    parts.append("\n".join(lines))
    return "\n\n".join(parts)


def plot(report: dict[str, dict[str, dict[str, Any]]], out: Path) -> Path:
    """Per layer and model: NVFP4 output error, weight kurtosis, input kurtosis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("output_error_nvfp4", "NVFP4 W4A4 output error (%)", 100), ("weight_kurtosis", "weight kurtosis", 1),
              ("input_kurtosis", "input kurtosis", 1)]
    layers = [n for n in next(iter(report.values())) if all(n in rows for rows in report.values())]
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(8, 0.5 * len(layers)), 2.6 * len(panels)), sharex=True)
    width = 0.8 / len(report)
    for ax, (key, title, scale) in zip(axes, panels):
        for i, (model, rows) in enumerate(report.items()):
            xs = [j + (i - (len(report) - 1) / 2) * width for j in range(len(layers))]
            ax.bar(xs, [rows[n][key] * scale for n in layers], width, label=model)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    axes[-1].set_xticks(range(len(layers)))
    axes[-1].set_xticklabels([n.removeprefix("model.") for n in layers], rotation=60, ha="right", fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def run_diagnose(cfg: RecipeConfig, models: list[str], out: Path,
                 also: list[str] = ()) -> dict[str, dict[str, dict[str, Any]]]:
    """Diagnose each model ("warm-start" = the recipe's step-0 model) in NVFP4 W4A4, FP8 and the quant configs of
    `also`, and write the report to `out`."""
    from qarl.config import WARM_START
    from qarl.matrix import resolve_model_source

    formats = format_keys(list(also))

    missing = [m for m in models if m != WARM_START and not Path(m).expanduser().exists()]
    if missing:
        raise ConfigError(f"model {missing[0]!r} does not exist")
    earlier = out / "diagnose.json"
    if earlier.is_file() and not cfg.run.overwrite:
        raise ConfigError(f"--out {out} holds an earlier diagnosis ({earlier}): give another --out, or "
                          "run.overwrite=true to replace it")
    from qarl.quant import resolve_format
    from qarl.quant.quantize import check_format_fits
    from qarl.tasks import build_task, model_prompt_format
    from qarl.run import initial_model_dir

    task = build_task(cfg.task, cfg.run.seed)
    sources = {m: resolve_model_source(m) for m in models if m != WARM_START}  # bad paths fail first
    dirs = {m: initial_model_dir(cfg, task) if m == WARM_START else sources[m].model_dir for m in models}
    for model_dir in dirs.values():
        for spec in formats.values():
            check_format_fits(model_dir, resolve_format(spec), cfg.policy.trust_remote_code)
    trust = cfg.policy.trust_remote_code
    report = {m: diagnose_model(cfg, d, task.calibration_texts(cfg.policy.quant_calib_size,
                                                               model_prompt_format(d, cfg.task, trust)), formats)
              for m, d in dirs.items()}
    out.mkdir(parents=True, exist_ok=True)
    (out / "diagnose.json").write_text(json.dumps(report, indent=1))
    (out / "diagnose.md").write_text(markdown(report) + "\n")
    plot(report, out / "diagnose.png")
    return report
