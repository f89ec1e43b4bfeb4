"""The Megatron backend: real megatron-core models in real torch.distributed processes (gloo on CPU, TP=1 and TP=2,
launched by torchrun) against the HF backend: logits, folded weights and amax, unquantized and in every shipped
format; Mixture-of-Experts models (Qwen3-MoE, Qwen2-MoE) too. The converter alone (round trip, shapes, refusals):
tests/unit/test_convert.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from qarl.models.experts import split_expert_weights
from qarl.models.resolve import resolve_model_dir
from qarl.quant import folded_weights, quantize_policy, quantizer_state, resolve_format
from tests.conftest import FORMATS, REPO



# -- real megatron-core models in real torch.distributed processes ---------------------------------

def run_workers(root: Path, processes: int, jobs: list[dict]) -> None:
    """tests/megatron_worker.py's `jobs` (the fields of its `Job`) under torchrun, `processes` processes (gloo)."""
    jobs_file = root / f"jobs_{processes}.json"
    jobs_file.write_text(json.dumps(jobs))
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes),
               str(REPO / "tests" / "megatron_worker.py"), str(jobs_file)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]


def outputs(out: Path, formats: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    """{format: what rank 0 of a job wrote to `out`}."""
    return {f: load_file(str(out / f"{Path(f).stem}.safetensors")) for f in formats}


def hf_backend(model_dir: str, fmt_name: str, ids: torch.Tensor) -> dict[str, dict[str, torch.Tensor]]:
    """The HF backend on the same weights and calibration batches: logits, folded weights, amax, gradients (a MoE
    layer's experts by their checkpoint names, as the Megatron backend gives them)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    fmt = resolve_format(fmt_name)
    if fmt is not None:
        quantize_policy(model, fmt, lambda: [{"input_ids": ids[:2]}, {"input_ids": ids[2:]}])
    logits = model(input_ids=ids).logits
    torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).sum().backward()
    grads = split_expert_weights(model, {n: p.grad for n, p in model.named_parameters()})
    return {"logits": logits.detach(), "weights": dict(folded_weights(model)), "amax": quantizer_state(model),
            "grads": grads}


def assert_close_grads(run: dict[str, torch.Tensor], hf: dict, rtol: float) -> None:
    """Straight-through gradients by Hugging Face name: the HF backend's, to `rtol` of each tensor's scale
    (the fused q/k/v and gate/up matmuls sum their input gradient in another order)."""
    grads = split(run, "grad")
    assert grads.keys() == hf["grads"].keys()
    for name, grad in grads.items():
        scale = hf["grads"][name].abs().max().item()
        assert (grad - hf["grads"][name]).abs().max().item() <= rtol * scale, name


def split(result: dict[str, torch.Tensor], kind: str) -> dict[str, torch.Tensor]:
    return {k.removeprefix(f"{kind}/"): v for k, v in result.items() if k.startswith(f"{kind}/")}


ALL_FORMATS = ["none", *FORMATS]
TRAINED_FORMATS = ["none", FORMATS[0], FORMATS[2]]
MOE_FORMATS = ["none", FORMATS[0], FORMATS[1]]  # unquantized, NVFP4 W4A16 and W4A4 (the experts' inputs quantized)


@pytest.fixture(scope="module")
def moe_dir() -> str:
    return resolve_model_dir("embedded:tiny-qwen3moe")


@pytest.fixture(scope="module")
def qwen2moe_dir(tmp_path_factory) -> str:
    """The tiny Qwen2-MoE with its routing weights not renormalized over the top k (Qwen1.5-MoE's norm_topk_prob)."""
    out = tmp_path_factory.mktemp("qwen2moe") / "model"
    shutil.copytree(resolve_model_dir("embedded:tiny-qwen2moe"), out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "norm_topk_prob": False}))
    return str(out)


