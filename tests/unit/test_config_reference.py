"""`qarl config` and the configuration reference: every key described, the docs page generated from the code, and
the defaults that decide what a user's model goes through."""

from __future__ import annotations

import subprocess
import sys

import yaml

from qarl import __version__
from qarl.config import RecipeConfig, load_recipe, schema_keys
from qarl.config_schema import markdown, sections
from tests.conftest import REPO



def _qarl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qarl", *args], cwd=REPO, capture_output=True, text=True, timeout=60)


def test_every_key_has_a_meaning_and_every_section_a_docstring():
    keys = [k for s in sections() for k in s.keys]
    assert [k.name for k in keys] == [k for k in schema_keys() if k in {x.name for x in keys}]
    assert len(keys) == len(schema_keys()) >= 100
    assert [k.name for k in keys if len(k.meaning) < 10] == [], "describe each key with a comment in qarl/config.py"
    assert [s.name for s in sections() if not s.meaning] == []


def test_ranges_appear_in_the_reference():
    by_name = {k.name: k for s in sections() for k in s.keys}
    assert by_name["trainer.batch_size"].allowed == ">= 1"
    assert by_name["policy.generation.top_p"].allowed == "> 0, <= 1"
    assert by_name["trainer.loss_type"].allowed == "grpo | dr_grpo | dapo | bnpo"


def test_the_docs_page_is_the_generated_one():
    page = REPO / "docs" / "reference" / "configuration.md"
    assert page.read_text() == markdown() + "\n", "regenerate: qarl config --schema --markdown > " + str(page)


def test_qarl_config_prints_the_resolved_recipe_with_every_default():
    proc = _qarl("config", "recipes/qa_grpo_tiny.yaml", "trainer.steps=7")
    assert proc.returncode == 0, proc.stderr
    printed = yaml.safe_load(proc.stdout)
    assert printed["trainer"]["steps"] == 7 and printed["trainer"]["weight_decay"] == 0.0  # a default, filled in
    assert printed["warm_start"]["enabled"] is True  # the embedded task's recipe asks for it


def test_version_and_help_answer_at_once():
    assert _qarl("--version").stdout.strip() == f"qarl {__version__}"
    for command in ("train", "distill", "eval", "parity", "matrix", "diagnose", "export", "config"):
        assert _qarl(command, "--help").returncode == 0


def test_a_pretrained_model_gets_no_warm_start_unless_asked():
    cfg = load_recipe(REPO / "qarl" / "recipe_defaults.yaml", ["policy.model_name=pypi:smollm2"], RecipeConfig)
    assert cfg.warm_start.enabled is False
