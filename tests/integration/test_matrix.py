"""`qarl matrix` and `qarl diagnose` on real models: the checks that refuse bad input before any model loads (on a
warm-started base and its checkpoints), a small matrix end to end (real vLLM, real ModelOpt PTQ), and the diagnosis.
The table's arithmetic and the CLI's refusals: tests/unit/test_matrix_stats.py."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from qarl.checkpoint import save_checkpoint
from qarl.config import ConfigError, RecipeConfig, TaskConfig, WarmStartConfig, load_recipe
from qarl.matrix import FULL, TRAINED, plan_matrix, run_matrix
from qarl.models.resolve import cache_dir
from qarl.policy import build_policy
from qarl.tasks import ArithmeticTask
from qarl.warm_start import warm_start


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_dir):
    """A warm-started base (qa_grpo_tiny's, cached), a checkpoint of its very weights trained-format
    NVFP4 W4A16 (calibrated amax), and a perturbed copy of it as a Hugging Face directory."""
    task = ArithmeticTask(num_train=2000, num_eval=1000, seed=0)
    base = warm_start(tiny_dir, task.train, WarmStartConfig(steps=46, lr=3.0e-3), 0, cache_dir(), TaskConfig())
    root = tmp_path_factory.mktemp("matrix_models")
    cfg = load_recipe("recipes/qa_grpo_tiny.yaml", [], RecipeConfig)
    policy = build_policy(cfg.policy, task.calibration_texts(64), model_dir=base)
    save_checkpoint(root / "same", 1, policy, {"step": 1})
    noisy = build_policy(cfg.policy, [], model_dir=base, fmt=None)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in noisy.model.parameters():
            p.add_(0.02 * torch.randn_like(p) * p.std())
    noisy.model.save_pretrained(root / "noisy", safe_serialization=True)
    noisy.tokenizer.save_pretrained(root / "noisy")
    return {"base": base, "same": str(root / "same"), "noisy": str(root / "noisy"), "root": root}


def _cfg(made: dict, **matrix) -> RecipeConfig:
    cfg = load_recipe("recipes/matrix_tiny.yaml", ["task.num_eval=1000"], RecipeConfig)
    settings = dict(base=made["base"], models={"same": [made["same"]], "noisy": [made["noisy"]]},
                    formats=["quant_configs/nvfp4_w4a4.yaml"], ptq_methods=["max", "awq_lite"], num_prompts=48,
                    out=tempfile.mkdtemp(dir=made["root"], prefix="out_"))  # each matrix its own: none overwrites
    settings.update(matrix)
    return dataclasses.replace(cfg, matrix=dataclasses.replace(cfg.matrix, **settings))


def test_bad_input_is_refused_before_any_model_loads(models, tmp_path):
    with pytest.raises(ConfigError, match="held-out set is empty"):
        plan_matrix(_cfg(models, num_prompts=0))
    with pytest.raises(ConfigError, match="raise task.num_eval"):
        plan_matrix(_cfg(models, num_prompts=5000))
    with pytest.raises(ConfigError, match="does not exist"):
        plan_matrix(_cfg(models, models={"x": [str(tmp_path / "nope")]}))
    earlier = tmp_path / "earlier"  # an earlier matrix's out: kept unless run.overwrite replaces it
    earlier.mkdir()
    (earlier / "matrix.json").write_text("{}")
    with pytest.raises(ConfigError, match="holds an earlier matrix.*run.overwrite=true"):
        plan_matrix(_cfg(models, out=str(earlier)))
    replacing = _cfg(models, out=str(earlier))
    plan_matrix(dataclasses.replace(replacing, run=dataclasses.replace(replacing.run, overwrite=True)))
    with pytest.raises(ConfigError, match=r"matrix.ptq_methods \['awq_best'\]"):
        plan_matrix(_cfg(models, ptq_methods=["awq_best"]))
    with pytest.raises(ConfigError, match="matrix columns repeat"):
        plan_matrix(_cfg(models, ptq_methods=["max", "default"]))  # nvfp4_w4a4's own algorithm is max
    with pytest.raises(ConfigError, match="seeds of matrix.models.mixed were trained in different formats"):
        plan_matrix(_cfg(models, models={"mixed": [models["same"], models["noisy"]]}))
    # a run that started from another warm start than the matrix's base
    run = tmp_path / "other_base_run"
    shutil.copytree(models["same"], run)
    other = load_recipe("recipes/matrix_tiny.yaml", ["warm_start.seed=5"], RecipeConfig)
    (run / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(other)))
    with pytest.raises(ConfigError, match="did not start from the matrix's base"):
        plan_matrix(_cfg(models, base="warm-start", models={"other": [str(run)]}))
    # a tokenizer that differs from the base's (the task's): one token renamed
    other = tmp_path / "other_tokenizer"
    shutil.copytree(models["noisy"], other)
    vocab_file = next(p for p in other.iterdir() if p.name == "tokenizer.json")
    text = json.loads(vocab_file.read_text())
    text["model"]["vocab"]["@"] = text["model"]["vocab"].pop("9")
    vocab_file.write_text(json.dumps(text))
    with pytest.raises(ConfigError, match="does not share the base's tokenizer"):
        plan_matrix(_cfg(models, models={"other": [str(other)]}))
    # a format whose block size does not divide the model's layers (128 and 384 wide)
    blocky = tmp_path / "nvfp4_block256.yaml"
    blocky.write_text(open("quant_configs/nvfp4_w4a4.yaml").read().replace("-1: 16", "-1: 256"))
    with pytest.raises(ConfigError, match="block size does not divide"):
        plan_matrix(_cfg(models, formats=[str(blocky)]))


def test_a_later_stage_is_traced_to_the_base_through_the_runs_it_started_from(models, tmp_path):
    """A pipeline's later stage (QA-GRPO from a QAD checkpoint) names the earlier run's checkpoint as its model: the
    matrix follows that chain to the first stage, whose start must be the base; a first stage from another base, or an
    earlier stage's checkpoint that is gone, is refused by name."""
    def stage(name: str, overrides: list[str]) -> Path:
        run = tmp_path / name
        shutil.copytree(models["same"], run)
        recipe = load_recipe("recipes/matrix_tiny.yaml", overrides, RecipeConfig)
        (run / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(recipe)))
        return run

    first = stage("first", [])
    second = stage("second", [f"policy.model_name={first / 'checkpoints' / 'step_1'}"])
    third = stage("third", [f"policy.model_name={second}"])  # a run directory: its newest checkpoint
    plan_matrix(_cfg(models, base="warm-start", models={"chain": [str(third)]}))

    elsewhere = stage("elsewhere", ["warm_start.seed=5"])
    later = stage("later", [f"policy.model_name={elsewhere / 'checkpoints' / 'step_1'}"])
    with pytest.raises(ConfigError, match=r"elsewhere/checkpoints/step_1 \(the first stage of .*later\) did not start"):
        plan_matrix(_cfg(models, base="warm-start", models={"later": [str(later)]}))

    orphan = stage("orphan", [f"policy.model_name={tmp_path / 'deleted' / 'checkpoints' / 'step_9'}"])
    with pytest.raises(ConfigError, match="started from the checkpoint .*deleted.* which is gone"):
        plan_matrix(_cfg(models, base="warm-start", models={"orphan": [str(orphan)]}))


