"""The fast settings' `auto` (policy.compile_layers, policy.compile_scores, trainer.max_tokens_per_micro_batch,
trainer.cuda_graphs),
decided once as a run starts (qarl/run.py `decide_fast_settings`): on where a GPU, the model and the other settings
allow, off on a CPU and wherever `on` is refused, which stays an error when a recipe asks for it. The machine is an
argument, so the GPU's decisions are tested here on a CPU (the model is read on the meta device)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from qarl.config import ConfigError, LoraConfig, PolicyConfig, RecipeConfig, check_qad_recipe, load_recipe, to_dict
from qarl.quant import resolve_format
from qarl.run import FastSettings, Machine, decide_fast_settings

GPU, CPU = Machine("cuda"), Machine("cpu")
ROWS = 8 * 1124  # the memory plan's micro-batch of rows at the Qwen3-1.7B recipe's shape
ALL_ON = ("auto", "auto", "auto: the memory plan's micro-batch of rows", "auto")
OWN_FORWARD = "quantized layers with a forward of their own (policy.quant_cfg)"


def recipe(*overrides: str, name: str = "recipes/qa_grpo_tiny.yaml") -> RecipeConfig:
    return load_recipe(name, ["policy.dtype=bfloat16", "trainer.cuda_graphs=auto", *overrides], RecipeConfig)


def decide(cfg: RecipeConfig, machine: Machine = GPU, model_dir: str | None = None, fmt: object = "recipe",
           distilling: bool = False) -> FastSettings:
    from qarl.models.resolve import resolve_model_dir

    fmt = resolve_format(cfg.policy.quant_cfg) if fmt == "recipe" else fmt
    return decide_fast_settings(cfg, machine, model_dir or resolve_model_dir(cfg.policy.model_name), fmt, ROWS,
                                distilling)


def test_auto_is_the_default_and_recipes_keep_their_spellings():
    cfg = load_recipe("recipes/qa_grpo_tiny.yaml", [], RecipeConfig)
    assert (cfg.policy.compile_layers, cfg.policy.compile_scores, cfg.trainer.max_tokens_per_micro_batch) == (
        "auto", "auto", "auto")
    # what the code reads: an undecided auto is not on (a backend's checks, `qarl eval`) and no token budget
    # (micro-batches by rows)
    assert not cfg.policy.compiles_layers and not cfg.policy.compiles_scores
    assert cfg.trainer.token_budget == 0
    spelled = load_recipe("recipes/qa_grpo_tiny.yaml", ["policy.compile_layers=true", "policy.compile_scores=false",
                                                         "trainer.max_tokens_per_micro_batch=9216"], RecipeConfig)
    assert spelled.policy.compile_layers == "on" and spelled.policy.compiles_layers
    assert spelled.policy.compile_scores == "off" and not spelled.policy.compiles_scores
    assert spelled.trainer.max_tokens_per_micro_batch == spelled.trainer.token_budget == 9216
    assert load_recipe("recipes/qa_grpo_tiny.yaml", ["trainer.max_tokens_per_micro_batch=0"],
                       RecipeConfig).trainer.max_tokens_per_micro_batch == 0
    for bad in ("trainer.max_tokens_per_micro_batch=-1", "trainer.max_tokens_per_micro_batch=lots",
                "policy.compile_layers=sometimes"):
        with pytest.raises(ConfigError, match="must be auto"):
            load_recipe("recipes/qa_grpo_tiny.yaml", [bad])
    written = to_dict(spelled)  # config.yaml: the words, loadable again
    assert written["policy"]["compile_layers"] == "on" and written["trainer"]["max_tokens_per_micro_batch"] == 9216
    assert to_dict(cfg)["trainer"]["max_tokens_per_micro_batch"] == "auto"


def test_a_yaml_file_with_booleans_keeps_working(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("defaults: [" + str(Path("recipes/qa_grpo_tiny.yaml").resolve()) + "]\n"
                    "policy: {compile_layers: true, compile_scores: false}\ntrainer: {max_tokens_per_micro_batch: 512}\n")
    cfg = load_recipe(path, [], RecipeConfig)
    assert (cfg.policy.compile_layers, cfg.policy.compile_scores, cfg.trainer.max_tokens_per_micro_batch) == (
        "on", "off", 512)


def test_a_cpu_keeps_everything_off_and_a_recipes_own_values():
    fast = decide(recipe(), CPU)
    assert (fast.compile_layers, fast.compile_scores, fast.tokens_per_micro_batch, fast.cuda_graphs) == (
        "off", "off", 0, "off")
    assert fast.line() == ("fast settings: compile_layers off (auto: the CPU), compile_scores off (auto: the CPU), "
                           "micro-batches by rows (auto: the CPU), cuda_graphs off (auto: the CPU)")
    own = decide(recipe("policy.compile_layers=on", "trainer.max_tokens_per_micro_batch=64"), CPU)
    assert (own.compile_layers, own.compile_scores, own.tokens_per_micro_batch, own.cuda_graphs) == (
        "on", "off", 64, "off")
    assert own.why == ("set", "auto: the CPU", "set", "auto: the CPU")


def test_a_gpu_turns_all_four_on_for_dense_models_of_each_family(families):
    for family, model_dir in families.items():
        fast = decide(recipe(), GPU, model_dir)
        assert (fast.compile_layers, fast.compile_scores, fast.tokens_per_micro_batch, fast.cuda_graphs) == (
            "on", "on", ROWS, "on"), family
        assert fast.why == ALL_ON
    fast = decide(recipe())
    assert fast.line() == ("fast settings: compile_layers on (auto), compile_scores on (auto), micro-batches of "
                           f"{ROWS} tokens (auto: the memory plan's micro-batch of rows), cuda_graphs on (auto)")
    cfg = fast.applied(recipe())
    assert (cfg.policy.compile_layers, cfg.policy.compile_scores, cfg.trainer.max_tokens_per_micro_batch,
            cfg.trainer.cuda_graphs) == ("on", "on", ROWS, "on")
    # what the backends and the loops read
    assert cfg.policy.compiles_layers and cfg.policy.compiles_scores and cfg.trainer.token_budget == ROWS


def _config_dir(tmp_path: Path, tiny_dir: str, **changes) -> str:
    """The tiny model's architecture (config.json only: the decisions read the meta device) with `changes`."""
    config = json.loads((Path(tiny_dir) / "config.json").read_text())
    config.update(changes)
    out = tmp_path / "model"
    out.mkdir(exist_ok=True)
    (out / "config.json").write_text(json.dumps(config))
    return str(out)