@pytest.fixture(scope="module")
def megatron_runs(tmp_path_factory, tiny_dir, families, moe_dir, qwen2moe_dir) -> Path:
    """Every Megatron run of these tests, in two torchrun launches (starting one is most of a small run's time), each
    job's outputs in `<root>/<job>`:
    - one process: `tp1` (TP=1, every format, a checkpoint of each), `moe_tp1` (Qwen3-MoE), then `refit` (a vLLM
      engine in that process);
    - two processes: `tp2` (TP=2, every format); `moe_tp2`, `qwen2moe_tp2` (Qwen2-MoE); `llama` and `qwen3` at
      TP=2; `tp2_saved` (TP=2 checkpoints with the quantizer state of the TP=1 run loaded through the fused layers);
      `trained` and `moe_trained` (three AdamW steps at TP=2); `data_parallel` (TP=1: two data-parallel ranks)."""
    root = tmp_path_factory.mktemp("megatron")

    def job(name: str, formats: list[str], model_dir: str = tiny_dir, **fields) -> dict:
        return {"model_dir": model_dir, "out": str(root / name), "formats": formats, **fields}

    run_workers(root, 1, [job("tp1", ALL_FORMATS, save=True), job("moe_tp1", MOE_FORMATS, moe_dir),
                          job("refit", [FORMATS[1]], refit=True)])
    run_workers(root, 2, [
        job("tp2", ALL_FORMATS, tp=2),
        job("moe_tp2", MOE_FORMATS, moe_dir, tp=2),
        job("qwen2moe_tp2", MOE_FORMATS, qwen2moe_dir, tp=2),
        *(job(family, ["none", FORMATS[0]], families[family], tp=2) for family in ("llama", "qwen3")),
        job("tp2_saved", FORMATS, tp=2, save=True, state_from=str(root / "tp1")),
        job("trained", TRAINED_FORMATS, tp=2, train_steps=3),
        job("moe_trained", MOE_FORMATS[:2], moe_dir, tp=2, train_steps=3),
        job("data_parallel", [FORMATS[0]], data_parallel=True),
    ])
    return root


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_megatron_tp1_equals_hf_backend(megatron_runs, tiny_dir, fmt):
    """TP=1, fp32: the Megatron model computes the HF backend's logits bit for bit, quantized or not; its
    folded weights and amax by Hugging Face name are the HF backend's (fused layers share amax by construction)."""
    run = outputs(megatron_runs / "tp1", [fmt])[fmt]
    hf = hf_backend(tiny_dir, fmt, run["ids"])
    assert torch.equal(run["logits"], hf["logits"])
    weights, amax = split(run, "weight"), split(run, "amax")
    assert weights.keys() == hf["weights"].keys() and amax.keys() == hf["amax"].keys()
    assert all(torch.equal(weights[k], hf["weights"][k]) for k in weights)
    assert all(torch.equal(amax[k], hf["amax"][k]) for k in amax)
    if fmt != "none":
        assert "lm_head.weight_quantizer" not in amax  # '*lm_head*' keeps Megatron's output_layer off too
    assert_close_grads(run, hf, rtol=1e-5)


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_megatron_tp2_quantizes_as_tp1(megatron_runs, fmt):
    """TP=2: the same folded weights bit for bit (per-tensor amax max-reduced across ranks), the same amax
    to the last bits of the calibration forward, and logits and gradients at the fp32 floor (row-parallel
    layers sum in another order; activation formats turn a few of those last-bit differences into a
    quantization step, which moves a few logits by up to 0.04 and a few gradient entries more)."""
    one, two = (outputs(megatron_runs / tp, [fmt])[fmt] for tp in ("tp1", "tp2"))
    weights_one, weights_two = split(one, "weight"), split(two, "weight")
    assert all(torch.equal(weights_one[k], weights_two[k]) for k in weights_one)
    amax_one, amax_two = split(one, "amax"), split(two, "amax")
    assert amax_one.keys() == amax_two.keys()
    assert all(torch.allclose(amax_one[k], amax_two[k], rtol=1e-6, atol=0) for k in amax_one)
    weight_only = fmt in ("none", FORMATS[0])
    mean = (one["logits"] - two["logits"]).abs().mean().item()
    assert mean < (1e-6 if weight_only else 1e-3), mean
    grads_one, grads_two = split(one, "grad"), split(two, "grad")
    assert grads_one.keys() == grads_two.keys()
    for name, grad in grads_one.items():  # not TP times too large: the vocabulary gather's backward does not sum
        if weight_only:
            assert (grad - grads_two[name]).abs().max() <= 1e-5 * grad.abs().max(), name
        else:  # a few activations rounded to the neighbouring 4/8-bit value move a few gradient entries
            assert (grad - grads_two[name]).norm() <= 0.1 * grad.norm(), name


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_megatron_other_families(families, megatron_runs, family):
    """Llama (untied output layer, no biases) and Qwen3 (q/k norms, head_dim 32 with hidden 64 / 4 heads)
    build, load and compute the HF backend's logits and gradients, NVFP4 W4A16 folded weights included, at TP=2."""
    runs = outputs(megatron_runs / family, ["none", FORMATS[0]])
    for fmt, run in runs.items():
        hf = hf_backend(families[family], fmt, run["ids"])
        assert (run["logits"] - hf["logits"]).abs().max().item() < 1e-5
        weights = split(run, "weight")
        assert weights.keys() == hf["weights"].keys()
        assert all(torch.equal(weights[k], hf["weights"][k]) for k in weights)
        assert_close_grads(run, hf, rtol=1e-5)


