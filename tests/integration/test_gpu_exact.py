"""The exact forward (`policy.exact_forward`) on a Hopper GPU: the engine's log-prob of every sampled token
equals the policy's bit for bit, in every format and compute dtype, eager and with CUDA graphs, and with an FP8 KV
cache (written for vLLM 0.26's FP8 FlashAttention path, not yet run on a GPU); the
kernels it rests on give each row the same bits whatever else is in the batch; each kernel computes what
its gradient reference computes, and whole-model gradients are within 5 % of the default path's (weight-only
formats); Qwen3 (q/k norms) and Llama 3 (scaled rotary embedding) as well as Qwen2; QAD's student samples bit for
bit as well. Skipped without such a GPU
(CPU refusals and references: tests/unit/test_exact_forward.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from qarl.config import GenerationConfig

from tests.conftest import REPO, answer_loss, tiny_policy

hopper = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not hopper, reason="needs a Hopper GPU (FlashAttention 3)")]

FORMATS = ["none", "quant_configs/nvfp4_a16.yaml", "quant_configs/nvfp4_w4a4.yaml", "quant_configs/fp8_w8a8.yaml"]
MODEL = "embedded:20m"  # head size 64 (FlashAttention 3); the tiny model's is 32
FAMILIES = ["qwen3", "llama3"]  # beside Qwen2: q/k norms, Llama 3's scaled rotary embedding
KV_FORMATS = ["quant_configs/nvfp4_a16_kv_fp8.yaml", "quant_configs/fp8_w8a8_kv_fp8.yaml"]  # an FP8 KV cache


def exact_policy(task, quant_cfg: str, dtype: str = "bfloat16", exact: bool = True, model: str = MODEL):
    from qarl.models.resolve import resolve_model_dir

    return tiny_policy(task, resolve_model_dir(model), quant_cfg, trainable=True, model_name=model, dtype=dtype,
                       exact_forward=exact)


def test_the_kernels_give_a_row_the_same_bits_in_any_batch(task):
    """Attention as the engine runs it (prompts prefilled, then one decode step a token): a prompt's rows equal its
    prefill alone, a decode row equals that decode step alone (the engine's step: one query against the cache);
    decode rows equal prefill rows exactly where `decode_matches_prefill` says so (head size 128: yes; 64: not past
    the first tile of keys, which is why the layout has decode rows). A matmul row and a norm row do not depend on
    the other rows."""
    from qarl.generation import exact

    exact_policy(task, "none")  # the process in batch-invariant mode
    g = torch.Generator(device="cuda").manual_seed(0)
    lengths, prompts = [37, 300, 700], [5, 200, 20]
    for heads, kv_heads, d in [(8, 2, 64), (16, 8, 128)]:
        q = torch.randn(sum(lengths), heads, d, device="cuda", generator=g).bfloat16()
        k, v = (torch.randn(sum(lengths), kv_heads, d, device="cuda", generator=g).bfloat16() for _ in range(2))
        attend = lambda rows, n, p: exact.attention(q[rows], k[rows], v[rows],  # noqa: E731
                                                    exact.PagedLayout.build(n, p, q.device), d ** -0.5)
        whole = slice(None)
        engine_way = attend(whole, lengths, prompts)
        start = 0
        for n, p in zip(lengths, prompts):
            assert torch.equal(attend(slice(start, start + p), [p], [p]), engine_way[start : start + p]), (d, n)
            for t in (p, (p + n) // 2, n - 1):
                step = attend(slice(start, start + t + 1), [t + 1], [t])[t]
                assert torch.equal(step, engine_way[start + t]), (d, n, t)
            start += n
        same = torch.equal(engine_way, attend(whole, lengths, lengths))
        assert same == exact.decode_matches_prefill(heads, kv_heads, d, torch.bfloat16, q.device), d
    x = torch.randn(4096, 896, device="cuda", generator=g).bfloat16()
    w = torch.randn(1152, 896, device="cuda", generator=g).bfloat16()
    b = torch.randn(1152, device="cuda", generator=g).bfloat16()
    whole, whole_without_bias = exact.linear(x, w, b), exact.linear(x, w, None)
    for rows in (1, 2, 9, 64, 255, 512, 2048):  # decode steps of every size a graph captures, prefills, micro-batches
        assert torch.equal(exact.linear(x[:rows].clone(), w, b), whole[:rows]), rows
        assert torch.equal(exact.linear(x[:rows].clone(), w, None), whole_without_bias[:rows]), rows
    x = x[:300]
    weight = torch.randn(896, device="cuda", generator=g).bfloat16()
    assert torch.equal(exact.rms_norm(x, weight, 1e-6)[:3], exact.rms_norm(x[:3], weight, 1e-6))


@pytest.mark.parametrize("eager", ["true", "false"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_engine_and_policy_log_probs_are_equal_in_every_format(task, dtype, eager):
    assert_exact_parity(task, MODEL, dtype, eager)


@pytest.mark.parametrize("family", FAMILIES)
def test_qwen3_and_llama3_log_probs_are_equal_in_every_format(task, family):
    assert_exact_parity(task, f"{MODEL}-{family}", "bfloat16", "false", max_new_tokens=200)


@pytest.mark.parametrize("eager", ["true", "false"])
@pytest.mark.parametrize("model", [MODEL, f"{MODEL}-qwen3"])
def test_log_probs_are_equal_with_an_fp8_kv_cache(task, model, eager):
    """The engine's FP8 cache (keys and values stored by its cache-write kernel at the refit's scales, queries in FP8,
    FlashAttention 3 in FP8) and the policy's exact forward computing the same: equal bits, past the first tile of
    keys (decode steps), weight-only and W8A8."""
    assert_exact_parity(task, model, "bfloat16", eager, max_new_tokens=200, formats=KV_FORMATS)


VARIANT_FORMATS = ["quant_configs/nvfp4_w4a4_per_token.yaml", "quant_configs/nvfp4_w4a4_four_over_six.yaml",
                   "quant_configs/nvfp4_w4a4_hadamard.yaml", "quant_configs/nvfp4_w4a4_down_a16.yaml",
                   "quant_configs/nvfp4_w4a4_four_over_six_all.yaml",
                   "quant_configs/nvfp4_w4a4_four_over_six_all_down_a16.yaml",
                   "quant_configs/nvfp4_w4a4_down_bf16.yaml", "quant_configs/nvfp4_w4a4_down_fp8.yaml"]  # issue 72


@pytest.mark.parametrize("eager", ["true", "false"])
def test_log_probs_are_equal_with_the_w4a4_methods(task, eager):
    """Per-token and 4-over-6 activation scales (qarl's ModelOpt backend, torch ops inside the engine's compiled
    graph and captured CUDA graphs) and mixed formats: the exact forward's bits are the engine's."""
    assert_exact_parity(task, MODEL, "bfloat16", eager, max_new_tokens=200, formats=VARIANT_FORMATS)


def assert_exact_parity(task, model: str, dtype: str, eager: str, max_new_tokens: int = 32,
                        formats: list[str] = FORMATS) -> None:
    """Every format's engine log-probs equal the policy's, bit for bit, over 16 prompts x `max_new_tokens` sampled
    tokens (past 128, the first tile of keys, FlashAttention decodes a head size of 64 with other bits than it
    prefills: the embedded 20m models' heads are 64)."""
    from qarl.generation import VLLMEngine
    from qarl.parity import measure
    from qarl.quant import resolve_format

    policies = [exact_policy(task, f, dtype, model=model) for f in formats]
    settings = GenerationConfig(max_new_tokens=max_new_tokens, gpu_memory_utilization=0.06, gpu_kv_cache_gib=1,
                                sleep_between_rollouts="off", enforce_eager=eager)  # a fixed cache: runs beside others
    engine = VLLMEngine(policies[0].model_dir, settings, dtype, 0, exact=True)
    prompts = [policies[0].tokenizer(p.prompt).input_ids for p in task.eval[:16]]
    found = {}
    for quant_cfg, policy in zip(formats, policies):
        engine.set_quant_format(resolve_format(quant_cfg))
        engine.refit(policy.model)
        found[quant_cfg] = measure(engine, policy, prompts, max_new_tokens=max_new_tokens, seed=0)
        print(f"{model} {quant_cfg}: {found[quant_cfg]}")
    engine.close()
    assert all(m.tokens > 100 for m in found.values())
    assert {f: (m.max_abs, m.flipped_tokens) for f, m in found.items()} == {f: (0.0, 0) for f in formats}


def test_every_kernel_computes_what_its_gradient_reference_computes(task):
    """The backward pass of each engine kernel is the gradient of a torch reference (`EngineOp`): the two
    must compute the same function (within bf16 rounding), or the gradients would belong to another one."""
    from functools import partial

    from qarl.backends import exact_forward as ef
    from qarl.generation import exact

    policy = exact_policy(task, "none")
    g = torch.Generator(device="cuda").manual_seed(1)
    bf16 = lambda *shape: torch.randn(*shape, device="cuda", generator=g).bfloat16()  # noqa: E731
    lengths = [21, 40]
    n = sum(lengths)
    positions = torch.cat([torch.arange(k, device="cuda") for k in lengths])
    index = (torch.arange(40, device="cuda") < torch.tensor(lengths, device="cuda")[:, None]).flatten().nonzero()[:, 0]
    q, k, v, x, w = bf16(n, 8, 64), bf16(n, 2, 64), bf16(n, 2, 64), bf16(n, 512), bf16(512)
    cache = policy.model._qarl_rope_cache
    logits, tokens = bf16(n, 128), torch.randint(0, 128, (n,), device="cuda", generator=g)
    cases = {
        "rms_norm": (partial(exact.rms_norm, eps=1e-6), partial(ef._reference_norm, eps=1e-6), (x, w)),
        "silu_and_mul": (exact.silu_and_mul, ef._reference_silu_and_mul, (x,)),
        "rotary": (partial(exact.rotary, positions, head_size=64, cos_sin_cache=cache),
                   partial(ef._reference_rotary, positions, cache), (q.reshape(n, -1), k.reshape(n, -1))),
        "attention": (partial(exact.attention, layout=exact.PagedLayout.build(lengths, lengths, q.device), scale=0.125),
                      partial(ef._reference_attention, index=index, grid=(2, 40), scale=0.125), (q, k, v)),
        "rotary back": (partial(exact.rotary, positions, head_size=64, cos_sin_cache=policy.model._qarl_rope_inverse),
                        partial(ef._reference_rotary, positions, policy.model._qarl_rope_inverse),
                        (q.reshape(n, -1), k.reshape(n, -1))),
        "token_logprobs": (partial(exact.token_logprobs, tokens=tokens, temperature=0.7),
                           lambda z: torch.log_softmax(z.float() / 0.7, -1).gather(-1, tokens[:, None])[:, 0], (logits,)),
    }
    for name, (kernel, reference, inputs) in cases.items():
        got, want = kernel(*inputs), reference(*inputs)
        for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            assert torch.allclose(a.float(), b.float(), atol=3e-2, rtol=2e-2), (name, (a.float() - b.float()).abs().max())
    # over an FP8 cache: FlashAttention 3 also rounds the softmax probabilities to FP8, which the reference leaves out
    kv_scale = torch.tensor([0.01, 0.01], device="cuda")
    got = exact.attention(q, k, v, exact.PagedLayout.build(lengths, lengths, q.device), 0.125, kv_scale)
    want = ef._reference_fp8_attention(partial(ef._reference_attention, index=index, grid=(2, 40), scale=0.125),
                                       q, k, v, kv_scale=kv_scale)
    assert ((got.float() - want.float()).norm() / want.float().norm()) < 0.05
    # the linear layer fused over three (q/k/v-like) layers: each layer's weight and bias get their share
    linear_x = x.requires_grad_()
    weights = [bf16(rows, 512).requires_grad_() for rows in (256, 64, 64)]
    biases = [bf16(rows).requires_grad_() for rows in (256, 64, 64)]
    leaves = [linear_x, *weights, *biases]
    out = ef.EngineLinear.apply(linear_x, torch.cat(weights).detach(), torch.cat(biases).detach(), *weights, *biases)
    out.float().square().sum().backward()
    kernel_grads = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    torch.cat([torch.nn.functional.linear(linear_x, w, b) for w, b in zip(weights, biases)], -1).float().square().sum().backward()
    for a, t in zip(kernel_grads, leaves):
        assert ((a.float() - t.grad.float()).norm() / t.grad.float().norm()) < 1e-2


@pytest.mark.parametrize("model", [MODEL, f"{MODEL}-qwen3", f"{MODEL}-llama3"])
@pytest.mark.parametrize("quant_cfg", FORMATS[:2])
def test_exact_gradients_match_the_default_path(task, quant_cfg, model):
    """The same weights, the same loss: gradients within 5 % (relative norm) of the default (transformers) path.
    (Weight-only formats: with quantized activations the two paths' forwards differ by whole quantization
    steps where their last bits differ, which is the mismatch the exact forward removes.)"""
    grads = []
    for exact in (True, False):
        policy = exact_policy(task, quant_cfg, exact=exact, model=model)
        answer_loss(policy, task).backward()
        grads.append({n: p.grad.float() for n, p in policy.model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        exact_grad, default_grad = grads[0][name], grads[1][name]
        error = (exact_grad - default_grad).norm() / default_grad.norm()
        assert error < 0.05, (name, error.item())


def test_qad_with_the_exact_forward_samples_from_its_student_bit_for_bit(tmp_path):
    """`qarl distill` with the exact forward in W4A4, evaluations included (the unquantized teacher in the exact
    engine first): at every step the student's log-prob of each sampled token equals the engine's, so the
    distillation is on the student's own samples (in the default mode an activation format drifts: SmolLM2's QAD
    W4A4 read mismatch/kl 0.07-0.22 a token)."""
    run_dir = tmp_path / "qad"
    result = subprocess.run(
        [sys.executable, "-m", "qarl.cli", "distill", "recipes/qa_distillation_tiny.yaml", f"run.dir={run_dir}",
         f"policy.model_name={MODEL}", "policy.exact_forward=true", "policy.dtype=bfloat16", "teacher.dtype=bfloat16",
         "trainer.steps=3", "warm_start.steps=5", "eval.every=3", "eval.num_prompts=16", "checkpoint.every=1000",
         "policy.generation.gpu_memory_utilization=0.06", "policy.generation.gpu_kv_cache_gib=2"],  # beside other runs
        cwd=REPO, capture_output=True, text=True, timeout=900)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "distill/kl" in r]
    assert len(steps) == 3 and all(r["distill/kl"] > 0 for r in steps), steps
    assert [(r["mismatch/max_abs_logprob_diff"], r["mismatch/kl"]) for r in steps] == [(0.0, 0.0)] * 3
    assert "policy.exact_forward: at step" not in output
    assert rows[0]["eval/teacher_accuracy"] >= 0 and rows[-1]["eval/accuracy"] >= 0  # the teacher evaluated too