@pytest.fixture(scope="module")
def small_matrix(models):
    return run_matrix(_cfg(models))


def test_small_matrix_end_to_end(small_matrix):
    report, out = small_matrix
    assert {p for p in report["precisions"]} == {FULL, "nvfp4_w4a4 max", "nvfp4_w4a4 awq_lite", "nvfp4_a16 max", TRAINED}
    assert list(report["splits"]) == ["test"], "the embedded task has no transfer split"
    split = report["splits"]["test"]
    acc, gains, surv = split["accuracy"], split["gain"], split["survival"]
    assert 0.05 < acc["base"][FULL]["mean"] < 0.6, "the warm-started base is partly right"
    # the checkpoint holds the base's own weights: no gain anywhere, to the prompt, even at its trained
    # quantization (its amax = max calibration on the same data = the base's nvfp4_a16 max column)
    for precision, cell in gains["same"].items():
        assert cell == {"mean": 0.0, "se": 0.0}, precision
    assert acc["same"][TRAINED]["mean"] == acc["base"]["nvfp4_a16 max"]["mean"]
    # the noisy copy: the table's numbers are the accuracies' differences
    for precision in report["precisions"]:
        if precision in acc["noisy"]:
            expected = acc["noisy"][precision]["mean"] - acc["base"][precision]["mean"]
            assert gains["noisy"][precision]["mean"] == pytest.approx(expected, abs=1e-12)
    q = "nvfp4_w4a4 max"
    assert surv["noisy"][q]["mean"] == pytest.approx(gains["noisy"][q]["mean"] - gains["noisy"][FULL]["mean"], abs=1e-12)
    assert TRAINED not in acc["noisy"]  # a Hugging Face directory has no trained quantization
    assert set(acc["same"]) == {FULL, TRAINED}, "a row trained quantized: unquantized and its own format, no PTQ"
    # the share of the one unquantized trained row's gain: none here (the noisy copy is no run of qarl's)
    assert report["reference"] is None and split["share"] == {}
    # paired tests: the checkpoint of the base's own weights against the base, in its own format, differs nowhere
    same = next(c for c in split["paired"] if c["a"] == ["same", TRAINED] and c["b"] == ["base", "nvfp4_a16 max"])
    assert same["same_format"] and same["difference"] == 0.0 and same["ci95"] == [0.0, 0.0] and same["p"] == 1.0
    n = split["num_prompts"]
    assert n == 48 and acc["base"][FULL]["se"] == pytest.approx(
        math.sqrt(acc["base"][FULL]["mean"] * (1 - acc["base"][FULL]["mean"]) / n))
    for cell in acc["noisy"].values():  # evaluation hygiene of every cell
        assert 0 <= cell["parse_rate"] <= 1 and cell["truncation_rate"] + cell["stop_rate"] == pytest.approx(1.0)
        assert cell["mean_length"] > 0
    assert json.loads((out / "matrix.json").read_text())["precisions"] == report["precisions"]
    text = (out / "matrix.md").read_text()
    assert "Gain survival" in text and "Paired comparisons" in text and (out / "matrix.png").stat().st_size > 10_000


