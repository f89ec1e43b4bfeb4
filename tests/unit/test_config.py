"""Recipes: inheritance, overrides, validation; quant config resolution and the generation check."""

from __future__ import annotations

import pytest

from qarl.config import ConfigError, RecipeConfig, load_recipe
from qarl.quant import check_generation_matches, resolve_format
from tests.conftest import REPO


def test_defaults_inheritance_and_overrides(tmp_path):
    (tmp_path / "base.yaml").write_text("policy:\n  quant_cfg: fp8_w8a8\ntrainer:\n  steps: 7\n")
    (tmp_path / "child.yaml").write_text("defaults: [base.yaml]\ntrainer:\n  lr: 0.5\n")
    cfg = load_recipe(tmp_path / "child.yaml", ["trainer.num_generations=4"], RecipeConfig)
    assert isinstance(cfg, RecipeConfig)
    assert (cfg.trainer.steps, cfg.trainer.lr, cfg.trainer.num_generations) == (7, 0.5, 4)
    assert cfg.policy.quant_cfg == "fp8_w8a8"
    assert cfg.policy.generation.quant_cfg == "fp8_w8a8"  # follows the policy unless set


@pytest.mark.parametrize("override, needle", [("trainer.stepz=3", "stepz"), ("trainer.steps=many", "steps"),
                                              ("policy.quant_cfg", "key.sub=value")])
def test_bad_keys_and_values_are_named(tmp_path, override, needle):
    (tmp_path / "r.yaml").write_text("run:\n  seed: 1\n")
    with pytest.raises(ConfigError, match=needle):
        load_recipe(tmp_path / "r.yaml", [override], RecipeConfig)


def test_misspelt_key_in_file_is_named(tmp_path):
    (tmp_path / "r.yaml").write_text("policy:\n  quant_cgf: fp8_w8a8\n")
    with pytest.raises(ConfigError, match="quant_cgf"):
        load_recipe(tmp_path / "r.yaml", [], RecipeConfig)


RECIPES = REPO / "recipes"


@pytest.mark.parametrize("recipe", sorted(p.name for p in RECIPES.glob("*.yaml")))
def test_shipped_recipes_load(recipe):
    load_recipe(RECIPES / recipe)


@pytest.mark.parametrize("recipe", sorted(p.name for p in RECIPES.glob("*.yaml")
                                           if not p.name.startswith(("matrix_", "parity_"))))
def test_shipped_recipes_pass_their_commands_checks(recipe):
    """Each training recipe, run by the command its header names, passes that command's checks as shipped: a
    setting inherited from another loop's recipe (a GRPO reward knob under QAD) would refuse it only at run time."""
    import re

    from qarl.config import check_grpo_recipe, check_qad_recipe

    text = (RECIPES / recipe).read_text()
    command = re.search(rf"qarl (train|distill) recipes/{re.escape(recipe)}", text)
    assert command, f"{recipe}: its header names no `qarl train` or `qarl distill` command for it"
    check = {"train": check_grpo_recipe, "distill": check_qad_recipe}[command.group(1)]
    check(load_recipe(RECIPES / recipe, schema=RecipeConfig))


@pytest.mark.parametrize("spec", ["quant_configs/nvfp4_a16.yaml", "nvfp4_w4a4", "fp8_w8a8", "NVFP4_DEFAULT_CFG",
                                  "W4A16_NVFP4_CFG", "FP8_DEFAULT_CFG"])
def test_quant_configs_resolve(spec):
    fmt = resolve_format(spec)
    assert fmt.quant_cfg[0] == {"quantizer_name": "*", "enable": False}


def test_shipped_yaml_equals_modelopt_builtin_numerics():
    """The shipped YAMLs spell out the same quantizers as ModelOpt's built-ins (dense-model entries)."""
    for yaml_name, builtin in [("nvfp4_a16", "W4A16_NVFP4_CFG"), ("nvfp4_w4a4", "NVFP4_DEFAULT_CFG"), ("fp8_w8a8", "FP8_DEFAULT_CFG")]:
        ours = {e["quantizer_name"]: e.get("cfg") for e in resolve_format(yaml_name).quant_cfg if e.get("cfg")}
        theirs = {e["quantizer_name"]: e.get("cfg") for e in resolve_format(builtin).quant_cfg if e.get("cfg")}
        strip = lambda cfgs: {k: {a: b for a, b in v.items() if a != "effective_bits"} for k, v in cfgs.items()}  # noqa: E731
        assert strip(ours) == strip(theirs)


@pytest.mark.parametrize("spec, needle", [("NVFP5_CFG", "unknown quant config"), ("quant_configs/missing.yaml", "missing.yaml")])
def test_unknown_quant_config_is_an_error(spec, needle):
    with pytest.raises(ConfigError, match=needle):
        resolve_format(spec)


def test_bad_yaml_field_is_named(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("algorithm: max\nquant_cfg:\n  - quantizer_name: '*weight_quantizer'\n    cfg: {num_bitz: 4}\n")
    with pytest.raises(ConfigError, match="num_bitz"):
        resolve_format(str(path))


def test_generation_quant_config_must_match():
    a, b = resolve_format("nvfp4_a16"), resolve_format("fp8_w8a8")
    check_generation_matches(a, resolve_format("quant_configs/nvfp4_a16.yaml"), allow_mismatch=False)
    with pytest.raises(ConfigError, match="allow_quant_mismatch"):
        check_generation_matches(a, b, allow_mismatch=False)
    with pytest.raises(ConfigError, match="differs"):
        check_generation_matches(a, None, allow_mismatch=False)
    check_generation_matches(a, b, allow_mismatch=True)  # an experiment the user asked for
