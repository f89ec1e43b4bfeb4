"""QAD's loss (qarl/distill_loss.py): the reverse KL against a direct computation, full vocabulary and top-k, its
gradient, and the top-k error against its bound. The teacher checks: tests/unit/test_loop_checks.py; the loop:
tests/e2e/test_loops.py, tests/e2e/test_distill.py."""

from __future__ import annotations

import math

import pytest
import torch

from qarl.distill_loss import reverse_kl, topk_error


def _softmax(row: list[float], temperature: float) -> list[float]:
    z = [x / temperature for x in row]
    top = max(z)
    e = [math.exp(x - top) for x in z]
    return [x / sum(e) for x in e]


def _direct_kl(s_row: list[float], t_row: list[float], temperature: float, top_k: int = 0) -> float:
    """The definition, one position at a time in float64 Python arithmetic."""
    p, q = _softmax(s_row, temperature), _softmax(t_row, temperature)
    if top_k <= 0:
        return sum(pv * (math.log(pv) - math.log(qv)) for pv, qv in zip(p, q))
    keep = sorted(range(len(p)), key=lambda v: -p[v])[:top_k]
    head = sum(p[v] * (math.log(p[v]) - math.log(q[v])) for v in keep)
    rest_p, rest_q = 1 - sum(p[v] for v in keep), 1 - sum(q[v] for v in keep)
    return head + (rest_p * math.log(rest_p / rest_q) if rest_p > 0 else 0.0)


@pytest.mark.parametrize("top_k", [0, 1, 5, 31])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_reverse_kl_matches_a_direct_computation(top_k, temperature):
    torch.manual_seed(top_k)
    student, teacher = torch.randn(3, 4, 32) * 2, torch.randn(3, 4, 32) * 2
    got = reverse_kl(student, teacher, temperature, top_k)
    want = torch.tensor([[_direct_kl(s.tolist(), t.tolist(), temperature, top_k) for s, t in zip(ss, tt)]
                         for ss, tt in zip(student, teacher)], dtype=torch.float64)
    assert got.shape == (3, 4)
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-5)


def test_full_vocabulary_gradient_is_the_analytic_one():
    """d KL / d z_s(v) = p_s(v) (log p_s(v) - log p_t(v) - KL) / T; the teacher gets no gradient."""
    torch.manual_seed(0)
    temperature = 0.8
    student = (torch.randn(5, 50) * 3).requires_grad_()
    teacher = torch.randn(5, 50) * 3
    reverse_kl(student, teacher, temperature).sum().backward()
    log_s, log_t = (torch.log_softmax(x.detach().double() / temperature, -1) for x in (student, teacher))
    kl = (log_s.exp() * (log_s - log_t)).sum(-1, keepdim=True)
    torch.testing.assert_close(student.grad.double(), log_s.exp() * (log_s - log_t - kl) / temperature,
                               atol=1e-6, rtol=1e-4)


def test_identical_models_have_zero_kl_and_top_k_of_the_whole_vocabulary_is_exact():
    logits = torch.randn(2, 3, 40)
    assert reverse_kl(logits, logits.clone()).abs().max() < 1e-6
    assert reverse_kl(logits, logits.clone(), top_k=5).abs().max() < 1e-6
    other = torch.randn(2, 3, 40)
    torch.testing.assert_close(reverse_kl(logits, other, top_k=40), reverse_kl(logits, other))


@pytest.mark.parametrize("top_k", [1, 8, 64])
def test_top_k_error_is_the_tail_term_and_within_its_bound(top_k):
    """KL_full - KL_k = m_s KL(p_s(.|tail) || p_t(.|tail)), in [0, m_s max log-ratio]; checked on peaked
    (LLM-like) and flat rows."""
    torch.manual_seed(top_k)
    for scale in (1.0, 4.0):
        student = torch.randn(64, 512) * scale
        teacher = student + torch.randn(64, 512) * 0.5
        err = topk_error(student, teacher, 1.0, top_k)
        assert (err["error"] >= -1e-5).all()
        assert (err["error"] <= err["bound"] + 1e-5).all()
        # the identity, directly: tail mass times the KL of the renormalised tails
        log_s, log_t = torch.log_softmax(student.double(), -1), torch.log_softmax(teacher.double(), -1)
        tail = torch.ones_like(log_s, dtype=torch.bool).scatter(-1, log_s.topk(top_k, -1).indices, False)
        cond_s = log_s.masked_fill(~tail, -torch.inf)
        cond_s = cond_s - cond_s.logsumexp(-1, keepdim=True)
        cond_t = log_t.masked_fill(~tail, -torch.inf)
        cond_t = cond_t - cond_t.logsumexp(-1, keepdim=True)
        tail_kl = torch.where(tail, cond_s.exp() * (cond_s - cond_t), torch.zeros_like(cond_s)).sum(-1)
        torch.testing.assert_close(err["error"].double(), err["tail_mass"].double() * tail_kl, atol=2e-5, rtol=1e-3)
