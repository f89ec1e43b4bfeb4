"""What the training loops refuse before any model loads, in process (tests/loops.py: QA-GRPO and QAD): bad settings
of either loop, written once over both; GRPO's dataset without an answer column; QAD's teacher checks (tokenizer,
memory); and what neither loop runs under torchrun. The loops' runs: tests/e2e/test_loops.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from qarl.config import ConfigError, PolicyConfig, RecipeConfig, load_recipe
from tests.loops import GRPO, QAD

BAD_INPUT = {
    GRPO: [
        (["trainer.rewards=[{name: no_such_reward}]"], "unknown reward"),
        (["trainer.num_generations=1"], "at least 2"),
        (["trainer.batch_size=10", "trainer.num_generations=4"], "not divisible"),
        (["policy.generation.quant_cfg=fp8_w8a8"], "allow_quant_mismatch"),
        (["task.name=dataset", "task.train_data=MISSING.jsonl", "task.eval_data=MISSING.jsonl"], "not found"),
        (["policy.master_dtype=float16", "policy.dtype=float16"], "cannot train"),
        (["policy.dtype=bfloat16", "policy.master_dtype=bfloat16", "policy.dtype=float32"], "narrower"),
        (["run.loggers=[nope]"], "unknown logger"),
        (["task.num_digits=300"], "train prompts are longer than the 248 tokens"),  # the engine's window, in tokens
        (["policy.tensor_parallel_size=2"], "needs policy.backend=megatron"),
        (["policy.backend=megatron", "policy.lora.mode=qlora"], "trains whole models"),
        (["policy.backend=megatron", "policy.tensor_parallel_size=2"], "a multiple of 2"),
        (["policy.backend=megatron", "policy.generation.quant_cfg=fp8_w8a8",
          "policy.generation.allow_quant_mismatch=true"], "policy's own format"),
        pytest.param(["policy.generation.sleep_between_rollouts=on"], "needs a CUDA GPU",
                     marks=pytest.mark.skipif(torch.cuda.is_available(), reason="allowed where CUDA is")),
    ],
    QAD: [
        (["trainer.batch_size=10", "trainer.num_generations=4"], "not divisible"),
        (["teacher.model_name=/no/such/teacher"], "model not found"),
        (["teacher.model_name=no-such-org/no-such-model"], "not in the Hugging Face cache.*HF_HUB_OFFLINE"),
        (["task.num_digits=300"], "train prompts are longer than the 248 tokens"),
    ],
}


def _case(loop, case):
    """pytest.param(loop, overrides, needle), named by the loop and the overrides, the case's marks kept."""
    overrides, needle = case.values if hasattr(case, "values") else case
    marks = case.marks if hasattr(case, "marks") else ()
    return pytest.param(loop, overrides, needle, marks=marks, id=f"{loop.name}: {' '.join(overrides)}")


@pytest.mark.parametrize("loop, overrides, needle",
                         [_case(loop, case) for loop, cases in BAD_INPUT.items() for case in cases])
def test_bad_input_fails_before_any_model_is_loaded(tmp_path, monkeypatch, loop, overrides, needle):
    """Either loop's own entry (qarl.train.train, qarl.distill.distill) refuses the settings by name; no model or
    engine was loaded and the run directory was not made."""
    import qarl.run

    def tripwire(*args, **kwargs):
        raise AssertionError("a model or engine was loaded before the input was checked")

    monkeypatch.setattr(qarl.run, "initial_policy", tripwire)
    monkeypatch.setattr(qarl.run, "load_policy_checkpoint", tripwire)
    monkeypatch.setattr(qarl.run, "VLLMEngine", tripwire)
    cfg = load_recipe(loop.recipe, [f"run.dir={tmp_path / 'run'}", *overrides], RecipeConfig)
    with pytest.raises(ConfigError, match=needle):
        loop.run_in_process(cfg)
    assert not (tmp_path / "run").exists()  # failed before the run started: nothing loaded, nothing written


# -- GRPO's own ------------------------------------------------------------------------------------
def test_dataset_without_the_answer_column_is_named(tmp_path):
    from qarl.train import train

    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "solution": "2"}) + "\n")
    cfg = load_recipe(GRPO.recipe, [f"run.dir={tmp_path / 'run'}", "task.name=dataset",
                                    f"task.train_data={data}", f"task.eval_data={data}"], RecipeConfig)
    with pytest.raises(ConfigError, match="no column 'answer'"):
        train(cfg)


# -- QAD's teacher checks --------------------------------------------------------------------------
def _qad_cfg(tmp_path: Path, *overrides: str) -> RecipeConfig:
    return load_recipe(QAD.recipe, [f"run.dir={tmp_path / 'run'}", *overrides], RecipeConfig)


def test_a_teacher_with_another_tokenizer_is_a_clear_error(tmp_path, tiny_dir):
    from transformers import AutoTokenizer

    from qarl.distill import check_tokenizers, distill

    other = tmp_path / "other_teacher"
    shutil.copytree(tiny_dir, other)
    tokenizer = AutoTokenizer.from_pretrained(other)
    tokenizer.add_tokens(["<extra>"])
    tokenizer.save_pretrained(other)
    with pytest.raises(ConfigError, match=r"does not share the student's tokenizer.*vocabularies differ") as e:
        check_tokenizers(tiny_dir, str(other))
    assert str(other) in str(e.value) and tiny_dir in str(e.value)
    with pytest.raises(ConfigError, match="teacher.model_name"):
        distill(_qad_cfg(tmp_path, f"teacher.model_name={other}"))
    assert not (tmp_path / "run").exists()  # failed before the run started: nothing loaded, nothing written


def test_a_teacher_that_does_not_fit_names_the_settings_to_change(tmp_path, tiny_dir):
    """A 68B-parameter teacher (architecture only: counted on the meta device) beside the tiny student."""
    from qarl.distill import distill

    huge = tmp_path / "huge_teacher"
    huge.mkdir()
    for f in Path(tiny_dir).iterdir():
        if "token" in f.name:
            shutil.copy(f, huge)
    config = json.loads((Path(tiny_dir) / "config.json").read_text())
    config.update(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                  num_key_value_heads=8, layer_types=["full_attention"] * 80)
    (huge / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"does not fit.*teacher.dtype.*smaller teacher.model_name.*kv_cache_gib"):
        distill(_qad_cfg(tmp_path, f"teacher.model_name={huge}"))
    assert not (tmp_path / "run").exists()


# -- either loop under torchrun --------------------------------------------------------------------
def test_what_the_loops_cannot_run_under_torchrun_is_refused(monkeypatch):
    """Before anything loads: the HF backend in several processes, an engine TP other than the processes'."""
    from qarl.config import GenerationConfig
    from qarl.policy import check_backend

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="torchrun started 2"):
        check_backend(PolicyConfig())
    generation = GenerationConfig(quant_cfg=PolicyConfig().quant_cfg, tensor_parallel_size=4)
    with pytest.raises(ConfigError, match="generation.tensor_parallel_size=4"):
        check_backend(PolicyConfig(backend="megatron", tensor_parallel_size=2, generation=generation))