# (overrides, machine, model: None = the recipe's, fmt: "recipe" = the recipe's, distilling) -> why each is off
# (None: on under auto)
QAD = "QAD's update is not captured"
ROWS_ONLY = "micro-batches by rows: {}".format
BNPO = "trainer.loss_type=bnpo (its token mean is per micro-batch)"
WINDOW = "the model's attention (a sliding window, soft-capping or dropout)"
WHOLE = "the model's logits are scored whole"
CASES = {
    "megatron": (["policy.backend=megatron"], GPU, None, "recipe", False, ("policy.backend=megatron",) * 4),
    "exact forward": (["policy.exact_forward=true"], GPU, None, "recipe", False,
                      ("policy.exact_forward",) * 3 + (ROWS_ONLY("policy.exact_forward"),)),
    "no Triton": ([], Machine("cuda", compiler=False), None, "recipe", False,
                  ("no Triton for torch.compile", "no Triton for torch.compile", None, None)),
    "no varlen": ([], Machine("cuda", varlen=False), None, "recipe", False,
                  (None, None, "no varlen attention in this torch", ROWS_ONLY("no varlen attention in this torch"))),
    "compiled norms": (["policy.compile_norms=true"], GPU, None, "recipe", False,
                       ("policy.compile_norms or compile_mlp set", None, None, None)),
    "compiled MLPs": (["policy.compile_mlp=true"], GPU, None, "recipe", False,
                      ("policy.compile_norms or compile_mlp set", None, None, None)),
    "weight cache off": (["policy.quant_weight_cache=false"], GPU, None, "recipe", False,
                         ("policy.quant_weight_cache=false", None, None, "policy.quant_weight_cache=false")),
    "qlora": (["policy.lora.mode=qlora"], GPU, None, "recipe", False,
              ("policy.lora.mode=qlora", None, None, "policy.lora.mode=qlora")),
    "qlora on the head": (["policy.lora.mode=qlora", "policy.lora.target_modules=[q_proj,lm_head]"], GPU, None,
                          "recipe", False, ("policy.lora.mode=qlora", "LoRA on the head", None,
                                            "policy.lora.mode=qlora")),
    "whole-vocabulary scoring": (["policy.logprob_chunk_tokens=0"], GPU, None, "recipe", False,
                                 (None,) + ("policy.logprob_chunk_tokens=0",) * 3),
    "fp32": (["policy.dtype=float32"], GPU, None, "recipe", False,
             (None, None, "policy.dtype=float32", "policy.dtype=float32")),
    "bnpo": (["trainer.loss_type=bnpo"], GPU, None, "recipe", False,
             (None, None, BNPO, ROWS_ONLY(BNPO))),
    "QAD, an fp32 teacher": (["teacher.dtype=float32"], GPU, None, "recipe", True,
                             (None, "QAD's KL is not compiled", "teacher.dtype=float32", QAD)),
    "QAD": (["teacher.dtype=bfloat16"], GPU, None, "recipe", True, (None, "QAD's KL is not compiled", None, QAD)),
    "QAD, another teacher": (["teacher.dtype=bfloat16", "teacher.model_name=/elsewhere"], GPU, None, "recipe", True,
                             ("QAD's teacher is another model", "QAD's KL is not compiled",
                              "QAD's teacher is another model", QAD)),
    "MoE": (["policy.model_name=embedded:tiny-qwen3moe"], GPU, None, "recipe", False,
            ("a Mixture-of-Experts model", None, None, "a Mixture-of-Experts model")),
    "ModelOpt's own forward": ([], GPU, None, "W4A8_AWQ_BETA_CFG", False,
                               (OWN_FORWARD, "the head is not a plain linear map", None, OWN_FORWARD)),
    "sliding window": ([], GPU, {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 0,
                                 "layer_types": ["sliding_attention"] * 2}, "recipe", False,
                       (None, None, WINDOW, ROWS_ONLY(WINDOW))),
    "soft-capped logits": ([], GPU, {"final_logit_softcapping": 30.0}, "recipe", False,
                           (None, "the logits are changed after the head", WHOLE, ROWS_ONLY(WHOLE))),
    "bf16 masters": (["policy.master_dtype=bfloat16"], GPU, None, "recipe", False,
                     (None, None, None, "policy.master_dtype=bfloat16")),
    "checkpointing": (["policy.gradient_checkpointing=on"], GPU, None, "recipe", False,
                      (None, None, None, "gradient checkpointing on")),
    "dynamic rotary": ([], GPU, {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}},
                       "recipe", False, (None, None, None, "a dynamic rotary embedding")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_auto_is_off_wherever_on_is_refused_and_says_why(case, tmp_path, tiny_dir):
    overrides, machine, model, fmt, distilling, why_off = CASES[case]
    name = "recipes/qa_distillation_tiny.yaml" if distilling else "recipes/qa_grpo_tiny.yaml"
    cfg = recipe(*overrides, name=name)
    fmt = resolve_format(fmt) if fmt != "recipe" else fmt
    fast = decide(cfg, machine, _config_dir(tmp_path, tiny_dir, **model) if model else None, fmt, distilling)
    got = (fast.compile_layers, fast.compile_scores, fast.tokens_per_micro_batch, fast.cuda_graphs)
    on_off = tuple("off" if w else "on" for w in why_off)
    assert got == (*on_off[:2], 0 if why_off[2] else ROWS, on_off[3])
    assert fast.why == tuple(f"auto: {w}" if w else on for w, on in zip(why_off, ALL_ON))
    fast.applied(cfg)  # what auto picks is a recipe that loads: nothing in it is refused


@pytest.mark.parametrize("knob, changes, refusal", [
    ("compile_layers", {"compile_norms": True}, "compile_norms=false"),
    ("compile_layers", {"quant_weight_cache": False}, "quant_weight_cache=true"),
    ("compile_layers", {"lora": LoraConfig(mode="qlora")}, "lora.mode=qlora"),
    ("compile_scores", {"logprob_chunk_tokens": 0}, "logprob_chunk_tokens=0"),
    ("compile_layers", {"exact_forward": True, "dtype": "bfloat16"}, "exact_forward=true cannot run"),
    ("compile_scores", {"exact_forward": True, "dtype": "bfloat16"}, "exact_forward=true cannot run"),
])
def test_on_is_still_refused_where_auto_turns_off(knob, changes, refusal):
    PolicyConfig(**changes)  # auto: no error
    for on in ("on", True, "true"):
        with pytest.raises(ConfigError, match=refusal):
            PolicyConfig(**{knob: on}, **changes)
    PolicyConfig(**{knob: "off"}, **changes)


def test_on_is_still_refused_by_qad_and_by_the_megatron_backend():
    from qarl.backends.megatron_policy import check

    check_qad_recipe(load_recipe("recipes/qa_distillation_tiny.yaml", []))  # auto: no error
    with pytest.raises(ConfigError, match="QAD's KL"):
        check_qad_recipe(load_recipe("recipes/qa_distillation_tiny.yaml", ["policy.compile_scores=on"]))
    for knob in ("compile_layers", "compile_scores"):
        with pytest.raises(ConfigError, match=f"policy.{knob} compiles the HF backend's"):
            check(PolicyConfig(backend="megatron", **{knob: "on"}))


def test_a_gpu_training_run_picks_them_as_it_starts(tmp_path, monkeypatch, capsys):
    """start_run's path: the memory plan, then the fast settings on this machine (here, a GPU as the tests tell it),
    said once, in the recipe the run directory records."""
    from qarl import run as run_module
    from qarl.memory import MemoryPlan

    cfg = recipe(f"run.dir={tmp_path / 'run'}")
    resolved = run_module.resolve_recipe(cfg)
    memory = MemoryPlan({}, {}, 0, "rollout.gpu_memory_utilization", 1, False, ROWS, 0)
    never = lambda decided: pytest.fail("planned again for graphs it did not turn on")  # noqa: E731
    decided, planned = run_module.with_fast_settings(cfg, resolved, memory, lambda c: memory, False, GPU)
    assert (decided.policy.compile_layers, decided.policy.compile_scores,
            decided.trainer.max_tokens_per_micro_batch, decided.trainer.cuda_graphs) == ("on", "on", ROWS, "on")
    assert capsys.readouterr().out.count("fast settings: ") == 1 and planned is memory
    here, _ = run_module.with_fast_settings(cfg, resolved, memory, never, False, CPU)
    assert (here.policy.compile_layers, here.trainer.max_tokens_per_micro_batch, here.trainer.cuda_graphs) == (
        "off", 0, "off")
    assert dataclasses.replace(here.trainer).max_tokens_per_micro_batch == 0
    # CUDA graphs that auto turned on are planned again with their pool: kept where it fits, off where it does not
    seen = []

    def replan(available: int):
        def plan(decided_cfg):
            seen.append(decided_cfg.trainer.cuda_graphs)
            return MemoryPlan({"weights": 10}, {"CUDA graph pool": 5}, 0, "x", available, False, ROWS, 0)
        return plan

    fits, with_pool = run_module.with_fast_settings(cfg, resolved, memory, replan(15), False, GPU)
    assert fits.trainer.cuda_graphs == "on" and with_pool.update_parts == {"CUDA graph pool": 5}
    out = capsys.readouterr().out
    assert "memory plan with CUDA graphs: " in out and "cuda_graphs on (auto)" in out
    tight, kept = run_module.with_fast_settings(cfg, resolved, memory, replan(14), False, GPU)
    assert tight.trainer.cuda_graphs == "off" and kept is memory and seen == ["on", "on"]
    assert "cuda_graphs off (auto: their memory pool does not fit (update ~" in capsys.readouterr().out
    own, _ = run_module.with_fast_settings(recipe("trainer.cuda_graphs=on", f"run.dir={tmp_path / 'run'}"), resolved,
                                           memory, never, False, GPU)
    assert own.trainer.cuda_graphs == "on"  # a recipe's own on: the first plan counted its pool already


def test_the_frozen_model_is_built_with_the_decided_recipe(tmp_path, monkeypatch):
    """The KL reference (and QAD's teacher) is the policy built again: with the settings the run decided, so a
    compiled policy's step-0 KL stays 0. On this CPU, the loop's `frozen` gets the recipe start_run decided and
    recorded, not the one it was given."""
    from qarl import run as run_module

    cfg = recipe(f"run.dir={tmp_path / 'run'}", "warm_start.enabled=false", "policy.compile_layers=auto")
    seen, replanned = [], []

    def decided(cfg, resolved, memory, replan, distilling=False, machine=None):
        graphs = dataclasses.replace(cfg.trainer, cuda_graphs="on", max_tokens_per_micro_batch=256)
        replanned.append(replan(dataclasses.replace(cfg, trainer=graphs)))  # what auto's graphs are planned with
        return dataclasses.replace(cfg, policy=dataclasses.replace(cfg.policy, compile_scores="off",
                                                                   compile_layers="off")), memory

    monkeypatch.setattr(run_module, "with_fast_settings", decided)
    run_module.start_run(cfg, frozen=lambda decided, policy, task: seen.append(decided))
    assert [c.policy.compile_layers for c in seen] == ["off"] and cfg.policy.compile_layers == "auto"
    assert "CUDA graph pool" in replanned[0].update_parts and replanned[0].tokens_per_micro_batch == 256
