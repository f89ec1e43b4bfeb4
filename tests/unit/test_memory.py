"""The memory plan: decided from shapes before anything loads; what cannot fit is refused naming the knob."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from qarl.config import ConfigError, PolicyConfig, RecipeConfig, load_recipe
from qarl.memory import GiB, FrozenModel, ModelShape, plan, plan_memory
from qarl.metrics import DriverPeak

# Qwen3-1.7B's shape (parameters counted with tied embeddings)
QWEN3_1P7B = ModelShape(params=1_720_574_976, layers=28, hidden=2048, intermediate=6144, vocab=151_936,
                        attention_width=(16 + 2 * 8) * 128, query_width=16 * 128)


def user_recipe(**trainer) -> RecipeConfig:
    cfg = load_recipe("recipes/qa_grpo_qwen3_1p7b.yaml", [], RecipeConfig)
    return dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, **trainer))


def test_checkpointing_shrinks_the_activations_and_auto_takes_it_only_when_needed(monkeypatch):
    cfg = user_recipe()
    room = GiB  # the device's room, set below (the same on a CPU and a GPU machine)
    monkeypatch.setattr("qarl.memory.available_bytes", lambda: room)
    monkeypatch.setattr("qarl.memory.engine_bytes", lambda cfg, shape: (0, "policy.generation.gpu_memory_utilization"))
    off, on = (plan(cfg, QWEN3_1P7B, 100, checkpointing) for checkpointing in (False, True))
    assert on.activations * 10 < off.activations and on.update < off.update
    assert on.resident == off.resident and on.tokens_per_micro_batch == 8 * 1124

    # a device with room for the update without checkpointing: auto leaves it off
    room = off.update + GiB
    decided, found = plan_memory(cfg, QWEN3_1P7B, 100)
    assert decided.policy.gradient_checkpointing == "off" and not found.checkpointing
    # one with room for micro-batches of 4 without it (more than micro-batches of 8 need with it): auto turns it
    # on, "off" is refused naming the knob and the largest micro-batch
    room = plan(cfg, QWEN3_1P7B, 100, False, micro_batch_size=4).update
    assert room > on.update
    decided, found = plan_memory(cfg, QWEN3_1P7B, 100)
    assert decided.policy.gradient_checkpointing == "on" and found.checkpointing
    off_cfg = dataclasses.replace(cfg, policy=dataclasses.replace(cfg.policy, gradient_checkpointing="off"))
    with pytest.raises(ConfigError, match=r"does not fit.*trainer.micro_batch_size=4 \(the largest that fits\).*"
                                          r"policy.gradient_checkpointing=on"):
        plan_memory(off_cfg, QWEN3_1P7B, 100)


def test_the_exact_forward_is_planned_without_checkpointing(monkeypatch):
    """Its own loop over the layers keeps every layer's activations (qarl/backends/exact_forward.py): auto never
    turns checkpointing on for it, and a run that would need it is refused naming the micro-batch, not checkpointing."""
    cfg = user_recipe()
    exact = dataclasses.replace(cfg, policy=dataclasses.replace(cfg.policy, exact_forward=True))
    room = plan(cfg, QWEN3_1P7B, 100, False, micro_batch_size=4).update  # room that auto fills with checkpointing
    monkeypatch.setattr("qarl.memory.available_bytes", lambda: room)
    monkeypatch.setattr("qarl.memory.engine_bytes", lambda cfg, shape: (0, "policy.generation.gpu_memory_utilization"))
    assert plan_memory(cfg, QWEN3_1P7B, 100)[1].checkpointing
    with pytest.raises(ConfigError, match=r"set trainer.micro_batch_size=\d+ \(the largest that fits\)\.$"):
        plan_memory(exact, QWEN3_1P7B, 100)


def test_a_run_whose_state_cannot_fit_is_refused_naming_what_to_change(monkeypatch):
    monkeypatch.setattr("qarl.memory.available_bytes", lambda: 20 * GiB)
    with pytest.raises(ConfigError, match="lower policy.generation.(gpu_memory_utilization|kv_cache_gib).*"
                                          "policy.lora.mode=qlora"):
        plan_memory(user_recipe(), QWEN3_1P7B, 100)


def test_the_vocabulary_chunk_and_a_teacher_count():
    cfg = user_recipe()
    small = dataclasses.replace(cfg, policy=dataclasses.replace(cfg.policy, logprob_chunk_tokens=64))
    assert plan(small, QWEN3_1P7B, 100, False).update < plan(cfg, QWEN3_1P7B, 100, False).update
    teacher = plan(cfg, QWEN3_1P7B, 100, False, FrozenModel("teacher", QWEN3_1P7B, "bfloat16"))
    assert teacher.resident["teacher"] == QWEN3_1P7B.params * 2
    assert teacher.update_parts["vocabulary chunk"] == 2 * plan(cfg, QWEN3_1P7B, 100, False).update_parts["vocabulary chunk"]


def test_shape_is_read_from_the_model_directory(tiny_dir):
    shape = ModelShape.of(tiny_dir)
    assert (shape.layers, shape.hidden, shape.vocab) == (2, 128, 128) and shape.params > 0


@pytest.mark.parametrize("value, expected", [("on", "on"), (True, "on"), (False, "off"), ("auto", "auto")])
def test_gradient_checkpointing_accepts_yaml_booleans(value, expected):
    assert PolicyConfig(gradient_checkpointing=value).gradient_checkpointing == expected


def test_bad_memory_settings_are_refused_as_the_recipe_loads():
    with pytest.raises(ConfigError, match="gradient_checkpointing"):
        PolicyConfig(gradient_checkpointing="sometimes")
    with pytest.raises(ConfigError, match="logprob_chunk_tokens"):
        load_recipe("recipes/qa_grpo_tiny.yaml", ["policy.logprob_chunk_tokens=-1"])


def test_weight_memory_counts_each_side_once_per_storage(task, tiny_dir):
    """The measured per-side figures of every metrics row: the policy's weights (adapters apart), the optimizer's fp32
    masters and AdamW moments, and a view into a tensor already counted adds nothing."""
    import torch

    from qarl.metrics import storage_bytes, weight_memory
    from qarl.optim import PolicyOptimizer
    from tests.conftest import tiny_policy

    base = torch.zeros(10, 4)
    assert storage_bytes([base, base[2:5], base.view(40)]) == 160 and storage_bytes([]) == 0
    policy = tiny_policy(task, tiny_dir, "quant_configs/nvfp4_a16.yaml", trainable=True, dtype="bfloat16")
    optimizer = PolicyOptimizer(policy, 1e-3, 0.0, 1.0)
    params = sum(p.numel() for p in policy.model.parameters())
    before = weight_memory(policy.model, optimizer, None)
    assert before["memory/policy_weight_bytes"] >= 2 * params  # bf16 compute weights (and the quantizers' buffers)
    assert before["memory/optimizer_bytes"] == 4 * params  # the fp32 masters; no moments before the first step
    assert before["memory/adapter_bytes"] == 0 and before["memory/engine_weight_bytes"] == 0
    optimizer.backward(policy.model(torch.tensor([[5, 6, 7]], device=policy.device)).logits.float().sum())
    optimizer.step()
    after = weight_memory(policy.model, optimizer, policy.model)  # any module stands for the engine's
    assert after["memory/optimizer_bytes"] >= 3 * 4 * params  # + AdamW's two fp32 moments
    assert after["memory/engine_weight_bytes"] >= 2 * params


def test_the_driver_peak_is_the_most_in_use_between_takes_not_the_level_at_the_end():
    level, returned = [100], []

    def read() -> int:
        returned.append(level[0])
        return level[0]

    def set_and_sample(value: int) -> None:  # two reads of `value` by the thread: its peak holds the first
        start, level[0] = len(returned), value
        deadline = time.monotonic() + 10
        while returned[start:].count(value) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.001)

    with DriverPeak(read, interval=0.001) as peak:
        set_and_sample(900)  # a phase's peak...
        set_and_sample(200)  # ...gone by its end
        assert peak.take() == 900
        set_and_sample(200)
        assert peak.take() == 200  # a new period: the earlier peak is not carried over
    if not torch.cuda.is_available():
        with DriverPeak() as unmeasured:  # no GPU: no figure (and no metric), not a zero
            assert unmeasured.take() is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="NVML's view of a GPU")
def test_the_driver_peak_sees_memory_torch_gave_back_before_the_phase_ended():
    with DriverPeak() as peak:
        base = peak.take()
        block = torch.empty(2**30, dtype=torch.uint8, device="cuda")
        time.sleep(0.2)
        del block
        torch.cuda.empty_cache()
        assert peak.take() >= base + 2**30 * 0.9


# Qwen3-8B's shape: full training needs ~16 bytes a parameter (bf16 weights and gradients, fp32 masters and AdamW)
QWEN3_8B = ModelShape(params=8_190_735_360, layers=36, hidden=4096, intermediate=12288, vocab=151_936,
                      attention_width=(32 + 2 * 8) * 128, query_width=32 * 128)


def test_megatron_ranks_plan_their_tensor_parallel_shard(monkeypatch):
    """An 8B model's full-training state does not fit one H200 (141 GiB) but fits each of two at TP=2: the plan counts
    a rank's shard of the state and of the layer activations, and refuses TP=1 up front."""
    monkeypatch.setattr("qarl.memory.available_bytes", lambda: int(0.95 * 141 * GiB))
    monkeypatch.setattr("qarl.memory.engine_bytes", lambda cfg, shape: (int(0.3 * 141 * GiB), "an engine knob"))
    cfg = user_recipe(micro_batch_size=4)
    megatron = {tp: dataclasses.replace(cfg, policy=dataclasses.replace(cfg.policy, backend="megatron",
                                                                         tensor_parallel_size=tp)) for tp in (1, 2)}
    one, two = (plan(megatron[tp], QWEN3_8B, 100, True) for tp in (1, 2))
    assert sum(one.resident.values()) == pytest.approx(14 * QWEN3_8B.params, rel=1e-6)  # + bf16 gradients: 16
    assert sum(two.resident.values()) == pytest.approx(sum(one.resident.values()) / 2, rel=1e-6)
    assert two.activations < one.activations
    hf = plan(dataclasses.replace(cfg, policy=dataclasses.replace(cfg.policy, tensor_parallel_size=2)),
              QWEN3_8B, 100, True)
    assert hf.resident == one.resident  # tensor_parallel_size is the Megatron backend's: the HF policy is whole
    with pytest.raises(ConfigError, match="does not fit"):
        plan_memory(megatron[1], QWEN3_8B, 100)
    decided, found = plan_memory(megatron[2], QWEN3_8B, 100)
    assert found.fits() and found.update < 141 * GiB


