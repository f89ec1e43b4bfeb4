"""The on-policy distillation loss, free of models and engines: per-token reverse KL(student || teacher), optionally
mixed with the forward KL(teacher || student).

At each completion position, with p = softmax(logits / temperature) (the distribution the engine
samples from at that temperature, for both models):

    KL(p_s || p_t) = sum_v p_s(v) * (log p_s(v) - log p_t(v))          over the full vocabulary.

Why reverse KL: the completions are sampled from the student, so the student is pushed down wherever
it puts mass the teacher does not (mode-seeking), exactly on the prefixes it actually produces.
The gradient flows through p_s at every position but not through the choice of prefix (the standard
on-policy distillation estimator, as in GKD): the prefixes are fresh samples at every step.

Why mix in the forward KL (`distill.forward_kl_weight` w: the loss is (1 - w) KL(p_s || p_t) + w KL(p_t || p_s)):
the reverse KL lets the student drop what the teacher would also have said (one mode is enough), and W4A4 students
of SmolLM2 answer shorter than their teachers; the forward KL charges the student for every token the teacher
gives mass to (mass-covering), on the same student-sampled prefixes.

Top-k option (large vocabularies): the sum runs over the student's k most likely tokens plus one
"rest" bucket holding the remaining mass of each model,

    KL_k = sum_{v in K} p_s(v) log(p_s(v) / p_t(v))  +  m_s log(m_s / m_t),   m = 1 - sum_{v in K} p(v).

By the chain rule of KL this is the KL of the two distributions coarse-grained onto K + {rest}, so

    KL_full - KL_k = m_s * KL(p_s(. | rest) || p_t(. | rest))  >=  0:

the top-k loss never overestimates, is exact when the student's tail mass m_s is 0, and its error is
the student's tail mass times how differently the two models spread that mass over the tail; per
position it is at most m_s * max_{v in tail} log(p_s(v | tail) / p_t(v | tail)) (`topk_error`).
The forward KL on the same K + {rest} never overestimates either; its error is m_t * KL(p_t(. | rest) ||
p_s(. | rest)): the teacher's tokens outside the student's top-k count as one bucket, so at top-k the student pays
for the teacher's tail mass as a whole, not token by token.
Measured on the embedded model's on-policy positions (W4A4 student vs its teacher, 128 tokens): the
top-k loss is 5.5 % below the full KL at k=4, 3.0 % at k=8, 2.0 % at k=16. It is large where the
student's distribution is flat (random logits over 151,936 tokens: 49 % below at k=256).

What top-k saves is memory, and less than one might hope: both full softmaxes are still needed (the
student's normalisation, the teacher's tail mass), so only the [..., vocab] KL products go. Measured
on an H100 with Qwen3-sized logits [2, 1536, 151,936] in bf16: forward + backward peak 8.7 GiB for the
full vocabulary, 7.0 GiB with top-k (5 and 4 fp32 tensors of that shape); the forward KL's rest at top-k keeps
one more. trainer.micro_batch_size is the knob that really bounds the loss's memory.
"""

from __future__ import annotations

import math

import torch

# The student's tail mass is 1 - (sum of k probabilities) in fp32: below ~1e-7 it is rounding noise,
# and its term m_s log(m_s / m_t) is then below ~1e-5 nats. Clamped so that log() stays finite.
_TINY = 1e-30


def reverse_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0,
               top_k: int = 0) -> torch.Tensor:
    """[..., vocab] logits of each model -> [...] KL(p_s || p_t) per position, in fp32 (`divergence` at w = 0)."""
    return divergence(student_logits, teacher_logits, temperature, top_k)


def divergence(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0,
               top_k: int = 0, forward_weight: float = 0.0) -> torch.Tensor:
    """[..., vocab] logits of each model -> [...] (1 - w) KL(p_s || p_t) + w KL(p_t || p_s) per position, in fp32,
    w = `forward_weight`.

    `top_k` <= 0 (or >= vocab) sums over the full vocabulary; otherwise over the student's top-k tokens
    plus a rest bucket (see the module docstring for its error). Carries grad through the student's
    logits; the teacher's are expected without grad.
    """
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student logits {tuple(student_logits.shape)} and teacher logits "
                         f"{tuple(teacher_logits.shape)} differ in shape")
    log_s = torch.log_softmax(student_logits.float() / temperature, dim=-1)
    log_t = torch.log_softmax(teacher_logits.float() / temperature, dim=-1)
    if top_k <= 0 or top_k >= log_s.shape[-1]:
        reverse = (log_s.exp() * (log_s - log_t)).sum(-1) if forward_weight < 1 else 0.0
        forward = (log_t.exp() * (log_t - log_s)).sum(-1) if forward_weight > 0 else 0.0
    else:
        top = log_s.detach().topk(top_k, dim=-1).indices
        head_s, head_t = log_s.gather(-1, top), log_t.gather(-1, top)
        with torch.no_grad():  # the teacher's rest mass, exactly (a sum of small numbers, not 1 - a sum)
            log_rest_t = log_t.scatter(-1, top, float("-inf")).logsumexp(-1).clamp_min(math.log(_TINY))
        reverse = forward = 0.0
        if forward_weight < 1:  # the student's rest as 1 - a sum, as the reverse KL has always computed it
            rest_s = (1.0 - head_s.exp().sum(-1)).clamp_min(0.0)
            reverse = (head_s.exp() * (head_s - head_t)).sum(-1) + rest_s * (torch.log(rest_s.clamp_min(_TINY))
                                                                              - log_rest_t)
        if forward_weight > 0:  # the student's rest in log space, unclamped: where the teacher's rest mass weighs a
            # student rest that is all but gone, its gradient is what pulls the student back
            log_rest_s = log_s.scatter(-1, top, float("-inf")).logsumexp(-1)
            forward = (head_t.exp() * (head_t - head_s)).sum(-1) + log_rest_t.exp() * (log_rest_t - log_rest_s)
    if forward_weight <= 0:
        return reverse
    return forward if forward_weight >= 1 else (1 - forward_weight) * reverse + forward_weight * forward


def topk_error(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float,
               top_k: int) -> dict[str, torch.Tensor]:
    """Per position: the top-k loss's exact error (full - top-k), the student's tail mass m_s, and the
    bound m_s * max_{v in tail} log(p_s(v | tail) / p_t(v | tail)) on that error. For tests and reports."""
    with torch.no_grad():
        full = reverse_kl(student_logits, teacher_logits, temperature)
        approx = reverse_kl(student_logits, teacher_logits, temperature, top_k)
        log_s = torch.log_softmax(student_logits.float() / temperature, dim=-1)
        log_t = torch.log_softmax(teacher_logits.float() / temperature, dim=-1)
        top = log_s.topk(top_k, dim=-1).indices
        tail_s, tail_t = log_s.scatter(-1, top, float("-inf")), log_t.scatter(-1, top, float("-inf"))
        mass_s = tail_s.logsumexp(-1)
        ratio = (tail_s - mass_s[..., None]) - (tail_t - tail_t.logsumexp(-1)[..., None])
        worst = ratio.masked_fill(torch.isinf(tail_s), float("-inf")).amax(-1)
        return {"error": full - approx, "tail_mass": mass_s.exp(), "bound": mass_s.exp() * worst.clamp_min(0.0)}
