"""Frozen quantized weights kept as their codes (qarl/quant/packed.py): the same bits as the held weight in every
shipped format, forward and backward, in the fold the engine loads and after a resume; a quarter of the memory;
refusals where the codes could no longer be what the quantizer computes. A qlora run end to end:
tests/e2e/test_lora_runs.py; its export: tests/integration/test_lora_engine.py."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch

from qarl.checkpoint import load_policy_checkpoint
from qarl.config import ConfigError, LoraConfig, PolicyConfig
from qarl.lora import check_lora, lora_layers
from qarl.memory import ModelShape, weight_bytes
from qarl.metrics import storage_bytes, weight_memory
from qarl.optim import PolicyOptimizer
from qarl.quant import folded_weights, pack_frozen_weights, resolve_format
from qarl.quant.packed import PackedWeightMixin, is_placeholder, packed_bytes_per_weight, unpack_frozen_weights
from tests.conftest import W4A16, answer_loss, eval_logits, tiny_policy

FORMATS = {"nvfp4_w4a16": W4A16, "nvfp4_w4a4": "quant_configs/nvfp4_w4a4.yaml", "fp8_w8a8": "quant_configs/fp8_w8a8.yaml"}


def qlora(task, tiny_dir, quant_cfg: str, dtype: str = "float32", pack: bool = True, **overrides):
    """A trainable qlora tiny policy, B drawn at random so the adapters matter."""
    policy = tiny_policy(task, tiny_dir, quant_cfg, trainable=True, dtype=dtype,
                         lora=LoraConfig(mode="qlora", pack_base=pack), **overrides)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, layer in lora_layers(policy.model):
            layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=generator) * 0.05)
    return policy


def adapter_grads(policy, task) -> list[torch.Tensor]:
    answer_loss(policy, task).backward()
    return [p.grad for _, p in sorted(policy.model.named_parameters()) if p.requires_grad]


def packed_layers(model) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m._modules.get("weight_quantizer"), PackedWeightMixin)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_a_packed_base_computes_the_held_weights_bits(task, tiny_dir, fmt, dtype):
    held, packed = qlora(task, tiny_dir, FORMATS[fmt], dtype, pack=False), qlora(task, tiny_dir, FORMATS[fmt], dtype)
    assert len(packed_layers(packed.model)) == 14 and not packed_layers(held.model)  # 2 layers x 7 projections
    assert torch.equal(eval_logits(packed, task), eval_logits(held, task))
    want, got = dict(folded_weights(held.model)), dict(folded_weights(packed.model))  # what the engine loads
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert all(torch.equal(a, b) for a, b in zip(adapter_grads(packed, task), adapter_grads(held, task), strict=True))
    assert all(is_placeholder(m.weight) for n, m in packed.model.named_modules() if n in packed_layers(packed.model))


def test_a_packed_base_takes_under_0p6_bytes_a_quantized_parameter(task, tiny_dir):
    policy = qlora(task, tiny_dir, W4A16, "bfloat16")
    layers = dict(policy.model.named_modules())
    quantized = sum(layers[n].weight.numel() for n in packed_layers(policy.model))
    others = [t for n, t in [*policy.model.named_parameters(), *policy.model.named_buffers()]
              if n.rpartition(".")[0] not in packed_layers(policy.model) and "lora_" not in n and "_quantizer" not in n]
    optimizer = PolicyOptimizer(policy, lr=1e-3, weight_decay=0.0, max_grad_norm=1.0)
    measured = weight_memory(policy.model, optimizer, None)["memory/policy_weight_bytes"]
    assert measured <= 0.6 * quantized + storage_bytes(others) + 4096  # + the quantizers' amax and the placeholders
    unpacked = weight_memory(qlora(task, tiny_dir, W4A16, "bfloat16", pack=False).model, optimizer, None)
    assert measured < 0.5 * unpacked["memory/policy_weight_bytes"]
    # the memory plan counts the same bytes from the shape and the format alone
    shape = ModelShape.of(tiny_dir)
    assert shape.linear_params == quantized
    assert weight_bytes(shape, "bfloat16", resolve_format(W4A16)) == 2 * (shape.params - quantized) + 0.5625 * quantized
    assert packed_bytes_per_weight(resolve_format("quant_configs/fp8_w8a8.yaml")) == 1.0
    assert packed_bytes_per_weight(resolve_format("NVFP4_FOUR_OVER_SIX_CFG")) is None


def test_a_resumed_qlora_policy_is_packed_once_it_has_its_amax(task, tiny_dir, tmp_path):
    policy = qlora(task, tiny_dir, W4A16, "bfloat16")
    policy.save(tmp_path)
    resumed = load_policy_checkpoint(tmp_path, PolicyConfig(dtype="bfloat16", lora=LoraConfig(mode="qlora")))
    assert packed_layers(resumed.model) == packed_layers(policy.model)
    assert torch.equal(eval_logits(resumed, task), eval_logits(policy, task))


def test_gradient_checkpointing_through_a_packed_base_keeps_the_gradients(task, tiny_dir):
    plain = qlora(task, tiny_dir, W4A16)
    checkpointed = qlora(task, tiny_dir, W4A16, gradient_checkpointing="on")
    checkpointed.model.train()
    plain.model.train()
    assert all(torch.equal(a, b) for a, b in zip(adapter_grads(checkpointed, task), adapter_grads(plain, task),
                                                 strict=True))


def test_any_frozen_quantized_model_packs_and_formats_without_codes_are_named(task, tiny_dir):
    reference = tiny_policy(task, tiny_dir, W4A16).model.eval().requires_grad_(False)  # a KL reference
    want = head_logits(reference)  # a forward: each lean layer has planned its calls (`LinearPlan`)
    weights = {n: weakref.ref(m.weight) for n, m in reference.named_modules() if hasattr(m, "weight_quantizer")}
    report = pack_frozen_weights(reference)
    assert report.packed == 14 and not report.kept and report.bytes_after < 0.3 * report.bytes_before
    gc.collect()
    assert not [n for n in packed_layers(reference) if weights[n]() is not None]  # not even the plans of the forward
    assert torch.equal(head_logits(reference), want)
    static = tiny_policy(task, tiny_dir, "NVFP4_FOUR_OVER_SIX_CFG").model.requires_grad_(False)
    report = pack_frozen_weights(static)  # static block scales: no packed form; kept and said so
    assert report.packed == 0 and len(report.kept) == 14 and "kept in the compute dtype" in report.summary()
    trainable = tiny_policy(task, tiny_dir, W4A16).model  # weights that train are never packed
    assert pack_frozen_weights(trainable).packed == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the caching allocator of a CUDA device")
def test_packing_on_a_gpu_gives_the_weights_memory_back_to_the_device():
    """The codes take device memory only once every weight is freed and the cache emptied (`packed._move_codes`):
    carved out of a block the caching allocator holds freed (calibration's activations, a weight packed before), they
    would keep that whole block from the device, and from the engine that starts next."""
    import modelopt.torch.quantization as mtq

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096, bias=False) for _ in range(8)]).to("cuda", torch.bfloat16)
    x = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16)
    mtq.quantize(model, resolve_format(W4A16).modelopt_cfg, forward_loop=lambda m: m(x))
    model.requires_grad_(False)
    with torch.no_grad():
        want = model(x)
    weights = sum(layer.weight.numel() * layer.weight.element_size() for layer in model)
    scratch = torch.empty(2**30, dtype=torch.uint8, device="cuda")  # a calibration pass's activations, freed, cached
    del scratch
    assert pack_frozen_weights(model).packed == 8
    cached = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    assert cached < weights / 4, (cached, weights)  # neither the scratch block nor the weights' blocks are kept
    with torch.no_grad():
        assert torch.equal(model(x), want)


def head_logits(model) -> torch.Tensor:
    ids = torch.tensor([[3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]], device=next(model.parameters()).device)
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_a_placeholder_is_told_from_a_tensor_whatever_its_shape():
    from qarl.quant.packed import placeholder

    shapes = [((8, 16), False), ((1, 16), False), ((16, 1), False), ((4, 8, 16), True), ((1, 8, 16), True)]
    for shape, experts in shapes:
        assert is_placeholder(placeholder(torch.Size(shape), torch.float32, "cpu", experts)), shape
    assert not any(is_placeholder(t) for t in (torch.zeros(8, 16), torch.zeros(1, 16), torch.zeros(4, 8, 16)))


def test_copies_stay_packed_and_unpacking_gives_the_held_weight_back(task, tiny_dir):
    policy = qlora(task, tiny_dir, W4A16, "bfloat16")
    want = eval_logits(policy, task)
    copied = copy.deepcopy(policy.model)
    assert storage_bytes(copied.parameters()) == storage_bytes(policy.model.parameters())  # no NaN tensor made
    assert unpack_frozen_weights(copied) == 14 and not packed_layers(copied)
    folded = dict(folded_weights(policy.model))
    layers = dict(copied.named_modules())
    assert all(torch.equal(layers[n].weight, folded[f"{n}.weight"]) for n in packed_layers(policy.model))
    policy.model = copied
    assert torch.equal(eval_logits(policy, task), want)  # W_q quantized again is W_q


def test_a_packed_base_refuses_what_would_change_its_numbers(task, tiny_dir):
    policy = qlora(task, tiny_dir, W4A16)
    name = packed_layers(policy.model)[0]
    layer = dict(policy.model.named_modules())[name]
    with pytest.raises(RuntimeError, match="called with another tensor"):
        layer.weight_quantizer(torch.zeros(layer.weight.shape))
    eval_logits(policy, task)  # decoded once: the amax check is now the cheap one, which must still see a write
    layer.weight_quantizer.amax = layer.weight_quantizer.amax * 2
    with pytest.raises(RuntimeError, match="amax was changed"):
        eval_logits(policy, task)
    layer.weight_quantizer.amax = layer.weight_quantizer.amax / 2  # the value it was encoded with: fine again
    eval_logits(policy, task)
    layer.weight_quantizer.disable()
    with pytest.raises(RuntimeError, match="disabled or put into calibration"):
        eval_logits(policy, task)
    with pytest.raises(RuntimeError, match="disabled or put into calibration"):  # never a NaN weight to the engine
        dict(folded_weights(policy.model))
    with pytest.raises(ConfigError, match="quant_weight_cache"):
        check_lora(PolicyConfig(quant_weight_cache=False, lora=LoraConfig(mode="qlora")), tiny_dir)