def test_a_base_alone_gets_its_precision_columns_as_in_a_whole_matrix(models, small_matrix):
    """matrix.models empty: the base at every format and PTQ method (which PTQ suits a model before training), the same
    cells, to the prompt, as the base row of a matrix with models."""
    whole, _ = small_matrix
    report, out = run_matrix(_cfg(models, models={}, ptq_methods=["max"], out=str(models["root"] / "alone")))
    split, whole = report["splits"]["test"], whole["splits"]["test"]
    assert report["precisions"] == [FULL, "nvfp4_w4a4 max"] and list(split["accuracy"]) == ["base"]
    for precision in report["precisions"]:
        assert split["accuracy"]["base"][precision] == whole["accuracy"]["base"][precision], precision
    assert split["gain"] == {} and report["reference"] is None
    text = (out / "matrix.md").read_text()
    assert "Held-out accuracy" in text and "Gain survival" not in text and (out / "matrix.png").is_file()


def test_a_task_with_a_transfer_split_gets_its_tables_beside_the_test_split(models, small_matrix, tmp_path):
    """The embedded task as a dataset task (its own problems in files), with a transfer split of 6-digit reversals
    (the base learnt 5-digit ones): every cell is scored on both splits in one batch; the test split's cells equal
    the arithmetic task's matrix unquantized, to the prompt (its PTQ calibrates on prompts without their answers); the
    transfer split gets its own tables and paired tests."""
    task = ArithmeticTask(num_train=2000, num_eval=1000, seed=0)
    files = {}
    for split, problems in (("train", task.train), ("test", task.eval[:48]),
                            ("transfer", ArithmeticTask(num_digits=6, num_train=1, num_eval=32, seed=1).eval)):
        files[split] = tmp_path / f"{split}.jsonl"
        files[split].write_text("".join(json.dumps({"prompt": p.prompt, "answer": p.answer}) + "\n" for p in problems))
    cfg = _cfg(models, models={"noisy": [models["noisy"]]}, ptq_methods=["max"], num_transfer_prompts=32)
    cfg = dataclasses.replace(cfg, task=dataclasses.replace(
        cfg.task, name="dataset", train_data=str(files["train"]), eval_data=str(files["test"]),
        transfer_data=str(files["transfer"])))
    with pytest.raises(ConfigError, match="matrix.num_transfer_prompts=33 but the task's transfer split has 32"):
        plan_matrix(dataclasses.replace(cfg, matrix=dataclasses.replace(cfg.matrix, num_transfer_prompts=33)))
    report, out = run_matrix(cfg)
    test, transfer = report["splits"]["test"], report["splits"]["transfer"]
    assert (test["num_prompts"], transfer["num_prompts"]) == (48, 32)
    whole = small_matrix[0]["splits"]["test"]["accuracy"]
    for model in ("base", "noisy"):
        assert test["accuracy"][model][FULL] == whole[model][FULL], model
    assert set(transfer["accuracy"]["noisy"]) == {FULL, "nvfp4_w4a4 max"}
    assert transfer["accuracy"]["base"][FULL]["mean"] < test["accuracy"]["base"][FULL]["mean"], "6 digits are harder"
    assert len(transfer["paired"]) == 6 and all(0 <= c["p"] <= 1 for c in transfer["paired"])
    assert "## The transfer split (32 prompts)" in (out / "matrix.md").read_text()