def test_processes_on_one_cpu_host_share_its_memory(monkeypatch):
    from qarl.memory import available_bytes

    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    alone = available_bytes()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert available_bytes() == pytest.approx(alone / 2, rel=0.05)


def test_a_fixed_gpu_kv_cache_is_planned_as_the_cache_the_engine_weights_and_its_workspace(monkeypatch):
    """policy.generation.gpu_kv_cache_gib (runs sharing a GPU) replaces the engine's share of the device in the plan,
    and a run that cannot fit then names that knob."""
    from qarl.memory import ENGINE_WORKSPACE

    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.mem_get_info", lambda: (140 * GiB, 141 * GiB))
    cfg = user_recipe()
    fixed = dataclasses.replace(cfg, policy=dataclasses.replace(cfg.policy, generation=dataclasses.replace(
        cfg.policy.generation, gpu_kv_cache_gib=4.0)))
    share = plan(cfg, QWEN3_1P7B, 100, False)
    assert share.engine == int(cfg.policy.generation.gpu_memory_utilization * 141 * GiB)
    assert plan(fixed, QWEN3_1P7B, 100, False).engine == 4 * GiB + QWEN3_1P7B.params * 2 + ENGINE_WORKSPACE
    monkeypatch.setattr("torch.cuda.mem_get_info", lambda: (30 * GiB, 141 * GiB))
    with pytest.raises(ConfigError, match="lower policy.generation.gpu_kv_cache_gib"):
        plan_memory(fixed, QWEN3_1P7B, 100)