@pytest.mark.parametrize("fmt", MOE_FORMATS)
@pytest.mark.parametrize("job", ["moe_tp1", "moe_tp2", "qwen2moe_tp2"])
def test_megatron_moe_equals_hf_backend(megatron_runs, moe_dir, qwen2moe_dir, job, fmt):
    """Qwen3-MoE (8 experts, top 2, renormalized) at TP=1 and 2, and Qwen2-MoE (a gated shared expert beside them, the
    top 2 not renormalized) at TP=2, on Megatron's MoE layer, each expert sharded across TP as the dense MLP: the HF
    backend's logits and gradients at the fp32 floor (experts' outputs summed in another order), quantized or not; its
    folded weights by checkpoint name, and amax by the HF backend's quantizer names (the fused experts module's: one
    input quantizer the experts share, one weight quantizer an expert; the shared expert's gate is a quantized linear
    layer), the HF backend's."""
    run = outputs(megatron_runs / job, [fmt])[fmt]
    hf = hf_backend(qwen2moe_dir if job.startswith("qwen2moe") else moe_dir, fmt, run["ids"])
    assert (run["logits"] - hf["logits"]).abs().max().item() < 1e-5
    weights, amax = split(run, "weight"), split(run, "amax")
    assert weights.keys() == hf["weights"].keys() and amax.keys() == hf["amax"].keys()
    assert all(torch.equal(weights[k], hf["weights"][k]) for k in weights)
    assert all(torch.allclose(amax[k], hf["amax"][k], rtol=1e-6, atol=0) for k in amax)
    if fmt != "none":
        assert "model.layers.1.mlp.experts.down_proj_weight_quantizers.7" in amax
        assert ("model.layers.1.mlp.shared_expert_gate.weight_quantizer" in amax) == job.startswith("qwen2moe")
    assert_close_grads(run, hf, rtol=1e-5)