def test_diagnose_statistics_and_report(models, tmp_path):
    from qarl.diagnose import moments, run_diagnose

    gaussian = moments(torch.randn(200_000, generator=torch.Generator().manual_seed(0)))
    assert gaussian["kurtosis"] == pytest.approx(3.0, abs=0.05)
    assert gaussian["outlier_fraction"] == pytest.approx(0.0027, abs=0.0005)
    cfg = load_recipe("recipes/matrix_tiny.yaml", [], RecipeConfig)
    also = ["quant_configs/nvfp4_w4a4_four_over_six.yaml", "quant_configs/nvfp4_w4a4_down_a16.yaml",
            "quant_configs/nvfp4_w4a4_four_over_six_all.yaml", "quant_configs/nvfp4_w4a4_down_bf16.yaml"]
    report = run_diagnose(cfg, [models["base"], models["noisy"]], tmp_path, also)
    layers = report[models["base"]]
    assert len(layers) == 2 * 7
    for row in layers.values():  # 4-bit is coarser than 8-bit, for weights, inputs and outputs alike
        for kind in ("weight", "input", "output"):
            assert 0 < row[f"{kind}_error_fp8"] < row[f"{kind}_error_nvfp4"] < 0.5
    for name, row in layers.items():  # 4-over-6 never errs more on an input; down_proj's input is not quantized
        assert 0 < row["input_error_nvfp4_w4a4_four_over_six"] < row["input_error_nvfp4"]
        assert (row["input_error_nvfp4_w4a4_down_a16"] == 0) == name.endswith("down_proj")
        assert (row["output_error_nvfp4_w4a4_down_bf16"] == 0) == name.endswith("down_proj")  # a layer left unquantized
        assert row["weight_error_nvfp4_w4a4_four_over_six"] == row["weight_error_nvfp4"]  # the same weight quantizer
    mean = lambda key: sum(row[key] for row in layers.values()) / len(layers)  # noqa: E731
    # ModelOpt's MSE search of static 4-over-6 weight scales starts at max's scale: it can only err less
    assert mean("weight_error_nvfp4_w4a4_four_over_six_all") < mean("weight_error_nvfp4")
    report_md = (tmp_path / "diagnose.md").read_text()
    assert (tmp_path / "diagnose.png").is_file() and "change from" in report_md
    assert "out err nvfp4_w4a4_four_over_six %" in report_md and "W err nvfp4_w4a4_four_over_six_all %" in report_md
    with pytest.raises(ConfigError, match="name each quant config once"):
        run_diagnose(cfg, [models["base"]], tmp_path, ["quant_configs/nvfp4_w4a4.yaml"])
    with pytest.raises(ConfigError, match="no such quant config file; shipped: fp8_w8a8"):
        run_diagnose(cfg, [models["base"]], tmp_path, ["quant_configs/nvfp4_w4a4_pertoken.yaml"])
    with pytest.raises(ConfigError, match="holds an earlier diagnosis.*run.overwrite=true"):  # it is not replaced
        run_diagnose(cfg, [models["base"]], tmp_path)


