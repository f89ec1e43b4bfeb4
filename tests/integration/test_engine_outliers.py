"""Policy and engine quantize every layer input identically where activations leave the calibrated range.

A pretrained model's activations have outlier channels and reach ranges its calibration prompts did not. Planted here
in the tiny model (an outlier channel in every norm, every input amax an eighth of what the prompt reaches), the
engine must clamp and round them exactly as the policy does: the same op, the same amax, in the same place. The two
sides' inputs are compared layer by layer on one prefill, bit for bit, attention's output included: the policy and
the engine attend through one op (qarl/models/block_attention.py), and an activation quantizer would turn a last-bit
difference next to a rounding boundary into a whole 4/8-bit step, which a deep model compounds
(docs/concepts/amax-sync.md)."""

from __future__ import annotations

import pytest
import torch

from qarl.generation import engine_quant
from qarl.generation.engine_quant import policy_names
from qarl.generation.vllm_compat import CPU_TALL_ROWS
from qarl.quant.ops import fake_quant_input

ACTIVATION_FORMATS = ["quant_configs/nvfp4_w4a4.yaml", "quant_configs/fp8_w8a8.yaml"]
OUTLIER = 64.0  # one channel of each norm scaled by this
RANGE = 8.0  # each input amax: an eighth of the largest input of the prompt's


@torch.no_grad()
def _plant_outliers(policy, prompt: list[int]) -> None:
    """Activations calibration did not see: an outlier channel out of each decoder layer's norms (the inputs of
    q/k/v and gate/up), and each layer's input amax an eighth of its largest input on `prompt`, so that every
    quantized input goes far past its amax (clamped: FP8 at 448, NVFP4's block scales at 448). Set in forward order:
    a clamp changes every input after it."""
    ids = torch.tensor([prompt], device=policy.device)
    for layer in policy.model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        layer.input_layernorm.weight[3] *= OUTLIER
        layer.post_attention_layernorm.weight[5] *= OUTLIER
        for group in ([attention.q_proj, attention.k_proj, attention.v_proj], [attention.o_proj],
                      [mlp.gate_proj, mlp.up_proj], [mlp.down_proj]):  # fused parts keep one amax
            largest = []
            hook = group[0].register_forward_pre_hook(lambda _, args: largest.append(args[0].abs().max()))
            try:
                policy.model(input_ids=ids)
            finally:
                hook.remove()
            for part in group:
                part.input_quantizer.amax = largest[0] / RANGE


def _engine_inputs(engine, prompt: list[int], monkeypatch) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(input, quantized input) of each quantized-input layer of the engine as it prefills `prompt`: the quantized one
    as its forward computed it (engine_quant's `fake_quant_input`, called once a layer, in the layers' order)."""
    inputs: list[tuple[str, torch.Tensor]] = []
    quantized: list[torch.Tensor] = []

    def record(name):
        def hook(_, args):
            inputs.append((name, args[0].clone()))
        return hook

    def quantize(*args):
        quantized.append(fake_quant_input(*args).clone())
        return quantized[-1]

    monkeypatch.setattr(engine_quant, "fake_quant_input", quantize)
    hooks = [layer.register_forward_pre_hook(record(name))
             for name, layer in engine.model.named_modules() if isinstance(layer, engine_quant.QuantizedInput)]
    try:
        engine.generate([prompt], max_new_tokens=1, greedy=True)  # one step: the prefill
    finally:
        for hook in hooks:
            hook.remove()
    assert len(quantized) == len(inputs)
    return {name: (x, q) for (name, x), q in zip(inputs, quantized)}


@torch.no_grad()
def _policy_inputs(policy, prompt: list[int]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(input, quantized input) of every enabled input quantizer of the policy on `prompt`."""
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def record(name):
        def hook(_, args, out):
            seen.setdefault(name, (args[0].reshape(-1, args[0].shape[-1]).clone(), out.reshape(-1, out.shape[-1]).clone()))
        return hook

    modules = dict(policy.model.named_modules())
    hooks = [modules[name].input_quantizer.register_forward_hook(record(name))
             for name, module in modules.items() if getattr(module, "input_quantizer", None) is not None
             and module.input_quantizer.is_enabled]
    try:
        policy.model(input_ids=torch.tensor([prompt], device=policy.device))
    finally:
        for hook in hooks:
            hook.remove()
    return seen


@pytest.mark.parametrize("fmt", ACTIVATION_FORMATS)
def test_engine_quantizes_inputs_beyond_amax_as_the_policy(engine, make_policy, task, fmt, monkeypatch):
    policy = make_policy(fmt)
    # a prompt of at least CPU_TALL_ROWS tokens: the engine computes shorter matmuls as that tall (as the policy's
    # scoring of a micro-batch always is), a lone short prompt on the policy's side would not be
    prompt: list[int] = []
    for problem in task.eval:
        prompt += policy.tokenizer(problem.prompt).input_ids
        if len(prompt) >= CPU_TALL_ROWS:
            break
    _plant_outliers(policy, prompt)
    engine.set_quant_format(policy.format)
    engine.refit(policy.model)
    engine_x = _engine_inputs(engine, prompt, monkeypatch)
    assert len(engine_x) == 4 * len(policy.model.model.layers)
    policy_x = _policy_inputs(policy, prompt)
    layers = dict(engine.model.named_modules())
    for name, (x, quantized) in engine_x.items():  # in forward order: the first layer that differs fails
        assert x.abs().max() >= RANGE / 2 * layers[name].input_amax, name  # far past the amax
        for part in policy_names(engine.model, name):
            theirs, theirs_quantized = policy_x[part]
            assert torch.equal(theirs, x), part
            assert torch.equal(theirs_quantized, quantized), part
