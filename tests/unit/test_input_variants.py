"""NVFP4 input variants (issue 72: W4A4's activation error): per-token second-level scales, 4-over-6 block scales and
Hadamard-rotated blocks,
qarl's ModelOpt backend `qarl_nvfp4` (qarl/quant/input_variants.py). The math against its definition, the policy's two
paths (ModelOpt's forward through the backend, qarl's fast path) against each other with their gradient, the config's
checks, and the export's refusal. The engine against the policy: tests/integration/test_engine.py."""

from __future__ import annotations

import copy

import pytest
import torch

from qarl.config import ConfigError
from qarl.export.targets import check_target_matches, load_target
from qarl.quant import resolve_format
from qarl.quant.formats import QuantFormat, format_from_yaml, format_to_yaml
from qarl.quant.input_variants import Variant, check_config, fake_quant
from qarl.quant.kernels.nvfp4_cpu import nvfp4_fake_quant
from qarl.quant.ops import InputQuant, fake_quant_input, plain_spec

from tests.conftest import tiny_policy

PER_TOKEN = "quant_configs/nvfp4_w4a4_per_token.yaml"
FOUR_OVER_SIX = "quant_configs/nvfp4_w4a4_four_over_six.yaml"
HADAMARD = "quant_configs/nvfp4_w4a4_hadamard.yaml"


def _activations(rows: int = 32, width: int = 256) -> torch.Tensor:
    """Rows of very different sizes, as a layer's tokens are, one of them an outlier 10^6 times the others: beyond
    the ~2^17 range of E4M3 block scales (448 down to 2^-9) under one per-tensor scale, the small rows' block scales
    underflow to zero."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, width, generator=g) * torch.rand(rows, 1, generator=g)
    x[3] *= 1e6
    return x


def test_neither_variant_is_nvfp4_as_modelopts_kernel_computes_it():
    """With both off the function is the plain format (equal on these values; the kernel's GPU reciprocal can round an
    exact midpoint otherwise, which is why plain NVFP4 keeps ModelOpt's op)."""
    x = _activations()
    assert torch.equal(fake_quant(x, x.abs().amax(), Variant()), nvfp4_fake_quant(x, x.abs().amax()))


def test_e2m1_ties_go_to_the_even_code():
    """Each midpoint of the E2M1 grid {0, .5, 1, 1.5, 2, 3, 4, 6} rounds to its neighbour with an even code (the
    lower at .25, 1.25, 2.5 and 5; the upper at .75, 1.75 and 3.5); above 6 saturates."""
    from qarl.quant.input_variants import _e2m1

    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 0.2600, 0.74])
    assert _e2m1(mids).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 0.5, 0.5]


def test_per_token_scales_follow_each_row_and_ignore_the_amax():
    x = _activations()
    per_token = fake_quant(x, torch.tensor(1.0), Variant(per_token=True))
    assert torch.equal(per_token, fake_quant(x, torch.tensor(123.0), Variant(per_token=True)))
    powers = 2.0 ** torch.arange(-8, 24).float().unsqueeze(1)  # a row scaled by a power of two: the same codes
    assert torch.equal(fake_quant(x * powers, torch.tensor(1.0), Variant(per_token=True)), per_token * powers)
    for row in range(x.shape[0]):  # each row alone: its own tensor, its own amax
        alone = x[row:row + 1]
        assert torch.equal(per_token[row:row + 1], nvfp4_fake_quant(alone, alone.abs().amax()))
    small = [r for r in range(x.shape[0]) if r != 3]  # beside the outlier, per-token scales keep the rows
    per_tensor = fake_quant(x, x.abs().amax(), Variant())
    assert ((per_token - x)[small] ** 2).sum() < 0.5 * ((per_tensor - x)[small] ** 2).sum()


def test_four_over_six_takes_the_better_block_and_never_errs_more():
    x = _activations()
    amax = x.abs().amax()
    six, chosen = fake_quant(x, amax, Variant()), fake_quant(x, amax, Variant(four_over_six=True))
    block_error = lambda q: ((q - x) ** 2).reshape(x.shape[0], -1, 16).sum(-1)  # noqa: E731
    assert (block_error(chosen) <= block_error(six)).all()
    assert (block_error(chosen) < block_error(six)).float().mean() > 0.2  # 4 wins often, not never
    per_token, both = fake_quant(x, amax, Variant(per_token=True)), fake_quant(x, amax, Variant(True, True))
    assert (block_error(both) <= block_error(per_token)).all()  # together: per-token scales, then the better block


def test_the_hadamard_rotation_is_sylvesters_normalized_and_its_own_inverse():
    from qarl.quant.input_variants import _hadamard

    sylvester = torch.ones(1, 1)
    while sylvester.shape[0] < 16:
        sylvester = torch.cat([torch.cat([sylvester, sylvester], 1), torch.cat([sylvester, -sylvester], 1)])
    assert torch.equal(_hadamard(torch.eye(16).reshape(16, 1, 16)).reshape(16, 16), sylvester / 4)
    x = _activations(8, 64).reshape(8, 4, 16)
    assert torch.allclose(_hadamard(_hadamard(x)), x, rtol=1e-6, atol=1e-6 * x.abs().max())