# Qwen3-30B-A3B's shape: 48 layers of 128 experts (width 768, 8 a token)
QWEN3_30B_A3B = ModelShape(params=30_532_122_624, layers=48, hidden=2048, intermediate=8 * 768, vocab=151_936,
                           attention_width=(32 + 2 * 4) * 128, query_width=32 * 128, experts=128, experts_per_token=8,
                           expert_params=48 * 128 * 3 * 2048 * 768)


def test_megatron_ranks_plan_their_shard_of_the_quantized_experts():
    """ModelOpt keeps each expert's quantized weight for the backward; a Megatron rank holds its TP shard of every
    expert, so it keeps its shard of them (with checkpointing one layer's, without all layers')."""
    cfg = user_recipe()
    for checkpointing in (True, False):
        extra = {}
        for tp in (1, 2, 4):
            megatron = dataclasses.replace(cfg.policy, backend="megatron", tensor_parallel_size=tp)
            quantized, unquantized = (plan(dataclasses.replace(cfg, policy=dataclasses.replace(megatron, quant_cfg=q)),
                                           QWEN3_30B_A3B, 100, checkpointing).activations
                                      for q in (cfg.policy.quant_cfg, None))
            extra[tp] = quantized - unquantized
        per_layer = QWEN3_30B_A3B.expert_params * 2 // (QWEN3_30B_A3B.layers if checkpointing else 1)  # bf16
        assert extra == {tp: per_layer // tp for tp in (1, 2, 4)}


def test_an_fp8_kv_cache_holds_twice_the_tokens_of_a_bf16_one(monkeypatch):
    """At the Qwen3-1.7B shape a 1 GiB cache holds 9,362 bf16 tokens (28 layers x 2 x 8 heads x 128 x 2 bytes) and
    18,724 in FP8: a 16k-token sequence fits only in the FP8 one, and the bf16 one is refused naming the knob."""
    monkeypatch.setattr("qarl.memory.available_bytes", lambda: 1024 * GiB)
    cfg = user_recipe()

    def with_cache(quant_cfg: str) -> RecipeConfig:
        gen = dataclasses.replace(cfg.policy.generation, quant_cfg=quant_cfg, kv_cache_gib=1.0, gpu_kv_cache_gib=1.0,
                                  max_new_tokens=16_000, max_model_len=16_384)
        return dataclasses.replace(cfg, policy=dataclasses.replace(cfg.policy, quant_cfg=quant_cfg, generation=gen))

    bf16, fp8 = (plan(with_cache(q), QWEN3_1P7B, 100, True) for q in ("nvfp4_a16", "nvfp4_a16_kv_fp8"))
    assert (bf16.kv_cache_tokens, bf16.kv_cache_dtype) == (GiB // (28 * 2 * 8 * 128 * 2), "bfloat16")
    assert (fp8.kv_cache_tokens, fp8.kv_cache_dtype) == (GiB // (28 * 2 * 8 * 128), "fp8")
    assert "18,724 tokens in fp8" in fp8.describe()
    with pytest.raises(ConfigError, match=r"KV cache \(policy.generation.(gpu_)?kv_cache_gib\) holds ~9,362 tokens "
                                          r"in bfloat16, fewer than one sequence of policy.generation.max_model_len="):
        plan_memory(with_cache("nvfp4_a16"), QWEN3_1P7B, 100)
    plan_memory(with_cache("nvfp4_a16_kv_fp8"), QWEN3_1P7B, 100)


def test_a_cpu_kv_cache_is_planned_in_the_whole_gib_vllm_cpu_takes(monkeypatch):
    """VLLM_CPU_KVCACHE_SPACE takes whole GiB: kv_cache_gib=1.9 gives the engine 1 GiB, and the plan counts that."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    cfg = user_recipe()
    gen = dataclasses.replace(cfg.policy.generation, quant_cfg="nvfp4_a16", kv_cache_gib=1.9)
    cfg = dataclasses.replace(cfg, policy=dataclasses.replace(cfg.policy, quant_cfg="nvfp4_a16", generation=gen))
    assert gen.cpu_kv_cache_gib == 1
    assert plan(cfg, QWEN3_1P7B, 100, True).kv_cache_tokens == GiB // (28 * 2 * 8 * 128 * 2)  # the recipe: bf16


def test_cuda_graphs_plan_their_pool_through_the_step_and_never_checkpoint(monkeypatch):
    """With trainer.cuda_graphs=on the graphs' pool (a micro-batch's transients) and the kept gradients stay through
    the optimizer step: the planned update is their sum, above the eager plan's larger of the two; auto never turns
    checkpointing on for it, and a run that does not fit is told to turn the graphs off."""
    cfg = user_recipe(cuda_graphs="on")
    monkeypatch.setattr("qarl.memory.engine_bytes", lambda cfg, shape: (0, "policy.generation.gpu_memory_utilization"))
    eager, graphed = (plan(c, QWEN3_1P7B, 100, False) for c in (user_recipe(), cfg))
    assert graphed.update > eager.update and "CUDA graph pool" in graphed.update_parts
    parts = graphed.update_parts
    assert parts["optimizer step"] > parts["gradients"] > 0 and parts["CUDA graph pool"] > eager.activations
    monkeypatch.setattr("qarl.memory.available_bytes", lambda: graphed.update - GiB)  # fits only with checkpointing
    with pytest.raises(ConfigError, match="trainer.cuda_graphs=off"):
        plan_memory(cfg, QWEN3_1P7B, 100)
    monkeypatch.setattr("qarl.memory.available_bytes", lambda: graphed.update + GiB)
    decided, found = plan_memory(cfg, QWEN3_1P7B, 100)
    assert decided.policy.gradient_checkpointing == "off" and not found.checkpointing