def files_bytes(root: Path) -> dict[str, bytes]:
    """Every file of an export; the manifest without the lines naming its checkpoint and its own directory."""
    files = {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
    files["qarl_export.json"] = b"\n".join(line for line in files["qarl_export.json"].splitlines()
                                           if not line.strip().startswith((b'"source"', b'"out_dir"')))
    return files


@pytest.mark.parametrize("scheme", ["nvfp4_w4a16", "nvfp4_w4a4", "fp8_w8a8"])
def test_export_from_tp2_equals_tp1_and_hf_backend(megatron_runs, tiny_dir, tmp_path, scheme):
    """A Megatron checkpoint is a Hugging Face one (weights by HF name, gathered from the shards), so `qarl export`
    of a TP=2 checkpoint writes the same bytes as of a TP=1 one with the same quantizer state (loaded into the
    TP=2 model through its fused layers), and, for the weight-only format whose TP=2 calibration is exact, as
    the HF backend's own checkpoint of the same model."""
    from transformers import AutoTokenizer

    from qarl.export import export_checkpoint
    from qarl.policy import Policy

    fmt = {"nvfp4_w4a16": "quant_configs/nvfp4_a16.yaml"}.get(scheme, f"quant_configs/{scheme}.yaml")
    one, two = megatron_runs / "tp1", megatron_runs / "tp2_saved"
    stem = Path(fmt).stem
    exported = {}
    for name, root in (("tp1", one), ("tp2", two)):
        exported[name] = tmp_path / f"export_{name}"
        export_checkpoint(root / f"{stem}_checkpoint", scheme + "_modelopt", exported[name])
    assert files_bytes(exported["tp1"]) == files_bytes(exported["tp2"])
    if scheme == "nvfp4_w4a16":
        ids = load_file(str(one / f"{stem}.safetensors"))["ids"]
        model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
        quantize_policy(model, resolve_format(fmt), lambda: [{"input_ids": ids[:2]}, {"input_ids": ids[2:]}])
        policy = Policy(model=model, tokenizer=AutoTokenizer.from_pretrained(tiny_dir), format=resolve_format(fmt),
                        model_dir=tiny_dir)
        policy.save(tmp_path / "hf_checkpoint")
        export_checkpoint(tmp_path / "hf_checkpoint", scheme + "_modelopt", tmp_path / "export_hf")
        ours, theirs = files_bytes(exported["tp2"]), files_bytes(tmp_path / "export_hf")
        weights = [k for k in ours if k.endswith(".safetensors")]
        assert weights and all(ours[k] == theirs[k] for k in weights)


@pytest.mark.parametrize(("job", "fmt"), [*(("trained", fmt) for fmt in TRAINED_FORMATS),
                                          *(("moe_trained", fmt) for fmt in MOE_FORMATS[:2])])
def test_megatron_tp2_trains_as_hf_backend(megatron_runs, tiny_dir, moe_dir, job, fmt):
    """Three AdamW steps of a policy-gradient loss on qarl's completion scores (straight-through gradients,
    the weight cache invalidated by each step): the TP=2 Megatron model's master weights follow the HF
    backend's to 1/1000 of an update on average (FP8 W8A8: 1/20), and its NVFP4 folded weights are the HF
    backend's but for rare roundings (FP8's 8-bit grid turns those last-bit differences into a few % of values).
    Qwen3-MoE too: its experts by checkpoint name, its routers' gradients summed across TP."""
    from tests.megatron_worker import train_step

    run = outputs(megatron_runs / job, [fmt])[fmt]
    ids = run["ids"]
    model = AutoModelForCausalLM.from_pretrained(moe_dir if job == "moe_trained" else tiny_dir, dtype=torch.float32)
    if resolve_format(fmt) is not None:
        quantize_policy(model, resolve_format(fmt), lambda: [{"input_ids": ids[:2]}, {"input_ids": ids[2:]}])
    before = split_expert_weights(model, {k: v.clone() for k, v in model.state_dict().items()})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        train_step(model, optimizer, ids)
    masters, folded = split(run, "master"), split(run, "weight")
    assert masters.keys() <= before.keys()
    for name, tensor in split_expert_weights(model, model.state_dict()).items():
        if "_quantizer" in name or name not in masters:
            continue
        assert not torch.equal(before[name], tensor), f"{name} did not train"
        # Adam divides by the gradient's scale: where a gradient is near zero, a last-bit difference moves that
        # entry's step by up to lr. Compare with the size of an update (lr = 1e-3), on average per tensor.
        # FP8 activations: a few rounded to the neighbouring value move a few gradients (see above)
        delta = (masters[name] - tensor).abs()
        assert delta.mean() <= (5e-2 if fmt == FORMATS[2] else 1e-3) * 1e-3 and delta.max() <= 2 * 3 * 1e-3, name
    if fmt == FORMATS[0]:  # NVFP4: a master weight next to a rounding boundary may land on the other 4-bit value
        same = [(folded[name] == tensor).float().mean().item() for name, tensor in folded_weights(model)
                if "layers" in name and name.endswith("proj.weight")]
        assert min(same) > 0.999, same


def test_megatron_data_parallel_gradients(megatron_runs, tiny_dir):
    """Two processes at TP=1 are two data-parallel ranks: each backpropagates its own rows of the batch, and
    `finish_gradients` sums them into the whole batch's gradients (the HF backend's, on all rows)."""
    fmt = FORMATS[0]
    run = outputs(megatron_runs / "data_parallel", [fmt])[fmt]
    assert_close_grads(run, hf_backend(tiny_dir, fmt, run["ids"]), rtol=1e-5)


def test_engine_refits_from_megatron_as_from_hf_backend(megatron_runs):
    """The vLLM engine refitted from the Megatron model (folded weights gathered by Hugging Face name as vLLM
    loads them, input amax of the fused layers) holds exactly what a refit from the HF backend gives it:
    the same greedy completions with the same log-probs, NVFP4 W4A4 (weights and input amax)."""
    result = load_file(str(megatron_runs / "refit" / f"{Path(FORMATS[1]).stem}_refit.safetensors"))
    assert result["same_tokens"].all()
    assert torch.equal(result["engine_megatron"], result["engine_hf"])
    assert (result["engine_megatron"] - result["policy"]).abs().mean() < 0.05  # the engine serves this policy
