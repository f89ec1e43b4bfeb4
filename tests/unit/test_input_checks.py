"""The checks behind the early one-line errors, in process: what the CLI cases of tests/unit/test_recipe_errors.py do
not reach (ModelOpt's own schema, files a hand-written fixture cannot stand for, the Ctrl-C line) and what keeps the
light checks true to the libraries they read without importing (ModelOpt's names and schema fields)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from safetensors.torch import save_file

from qarl.cli import interrupted
from qarl.config import ConfigError, GenerationConfig, TaskConfig
from qarl.models.resolve import check_model_files, check_safetensors
from qarl.outputs import check_writable
from qarl.quant_cfg import builtin_config_names, check_quant_yaml, schema_fields, shipped_names
from qarl.tasks import ArithmeticTask, check_prompt_lengths, model_prompt_format
from qarl.tasks.dataset import check_data_files, load_problems
from tests.conftest import REPO



# -- quant configs: the light check reads ModelOpt's own names and fields ---------------------------------------
def test_the_builtin_names_read_without_modelopt_are_modelopts():
    from qarl.quant.formats import builtin_names

    assert builtin_config_names() == builtin_names()


@pytest.mark.parametrize("schema", ["QuantizeConfig", "QuantizerCfgEntry", "QuantizerAttributeConfig"])
def test_the_schema_fields_read_without_modelopt_are_modelopts(schema):
    import modelopt.torch.quantization.config as config

    assert schema_fields(schema) == sorted(getattr(config, schema).model_fields)


@pytest.mark.parametrize("name", shipped_names())
def test_the_shipped_quant_configs_pass_the_light_check(name):
    check_quant_yaml(REPO / "quant_configs" / f"{name}.yaml")


@pytest.mark.parametrize("body, message", [
    ("algorithm: max\nquant_cfg:\n  - quantizer_name: '*weight_quantizer'\n    cfg: {num_bits: e9m9}\n",
     r"invalid quant config .*bad.yaml: quant_cfg.cfg: Supported FPx quantization formats"),
    ("algorithm: maxx\nquant_cfg:\n  - quantizer_name: '*weight_quantizer'\n    cfg: {num_bits: e4m3}\n",
     r"algorithm 'maxx' is none of ModelOpt's calibration algorithms: .*awq_lite"),
])
def test_modelopts_schema_errors_are_one_line(tmp_path, body, message):
    """What only ModelOpt can judge (values), checked as a run resolves its formats, before any model loads."""
    from qarl.quant import resolve_format

    path = tmp_path / "bad.yaml"
    path.write_text(body)
    check_quant_yaml(path)  # the keys are ModelOpt's: the light check lets it through
    with pytest.raises(ConfigError, match=message) as caught:
        resolve_format(str(path))
    assert "\n" not in str(caught.value)


# -- data files -----------------------------------------------------------------------------------------------
def test_rows_of_csv_and_json_files_are_checked_and_named(tmp_path):
    csv = tmp_path / "d.csv"
    csv.write_text("prompt,answer\n12>,21\n34>\n")
    with pytest.raises(ConfigError, match=r"d.csv:3: 'answer' has no value"):
        load_problems(str(csv), "prompt", "answer")
    listed = tmp_path / "d.json"
    listed.write_text(json.dumps([{"prompt": "12>", "answer": 21}, ["34>", "43"]]))
    with pytest.raises(ConfigError, match=r"d.json item 2: a row is an object with 'prompt' and 'answer', not list"):
        load_problems(str(listed), "prompt", "answer")
    listed.write_text(json.dumps([{"prompt": "12>", "answer": 21}, {"prompt": "34>", "answer": {"x": 1}}]))
    with pytest.raises(ConfigError, match=r"d.json item 2: 'answer' is a dict"):
        load_problems(str(listed), "prompt", "answer")
    listed.write_text(json.dumps([{"prompt": "12>", "answer": 21}]))
    problems = load_problems(str(listed), "prompt", "answer")
    assert problems[0].answer == "21" and problems[0].where == f"{listed} item 1"  # a number is its text


def test_a_file_of_blank_lines_holds_no_rows(tmp_path):
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n\n")
    with pytest.raises(ConfigError, match="holds no rows"):
        check_data_files(TaskConfig(name="dataset", train_data=str(blank), eval_data=str(blank)))


# -- model directories ----------------------------------------------------------------------------------------
def test_a_real_safetensors_file_passes_and_a_cut_copy_is_named(tmp_path):
    whole = tmp_path / "model.safetensors"
    save_file({"a": torch.ones(3, 5), "b": torch.zeros(7)}, str(whole))
    check_safetensors(whole)
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(whole.read_bytes()[:-4])
    with pytest.raises(ConfigError, match=r"cut.safetensors is damaged: it holds \d+ bytes, its header describes"):
        check_safetensors(cut)


def test_a_shard_its_index_names_must_be_there(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "model-1.safetensors"}}))
    with pytest.raises(ConfigError, match="names model-1.safetensors, which is not in"):
        check_model_files(tmp_path)


# -- output paths ----------------------------------------------------------------------------------------------
def test_a_path_under_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(ConfigError, match=r"run.dir=.*f/run: .*f is a file, so no directory can be made under it"):
        check_writable(tmp_path / "f" / "run", "run.dir", "choose another")
    check_writable(tmp_path / "new" / "deeper", "run.dir", "choose another")  # made later, under a writable folder


# -- prompt lengths ------------------------------------------------------------------------------------------------
def test_prompt_lengths_are_measured_in_the_models_tokens(tiny_dir):
    prompts = model_prompt_format(tiny_dir, TaskConfig())
    task = ArithmeticTask(num_digits=5, num_train=20, num_eval=4)
    longest = check_prompt_lengths(prompts, {"train": task.train, "eval": task.eval}, GenerationConfig())
    assert longest == {split: len(prompts.ids(ps[0].prompt)) for split, ps in (("train", task.train),
                                                                              ("eval", task.eval))}
    window = GenerationConfig(max_model_len=longest["train"] + 7, max_new_tokens=8)  # one token short
    with pytest.raises(ConfigError, match=rf"20 of 20 train prompts are longer than the {longest['train'] - 1} "
                                          rf"tokens.*the longest \(train problem 1\) is {longest['train']} tokens: "
                                          rf"raise policy.generation.max_model_len to {longest['train'] + 8}"):
        check_prompt_lengths(prompts, {"train": task.train}, window)


# -- Ctrl-C ----------------------------------------------------------------------------------------------------------
def test_the_ctrl_c_line_names_the_last_checkpoint_and_the_resume_command(tmp_path):
    run_dir = tmp_path / "run"
    args = argparse.Namespace(command="train", recipe="recipes/qa_grpo_tiny.yaml",
                              overrides=[f"run.dir={run_dir}", "run.overwrite=true", "trainer.steps=40"])
    assert interrupted(args) == (f"interrupted (Ctrl-C) before the first checkpoint in {run_dir}: nothing to "
                                 "resume; start again with `qarl train recipes/qa_grpo_tiny.yaml "
                                 f"run.dir={run_dir} trainer.steps=40 run.overwrite=true`")
    for step in (2, 4):
        (run_dir / "checkpoints" / f"step_{step}").mkdir(parents=True)
        (run_dir / "checkpoints" / f"step_{step}" / "COMPLETE").write_text("")
    assert interrupted(args) == (f"interrupted (Ctrl-C); the last complete checkpoint is step_4 in {run_dir}: "
                                 "continue with `qarl train recipes/qa_grpo_tiny.yaml "
                                 f"run.dir={run_dir} trainer.steps=40 trainer.resume=true`")
    assert interrupted(argparse.Namespace(command="eval")) == "interrupted (Ctrl-C)"


def test_a_quant_config_not_in_utf8_is_one_error(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("quant_cfg: []  # caf\u00e9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="byte 0xe9 at offset 20 is not UTF-8"):
        check_quant_yaml(path)


def test_a_transfer_split_repeating_a_training_prompt_is_refused_as_the_files_are_read(tmp_path):
    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(3)]
    for name, part in (("train", rows), ("test", rows[:1]), ("transfer", rows[2:])):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    cfg = TaskConfig(name="dataset", train_data=str(tmp_path / "train.jsonl"), eval_data=str(tmp_path / "test.jsonl"),
                     transfer_data=str(tmp_path / "transfer.jsonl"))
    with pytest.raises(ConfigError, match="repeats training prompts of task.train_data \\(1, e.g. 'q2'\\)"):
        check_data_files(cfg)