def test_export_columns_name_their_target_and_refuse_a_format_no_row_has(models):
    """matrix.exports: a column per target that a trained row's format fits (its cells need a GPU's NVFP4 kernels to
    serve the export: benchmarks/smollm2_gpu.sh matrix); a target of a format no row was trained in is refused."""
    plan = plan_matrix(_cfg(models, exports=["nvfp4_w4a16_modelopt"]))
    column = plan.precisions[-1]
    assert column.name == "exported nvfp4_w4a16_modelopt" and column.trained and column.export.name in column.name
    assert plan.generation.sleep_between_rollouts == "off", "an engine per export in one process: none may sleep"
    with pytest.raises(ConfigError, match="writes no trained row's format"):
        plan_matrix(_cfg(models, exports=["fp8_w8a8_modelopt"]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU only (a GPU: tests/integration/test_gpu_served_export.py)")
def test_a_w4a4_exported_column_scores_as_its_trained_model_on_cpu(models):
    """On CPU the matrix serves a W4A4 export with vLLM's NVFP4 emulation (qarl/generation/served_export.py), in the
    matrix's fp32 as the trained column computes: the exported cell scores as the trained one (equal here; one prompt
    of 48 is allowed: vLLM's decode multiplies a row at a time, whose sums another CPU's BLAS may order otherwise)."""
    cfg = load_recipe("recipes/qa_grpo_tiny.yaml", ["policy.quant_cfg=quant_configs/nvfp4_w4a4.yaml"], RecipeConfig)
    policy = build_policy(cfg.policy, ArithmeticTask(num_train=2000, num_eval=1000, seed=0).calibration_texts(64),
                          model_dir=models["base"])
    checkpoint = models["root"] / "w4a4"
    save_checkpoint(checkpoint, 1, policy, {"step": 1})
    report, _ = run_matrix(_cfg(models, models={"w4a4": [str(checkpoint)]}, formats=[], ptq_methods=["max"],
                                exports=["nvfp4_w4a4_compressed_tensors"]))
    cells = report["splits"]["test"]["accuracy"]["w4a4"]
    assert report["served_kernels"] == {"exported nvfp4_w4a4_compressed_tensors": {"EmulationNvFp4LinearKernel": 8}}
    assert cells[TRAINED]["mean"] > 0.1, cells
    assert abs(cells["exported nvfp4_w4a4_compressed_tensors"]["mean"] - cells[TRAINED]["mean"]) <= 1 / 48, cells


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (vLLM's FP8 kernels and sleep mode)")
def test_the_exports_of_several_seeds_each_get_an_engine_in_one_process(models, tmp_path):
    """Each exported cell starts an engine from its export, one after another in the matrix's process. On an H200 the
    engine of a compressed-tensors FP8 export left memory in vLLM's sleep-mode allocator that the next seed's engine
    refused; the matrix's engines never sleep (nothing trains between its evaluations), even where the recipe asks."""
    cfg = load_recipe("recipes/qa_grpo_tiny.yaml", ["policy.quant_cfg=quant_configs/fp8_w8a8.yaml"], RecipeConfig)
    policy = build_policy(cfg.policy, ArithmeticTask(num_train=2000, num_eval=1000, seed=0).calibration_texts(64),
                          model_dir=models["base"])
    seeds = [str(tmp_path / f"fp8_{seed}") for seed in range(2)]
    for seed in seeds:  # one checkpoint twice: the exports are equal, and so are their cells
        save_checkpoint(Path(seed), 1, policy, {"step": 1})
    matrix_cfg = _cfg(models, models={"fp8": seeds}, formats=[], ptq_methods=["max"],
                      exports=["fp8_w8a8_compressed_tensors"], out=str(tmp_path / "out"))
    matrix_cfg = dataclasses.replace(matrix_cfg, policy=dataclasses.replace(
        matrix_cfg.policy, generation=dataclasses.replace(matrix_cfg.policy.generation, sleep_between_rollouts="on")))
    assert plan_matrix(matrix_cfg).generation.sleep_between_rollouts == "off"
    report, _ = run_matrix(matrix_cfg)
    accuracy = report["splits"]["test"]["accuracy"]["fp8"]
    cell = accuracy["exported fp8_w8a8_compressed_tensors"]
    assert len(cell["per_seed"]) == 2 and cell["per_seed"][0] == cell["per_seed"][1]
    served = report["served_kernels"]["exported fp8_w8a8_compressed_tensors"]  # the kernels each export ran:
    assert sum(served.values()) == 16, served  # qkv, o, gate_up, down in each of the 2 layers, for each of 2 seeds
    assert cell["per_seed"][0] == pytest.approx(accuracy[TRAINED]["mean"], abs=0.1)
