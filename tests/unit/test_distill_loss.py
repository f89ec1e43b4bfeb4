"""QAD's loss (qarl/distill_loss.py): the reverse KL and its mix with the forward KL against a direct computation, full
vocabulary and top-k, their gradients, and the top-k error against its bound. The teacher checks: tests/unit/test_loop_checks.py; the loop:
tests/e2e/test_loops.py, tests/e2e/test_distill.py."""

from __future__ import annotations

import math

import pytest
import torch

from qarl.distill_loss import divergence, reverse_kl, topk_error


def _softmax(row: list[float], temperature: float) -> list[float]:
    z = [x / temperature for x in row]
    top = max(z)
    e = [math.exp(x - top) for x in z]
    return [x / sum(e) for x in e]


def _direct_kl(s_row: list[float], t_row: list[float], temperature: float, top_k: int = 0,
               forward: bool = False) -> float:
    """The definition, one position at a time in float64 Python arithmetic: KL(p_s || p_t), or KL(p_t || p_s) if
    `forward`; with top_k, over the student's top-k tokens and one bucket for the rest."""
    p, q = _softmax(s_row, temperature), _softmax(t_row, temperature)
    keep = sorted(range(len(p)), key=lambda v: -p[v])[:top_k] if top_k > 0 else range(len(p))
    a, b = (q, p) if forward else (p, q)
    head = sum(a[v] * (math.log(a[v]) - math.log(b[v])) for v in keep)
    rest_a, rest_b = 1 - sum(a[v] for v in keep), 1 - sum(b[v] for v in keep)
    return head + (rest_a * math.log(rest_a / rest_b) if top_k > 0 and rest_a > 0 else 0.0)


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


@pytest.mark.parametrize("top_k", [0, 5])
@pytest.mark.parametrize("weight", [0.5, 1.0])
def test_the_mix_with_the_forward_kl_matches_a_direct_computation(top_k, weight):
    torch.manual_seed(7)
    student, teacher = torch.randn(3, 4, 32) * 2, torch.randn(3, 4, 32) * 2
    got = divergence(student, teacher, 0.7, top_k, forward_weight=weight)
    want = torch.tensor([[(1 - weight) * _direct_kl(s.tolist(), t.tolist(), 0.7, top_k)
                          + weight * _direct_kl(s.tolist(), t.tolist(), 0.7, top_k, forward=True)
                          for s, t in zip(ss, tt)] for ss, tt in zip(student, teacher)], dtype=torch.float64)
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-5)
    assert torch.equal(divergence(student, teacher, 0.7, top_k), reverse_kl(student, teacher, 0.7, top_k))
    full = divergence(student, teacher, 0.7, 0, forward_weight=weight)
    assert (got <= full + 1e-6).all()  # top-k never overestimates, the forward part included


def test_forward_kl_gradient_is_the_analytic_one():
    """d KL(p_t || p_s) / d z_s = (p_s - p_t) / T: the student is pulled toward every token the teacher gives mass."""
    torch.manual_seed(1)
    temperature = 0.8
    student = (torch.randn(5, 50) * 3).requires_grad_()
    teacher = torch.randn(5, 50) * 3
    divergence(student, teacher, temperature, forward_weight=1.0).sum().backward()
    p_s, p_t = (torch.softmax(x.detach().double() / temperature, -1) for x in (student, teacher))
    torch.testing.assert_close(student.grad.double(), (p_s - p_t) / temperature, atol=1e-6, rtol=1e-4)


def test_top_k_forward_kl_gradient_is_the_analytic_one():
    """Over the student's top-k K and one rest bucket: d / d z_s(v) = (p_s(v) - p_t(v)) / T for v in K and
    (p_s(v) - m_t p_s(v) / m_s) / T in the rest (m: each model's rest mass), which pulls the student's tail up
    where the teacher's rest outweighs it."""
    torch.manual_seed(2)
    temperature, top_k = 0.9, 5
    student = (torch.randn(6, 40) * 3).requires_grad_()
    teacher = torch.randn(6, 40) * 3
    divergence(student, teacher, temperature, top_k, forward_weight=1.0).sum().backward()
    p_s, p_t = (torch.softmax(x.detach().double() / temperature, -1) for x in (student, teacher))
    in_top = torch.zeros_like(p_s, dtype=torch.bool).scatter(-1, p_s.topk(top_k, -1).indices, True)
    m_s, m_t = ((p * ~in_top).sum(-1, keepdim=True) for p in (p_s, p_t))
    want = torch.where(in_top, p_s - p_t, p_s - m_t * p_s / m_s) / temperature
    torch.testing.assert_close(student.grad.double(), want, atol=1e-6, rtol=1e-4)


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