def test_hadamard_rotates_each_row_alone_and_errs_as_much_on_gaussian_blocks():
    """A row's result does not depend on the others (the rotation's sums have a fixed order, whatever the number of
    rows); on Gaussian blocks, which a rotation leaves Gaussian, the error is the unrotated one's within 5 %; on a
    block with one outlier it is larger (the outlier's magnitude spreads over the block, whose E2M1 codes are then
    all coarse): the measured reason not to expect much of it (docs/results/smollm2.md)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 64, generator=g)
    amax, rotated, plain = torch.tensor(1.0), Variant(True, False, True), Variant(per_token=True)
    error = lambda variant: (((fake_quant(x, amax, variant) - x) ** 2).sum() / (x ** 2).sum()).item()  # noqa: E731
    assert error(rotated) == pytest.approx(error(plain), rel=0.05)
    for rows in (1, 5, 17):
        assert torch.equal(fake_quant(x[:rows], amax, rotated), fake_quant(x, amax, rotated)[:rows])
    x[:, ::16] = 10.0
    assert error(rotated) > 1.1 * error(plain)


def test_the_variant_keeps_the_inputs_dtype_and_shape_and_pads_a_ragged_last_block_with_zeros():
    x = _activations(width=40).bfloat16().reshape(4, 8, 40)
    out = fake_quant(x, torch.tensor(3.0), Variant(True, True))
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    padded = torch.nn.functional.pad(x, (0, 8))
    assert torch.equal(out, fake_quant(padded, torch.tensor(3.0), Variant(True, True))[..., :40])


def test_the_engines_op_computes_the_variant():
    x = _activations()
    spec = InputQuant("nvfp4", block_size=16, per_token=True, four_over_six=True)
    expected = fake_quant(x, torch.tensor(1.0), Variant(True, True))
    assert torch.equal(fake_quant_input(x, torch.tensor(1.0), spec), expected)


@pytest.mark.parametrize("fmt", [PER_TOKEN, FOUR_OVER_SIX, HADAMARD])
def test_the_policys_two_paths_agree_with_a_straight_through_gradient(task, tiny_dir, fmt):
    """ModelOpt's forward (through the backend) and qarl's fast path (`plain_spec` reads the variant) give the same
    bits, and the gradient passes straight through both."""
    policy = tiny_policy(task, tiny_dir, fmt)
    layer = policy.model.model.layers[0].mlp.down_proj
    quantizer = layer.input_quantizer
    spec = plain_spec(quantizer)
    assert spec.variant == Variant(per_token=fmt != FOUR_OVER_SIX, four_over_six=fmt == FOUR_OVER_SIX,
                                   hadamard=fmt == HADAMARD)
    x = _activations(8, layer.in_features).requires_grad_()
    fast = quantizer(x)
    modelopt = type(quantizer).__mro__[1].forward(quantizer, x)  # the class qarl's fast path was mixed into
    assert torch.equal(fast, modelopt)
    assert not torch.equal(fast, x)
    (grad,) = torch.autograd.grad((fast * 3).sum(), x)
    assert torch.equal(grad, torch.full_like(x, 3.0))
    (grad,) = torch.autograd.grad((modelopt * 3).sum(), x)
    assert torch.equal(grad, torch.full_like(x, 3.0))


def _config_with(**input_cfg) -> list[dict]:
    fmt = resolve_format(PER_TOKEN)
    cfg = copy.deepcopy(fmt.quant_cfg)
    for entry in cfg:
        if entry["quantizer_name"] == "*input_quantizer":
            entry["cfg"].update(input_cfg)
    return cfg


@pytest.mark.parametrize("change, error", [
    ({"backend_extra_args": {"per_token": False}}, "must set per_token, four_over_six and/or hadamard to true"),
    ({"backend_extra_args": {"hadamard": True}}, "set per_token: true beside it"),
    ({"backend_extra_args": {"per_tokens": True}}, "unknown: per_tokens"),
    ({"backend_extra_args": {"per_token": "yes"}}, "booleans"),
    ({"num_bits": (4, 3)}, "give it num_bits: e2m1"),
    ({"block_sizes": {-1: 32, "type": "dynamic", "scale_bits": (4, 3)}}, "block_sizes"),
])
def test_a_bad_variant_config_is_refused_naming_the_entry(change, error):
    with pytest.raises(ConfigError, match=error):
        check_config(_config_with(**change), "my.yaml")


def test_the_variant_on_weights_is_refused():
    cfg = _config_with()
    cfg.append({"quantizer_name": "*weight_quantizer", "cfg": dict(cfg[2]["cfg"])})
    with pytest.raises(ConfigError, match="layer inputs only"):
        check_config(cfg, "my.yaml")


def test_a_checkpoints_format_keeps_its_variant():
    fmt = resolve_format(FOUR_OVER_SIX)
    again = format_from_yaml(format_to_yaml(fmt))
    assert isinstance(again, QuantFormat) and again.fingerprint() == fmt.fingerprint()


@pytest.mark.parametrize("fmt, named", [(PER_TOKEN, "per-token scales"), (FOUR_OVER_SIX, "4-over-6 block scales"),
                                        ("quant_configs/nvfp4_w4a4_four_over_six_all.yaml", "4-over-6 block scales"),
                                        ("quant_configs/nvfp4_w4a4_four_over_six_all_down_a16.yaml",
                                         "4-over-6 block scales"),
                                        (HADAMARD, "per-token scales and Hadamard-rotated blocks")])
def test_an_export_refuses_a_variant_by_name(fmt, named):
    for target in ("nvfp4_w4a4_modelopt", "nvfp4_w4a4_compressed_tensors"):
        with pytest.raises(ConfigError, match=f"{named}.*training-time result"):
            check_target_matches(resolve_format(fmt), load_target(target))
