"""Teacher-forced scoring: the log-prob (and entropy) each completion token had under a model, given everything
before it. Both loops, parity, evaluation and the benchmarks score completions through here.

The vocabulary is never held whole for a micro-batch: the model's body gives the final hidden state that predicts
each completion token, and the head (logits), the log-softmax, the picked log-prob and the entropy run over chunks
of `chunk_tokens` of those states at a time; with grad, each chunk keeps only its input and is recomputed in the
backward. A [tokens, vocab] fp32 tensor then exists for one chunk at a time, not for the micro-batch. A plain
linear head is scored by `LinearHeadScores`, whose backward needs fewer [chunk, vocab] passes than autograd's (and
whose fp32 work `policy.compile_scores` compiles); so is the exact forward's plain head, its log-probs picked by the
engine's sampler kernel, its entropy and gradient compiled on a GPU. Models that give logits only (the Megatron
backend) are scored from their full logits.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel

from qarl.config import ConfigError
from qarl.generation import Completion
from qarl.models.varlen_attention import packed_attention_kwargs
from qarl.quant import linear_weight
from qarl.transfer import to_device

FUSED_SCORES = "qarl_fused_scores"  # set True on a linear head: its chunks scored by compiled kernels (compile_scores)
CHUNK_TOKENS = 512  # policy.logprob_chunk_tokens' default: at a 152k vocabulary, ~1.5 GB of fp32 [chunk, vocab] tensors


@dataclass
class MicroBatch:
    """Completions scored (and trained on) together; `rows` are their indices in the step's batch."""

    rows: list[int]
    completions: list[Completion]

    @property
    def prompts(self) -> list[list[int]]:
        return [c.prompt_ids for c in self.completions]

    @property
    def tokens(self) -> list[list[int]]:
        return [c.token_ids for c in self.completions]

    def engine_logprobs(self, device: torch.device, grid: tuple[int, int] | None = None) -> torch.Tensor:
        """The engine's log-prob of each sampled token, [rows, longest completion] (or on `grid`: `on_grid`), 0 past
        a completion's end."""
        width = max(len(c.token_ids) for c in self.completions)
        logprobs = right_padded([c.logprobs for c in self.completions], width, 0.0, np.float32)
        return to_device([on_grid(logprobs, grid)], device)[0]


def on_grid(values: torch.Tensor, grid: tuple[int, int] | None) -> torch.Tensor:
    """A micro-batch's [rows, longest completion] (or [rows]) values zero-padded to a `StaticShape`'s [sequences,
    completion] grid (qarl/graphs.py); as they are for None."""
    if grid is None:
        return values
    if values.dim() == 1:
        return F.pad(values, (0, grid[0] - values.shape[0]))
    return F.pad(values, (0, grid[1] - values.shape[1], 0, grid[0] - values.shape[0]))


def completion_mask(completions: list[list[int]], grid: tuple[int, int] | None = None) -> torch.Tensor:
    """The 0/1 float mask of completion tokens, [rows, longest completion] (or on `grid`), on the host."""
    lengths = torch.tensor([len(c) for c in completions])
    mask = (torch.arange(int(lengths.max()))[None] < lengths[:, None]).float()
    return on_grid(mask, grid)


def micro_batches(completions: list[Completion], rows: list[int], size: int, max_tokens: int = 0) -> list[MicroBatch]:
    """`rows` of `completions` in order, `size` at a time; with `max_tokens` > 0, as many as fit in that many prompt +
    completion tokens instead (a longer row alone)."""
    groups: list[list[int]] = []
    used = 0
    for i in rows:
        tokens = len(completions[i].prompt_ids) + len(completions[i].token_ids)
        full = used + tokens > max_tokens if max_tokens > 0 else len(groups[-1]) >= size if groups else True
        if not groups or full:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += tokens
    return [MicroBatch(group, [completions[i] for i in group]) for group in groups]


@dataclass
class TokenScores:
    """Per completion token, padded to [batch, longest completion]: log-prob, entropy, and a 0/1 mask."""

    logprobs: torch.Tensor
    entropy: torch.Tensor
    mask: torch.Tensor


@dataclass(frozen=True)
class StaticShape:
    """A packed micro-batch's shape held fixed, so that a CUDA graph of its update replays for every micro-batch of
    the step (qarl/graphs.py): `tokens` ids in the row (the token budget), `sequences` boundaries (slots past the
    last sequence are empty), `longest` the attention's longest sequence, the [sequences, completion] grid of the
    loss, and `picks` completion tokens scored by the head (the spare ones read other states and land nowhere). The
    slack is filled by padding sequences of at most `longest` tokens that no completion token is picked from."""

    tokens: int
    sequences: int
    longest: int
    completion: int
    picks: int


@dataclass
class TeacherForced:
    """Right-padded rows of prompt + completion, and where each completion token is predicted: `positions[i, j]`,
    the index of the state (logit) that predicts completion token j of row i; `targets` the tokens, `mask` 0/1.
    Packed (`position_ids` set): one row of every sequence back to back, no padding, positions restarting at 0 for
    each sequence (the attention then stays within each sequence); `positions` index that row, and `attention_kwargs`
    are the sequences' cumulative lengths as the varlen attention reads them (qarl/models/varlen_attention.py).
    The same places flat, for the completion tokens alone (row-major): `picks`, each one's predicting state among the
    decoder's [rows x width] states, `slots`, its place in the [batch x longest completion] grid, and `picked`, the
    token: built on the host, so that gathering and scattering never ask the GPU how many tokens there are. In a
    `StaticShape` the picks past the completion tokens read states 0, 1, ... into the slot past the grid, which
    nothing reads."""

    ids: torch.Tensor  # [batch, width], or [1, total tokens] packed
    attention: torch.Tensor | None  # [batch, width]; None packed
    positions: torch.Tensor  # [batch, longest completion]
    targets: torch.Tensor  # [batch, longest completion]
    mask: torch.Tensor  # [batch, longest completion]
    picks: torch.Tensor  # [completion tokens]
    slots: torch.Tensor  # [completion tokens]
    picked: torch.Tensor  # [completion tokens]
    position_ids: torch.Tensor | None = None  # [1, total tokens] packed
    attention_kwargs: dict | None = None  # packed

    def decoder_inputs(self) -> dict[str, object]:
        if self.position_ids is not None:
            return {"input_ids": self.ids, "position_ids": self.position_ids, **self.attention_kwargs}
        return {"input_ids": self.ids, "attention_mask": self.attention}

    @classmethod
    def from_parts(cls, parts: list[torch.Tensor], longest: int, pack: bool) -> TeacherForced:
        """The rows from `HostRows.parts` on the model's device (views: a CUDA graph's input buffers)."""
        positions, targets, mask, picks, slots, picked = parts[-6:]
        rows = dict(positions=positions, targets=targets, mask=mask.float(), picks=picks, slots=slots, picked=picked)
        if pack:
            attention_kwargs = packed_attention_kwargs(parts[2].to(torch.int32), longest)
            return cls(parts[0], None, **rows, position_ids=parts[1], attention_kwargs=attention_kwargs)
        return cls(parts[0], parts[1], **rows)


@dataclass
class HostRows:
    """`TeacherForced`'s int64 tensors laid out on the host, in `TeacherForced.from_parts`' order, with the
    attention's longest sequence (the rows' width unpacked) and each sequence's tokens."""

    parts: list[torch.Tensor]
    longest: int
    pack: bool
    lengths: list[int]

    def on(self, device: torch.device) -> TeacherForced:
        """On `device`, in one copy (`qarl.transfer.to_device`)."""
        return TeacherForced.from_parts(to_device(self.parts, device), self.longest, self.pack)


def teacher_forced(prompts: list[list[int]], completions: list[list[int]], pad_id: int, device: torch.device,
                   pack: bool = False, shape: StaticShape | None = None) -> TeacherForced:
    """The rows, right-padded, or with `pack` the sequences back to back in one row (no padding), each with positions
    from 0; packed into `shape` if given. Every index is computed on the host and reaches the device in one copy
    (`qarl.transfer.to_device`)."""
    return host_rows(prompts, completions, pad_id, pack, shape).on(device)


def host_rows(prompts: list[list[int]], completions: list[list[int]], pad_id: int, pack: bool = False,
              shape: StaticShape | None = None) -> HostRows:
    """`teacher_forced`'s tensors on the host. In a `shape`, padding sequences fill its tokens and empty ones its
    sequence slots (rows of width `shape.longest` unpacked)."""
    sequences = [p + c for p, c in zip(prompts, completions)]
    if shape is not None:
        sequences += static_padding(sum(len(q) for q in sequences), len(sequences), max(len(c) for c in completions),
                                    max(len(q) for q in sequences), pad_id, shape)
        sequences += [[]] * (shape.sequences - len(sequences))
    lengths = torch.tensor([len(q) for q in sequences])
    prompt_lengths = torch.tensor([len(p) for p in prompts])
    completion_lengths = torch.tensor([len(c) for c in completions])
    longest, width = int(completion_lengths.max()), shape.longest if shape else int(lengths.max())
    j = torch.arange(longest)
    mask = j[None] < completion_lengths[:, None]
    slots = mask.flatten().nonzero().squeeze(1)  # (indexing by a boolean mask is slow on the host)
    targets = right_padded(completions, longest, pad_id)
    starts = F.pad(lengths.cumsum(0), (1, 0))
    if pack:
        ids = torch.from_numpy(np.concatenate([np.asarray(q, dtype=np.int64) for q in sequences]))[None]
        position_ids = torch.cat([torch.arange(len(q)) for q in sequences])[None]
        row_starts, row_width = starts[: len(prompts)], ids.shape[1]
        host = [ids, position_ids, starts]
    else:
        ids = right_padded(sequences, width, pad_id)
        attention = (torch.arange(width)[None] < lengths[:, None]).long()
        row_starts, row_width = torch.zeros_like(prompt_lengths), width
        host = [ids, attention]
    positions = (row_starts[:, None] + prompt_lengths[:, None] - 1 + j[None]).clamp(max=row_width - 1)
    picks = positions if pack else positions + torch.arange(len(prompts))[:, None] * width
    rows = [positions, targets, mask.long(), picks.flatten()[slots], slots, targets.flatten()[slots]]
    grid = rows if shape is None else static_grid(rows, shape)
    return HostRows([*host, *grid], width, pack, lengths.tolist())


def static_padding(used: int, count: int, completion: int, longest: int, pad_id: int, shape: StaticShape
                   ) -> list[list[int]]:
    """The padding sequences that fill a micro-batch of `count` sequences, `used` tokens, to `shape`: `pad_id`
    tokens, at most `shape.longest` each (the attention's longest sequence), attending only to themselves."""
    left = shape.tokens - used
    padding = [shape.longest] * (left // shape.longest) + ([left % shape.longest] if left % shape.longest else [])
    if left < 0 or longest > shape.longest or completion > shape.completion or count + len(padding) > shape.sequences:
        raise ValueError(f"a micro-batch of {count} sequences, {used} tokens (the longest {longest}, its longest "
                         f"completion {completion}) does not fit {shape}")
    return [[pad_id] * n for n in padding]


def static_grid(rows: list[torch.Tensor], shape: StaticShape) -> list[torch.Tensor]:
    """`host_rows`' [batch, longest completion] grids padded to [sequences, completion], and its per-token picks to
    `shape.picks` entries, those past the completion tokens reading states 0, 1, ... (distinct: their zero gradients
    add into different rows) into the slot past the grid."""
    positions, targets, mask, picks, slots, picked = rows
    spare = shape.picks - len(slots)
    if spare < 0:
        raise ValueError(f"a micro-batch of {len(slots)} completion tokens does not fit {shape}")
    grid = [on_grid(t, (shape.sequences, shape.completion)) for t in (positions, targets, mask)]
    width = mask.shape[1]
    slots = (slots // width) * shape.completion + slots % width  # the same places in the wider grid
    out = [torch.cat([picks, torch.arange(spare)]), F.pad(slots, (0, spare), value=shape.sequences * shape.completion),
           F.pad(picked, (0, spare))]
    return [*grid, *out]


def right_padded(rows: list[list], width: int, pad: float, dtype: type = np.int64) -> torch.Tensor:
    """[rows, width] on the host, each row's values then `pad` (token ids: int64)."""
    out = np.full((len(rows), width), pad, dtype=dtype)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return torch.from_numpy(out)


def completion_logits(
    model: PreTrainedModel, prompts: list[list[int]], completions: list[list[int]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Teacher-forced logits that predict each completion token, [batch, longest completion, vocab] (the whole
    vocabulary in memory: for models without hidden states and for small checks), with the completion tokens and a
    0/1 mask of the same [batch, longest completion] shape."""
    rows = teacher_forced(prompts, completions, pad_id, next(model.parameters()).device)
    steps = engine_steps(model, prompts, completions)
    logits = model(input_ids=rows.ids, attention_mask=rows.attention, **steps).logits
    return logits.gather(1, rows.positions[..., None].expand(-1, -1, logits.shape[-1])), rows.targets, rows.mask


def engine_steps(model: torch.nn.Module, prompts: list[list[int]], completions: list[list[int]]
                 ) -> dict[str, list[int]]:
    """For the exact forward: each row's prompt length, the tokens the engine computed as a prefill before it
    decoded the completion, and each row's length, so that it lays out its rows without reading the attention mask
    back from the GPU (qarl/backends/exact_forward.py); nothing for other models."""
    if not hasattr(model, "qarl_token_logprobs"):
        return {}
    return {"prompt_lengths": [len(p) for p in prompts],
            "lengths": [len(p) + len(c) for p, c in zip(prompts, completions)]}


@dataclass
class CompletionStates:
    """The final hidden state that predicts each completion token (the masked tokens only, row-major), the head that
    turns states into logits, the tokens, and the [batch, longest completion] mask they scatter back into."""

    states: torch.Tensor  # [tokens, hidden]
    head: Callable[[torch.Tensor], torch.Tensor]
    targets: torch.Tensor  # [tokens]
    mask: torch.Tensor  # [batch, longest completion]
    slots: torch.Tensor  # [tokens]: each token's place in the flattened mask

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """[tokens] -> [batch, longest completion], 0 at padding (with grad); a static shape's spare tokens land in
        the one slot past the grid, which is dropped."""
        grid = values.new_zeros(self.mask.numel() + 1).index_copy(0, self.slots, values)
        return grid[:-1].view(self.mask.shape)


def body_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    """The model's decoder (ids -> final hidden states) and head (states -> logits), when its logits are exactly
    head(decoder(ids)): a transformers causal LM's, or the exact forward's own (`qarl_body_and_head`); None for a
    model that gives only logits (the Megatron backend) or that changes them after the head (soft-capping, logit
    scaling)."""
    own = getattr(model, "qarl_body_and_head", None)
    if own is not None:
        return own()
    if hasattr(model, "qarl_token_logprobs"):
        return None
    get_decoder, get_head = getattr(model, "get_decoder", None), getattr(model, "get_output_embeddings", None)
    config = getattr(model, "config", None)
    if get_decoder is None or get_head is None or any(
            getattr(config, key, None) for key in ("final_logit_softcapping", "logit_scale", "logits_scaling")):
        return None
    decoder, head = get_decoder(), get_head()
    if decoder is None or head is None or decoder is model:
        return None
    return decoder, head


def completion_states(model: torch.nn.Module, prompts: list[list[int]], completions: list[list[int]],
                      pad_id: int, pack: bool = False) -> CompletionStates | None:
    """The decoder's final states at the positions that predict completion tokens; None where `body_and_head` is.
    `pack`: the sequences go through the decoder back to back without padding (not for the exact forward, which
    packs its rows itself)."""
    if body_and_head(model) is None:
        return None
    pack = pack and not hasattr(model, "qarl_body_and_head")
    rows = teacher_forced(prompts, completions, pad_id, next(model.parameters()).device, pack)
    return states_of(model, rows, engine_steps(model, prompts, completions))


def states_of(model: torch.nn.Module, rows: TeacherForced, steps: dict[str, list[int]] | None = None
              ) -> CompletionStates:
    """`completion_states` of rows already on the device (`steps`: the exact forward's `engine_steps`)."""
    decoder, head = body_and_head(model)
    hidden = decoder(**rows.decoder_inputs(), **(steps or {}), use_cache=False).last_hidden_state
    states = hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows.picks)
    return CompletionStates(states, head, rows.picked, rows.mask, rows.slots)


def in_chunks(fn: Callable[..., tuple[torch.Tensor, ...]], chunk_tokens: int, *tokens: torch.Tensor
              ) -> tuple[torch.Tensor, ...]:
    """fn over `chunk_tokens` rows of the [tokens, ...] inputs at a time, outputs concatenated. With grad, a chunk
    keeps only its inputs and runs again in the backward, so one chunk's intermediates exist at a time."""
    outputs = []
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in tokens)
    for start in range(0, tokens[0].shape[0], chunk_tokens):
        part = [t[start : start + chunk_tokens] for t in tokens]
        outputs.append(checkpoint(fn, *part, use_reentrant=False) if grad else fn(*part))
    return tuple(torch.cat(pieces) for pieces in zip(*outputs))


def log_softmax_fp32(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """log_softmax(logits / temperature) in fp32: the distribution the engine samples from."""
    return torch.log_softmax(logits.float() / temperature, dim=-1)


class LinearHeadScores(torch.autograd.Function):
    """(log-prob of each target, entropy) under linear-head logits / temperature, `chunk_tokens` states at a time.

    The values are `token_scores`' (called on each chunk's logits). The backward recomputes each
    chunk's log-softmax and forms the gradient of the picked log-prob directly (g at the target less g x the
    softmax, autograd's formula) in place on that one [chunk, vocabulary] tensor: the entropy is not computed again,
    and no zero-filled gradient, scattered copy or further fp32 [chunk, vocabulary] tensor is made, as a checkpointed
    autograd graph of `token_scores` would. The head's gradient is summed over the chunks in autograd's order and
    dtype. Gradients within fp32 rounding of that path: torch's log-softmax backward kernel computes g - exp(out) x g
    in one expression with its own exp, this in separate steps (two roundings at the target). The entropy carries no
    grad; no double backward.

    `fused` (`policy.compile_scores`): each chunk's fp32 work (the log-softmax, the picked log-prob, the entropy; in
    the backward the softmax and the gradient) runs as torch.compile'd kernels of the same functions, reading the
    logits a few times instead of materializing several fp32 [chunk, vocabulary] tensors; the sums run in another
    order, so values and gradients move within fp32 rounding (bf16 rounding where the gradient is cast).

    `pick` (the exact forward's `qarl_token_logprobs`): the picked log-probs come from that kernel, bit for bit
    the engine's. The forward computes each row's entropy (a metric) and log-normalizer (`entropy_and_logsumexp`),
    and the backward the gradient from that normalizer (`picked_grad_from_logsumexp`): one pass over each chunk's
    logits, no second log-softmax. Both are compiled if `fused` (the exact forward on a GPU, whatever
    `policy.compile_scores`, which stays refused with it: the values it would compile are the kernel's)."""

    @staticmethod
    def forward(ctx, states: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                chunk_tokens: int, fused: bool = False, pick: Callable | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        states = states.contiguous()  # the layout the engine's matmul multiplies (`exact.linear`)
        scores = compiled_once(token_scores) if fused else token_scores
        row_stats = compiled_once(entropy_and_logsumexp) if fused else entropy_and_logsumexp
        picked, entropy, logsumexp = [], [], []
        for start in range(0, states.shape[0], chunk_tokens):
            chunk = slice(start, start + chunk_tokens)
            logits = F.linear(states[chunk], weight)
            if pick is None:
                chunk_picked, chunk_entropy = scores(logits, targets[chunk], temperature)
            else:
                chunk_picked = pick(logits, targets[chunk], temperature)
                chunk_entropy, chunk_logsumexp = row_stats(logits, temperature)
                logsumexp.append(chunk_logsumexp)
            picked.append(chunk_picked)
            entropy.append(chunk_entropy)
        ctx.save_for_backward(states, weight, targets, torch.cat(logsumexp) if logsumexp else None)
        ctx.temperature, ctx.chunk_tokens, ctx.fused = temperature, chunk_tokens, fused
        entropy_all = torch.cat(entropy) if entropy else states.new_zeros(0, dtype=torch.float32)
        ctx.mark_non_differentiable(entropy_all)
        picked_all = torch.cat(picked) if picked else states.new_zeros(0, dtype=torch.float32)
        return picked_all, entropy_all

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_picked: torch.Tensor, _grad_entropy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        states, weight, targets, logsumexp = ctx.saved_tensors
        want_states, want_weight = ctx.needs_input_grad[:2]
        grad_states = torch.empty_like(states) if want_states else None
        grad_weight = None
        grad_of = picked_logits_grad if logsumexp is None else picked_grad_from_logsumexp
        grad_of = compiled_once(grad_of) if ctx.fused else grad_of
        for start in reversed(range(0, states.shape[0], ctx.chunk_tokens)):  # autograd's order: the last chunk first
            chunk = slice(start, start + ctx.chunk_tokens)
            logits = F.linear(states[chunk], weight)
            if logsumexp is None:
                grad = grad_of(logits, targets[chunk], grad_picked[chunk], ctx.temperature)
            else:
                grad = grad_of(logits, targets[chunk], grad_picked[chunk], logsumexp[chunk], ctx.temperature)
            if want_states:
                grad_states[chunk] = grad @ weight
            if want_weight:
                part = grad.T @ states[chunk]
                grad_weight = part if grad_weight is None else grad_weight.add_(part)
        return grad_states, grad_weight, None, None, None, None, None


def picked_logits_grad(logits: torch.Tensor, targets: torch.Tensor, grad_picked: torch.Tensor, temperature: float
                       ) -> torch.Tensor:
    """The gradient that `grad_picked` (one per row) on each target's log-prob under log_softmax(logits /
    temperature) sends to the logits, in their dtype: g at the target less g x the softmax, through / temperature
    and the fp32 cast; formed in place on one fp32 [rows, vocabulary] tensor."""
    g = grad_picked[:, None]
    grad = log_softmax_fp32(logits, temperature).exp_().mul_(-g)  # -g x softmax
    grad.scatter_add_(-1, targets[:, None], g)  # + g at the target
    return grad.div_(temperature).to(logits.dtype)


@functools.cache
def compiled_once(fn: Callable) -> Callable:
    """`fn` through torch.compile, once per process (dynamic shapes: every chunk's row count, one graph)."""
    return torch.compile(fn, dynamic=True)


def token_scores(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                 pick: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-prob of each target, entropy) under logits / temperature, in fp32; `pick` is a model's own kernel for
    the picked log-prob (the exact forward's `qarl_token_logprobs`). The entropy is a metric, without grad: a graph
    for it would keep [tokens, vocabulary] tensors that no backward ever frees."""
    log_probs = log_softmax_fp32(logits, temperature)
    picked = pick(logits, targets, temperature) if pick is not None else log_probs.gather(-1, targets[..., None]).squeeze(-1)
    with torch.no_grad():
        entropy = -(log_probs.exp() * log_probs).sum(-1)
    return picked, entropy


def entropy_and_logsumexp(logits: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(entropy, log-normalizer) of each row of softmax(logits / temperature), in fp32, for a picked log-prob that
    comes from a kernel of its own: H = sum(p (lse - z)), with z = logits / temperature and p = exp(z - lse) (not
    lse - sum(p z), which subtracts two large numbers). No fp32 [rows, vocabulary] log-softmax is kept; the backward
    takes lse (`picked_grad_from_logsumexp`)."""
    with torch.no_grad():
        z = logits.float() / temperature
        logsumexp = torch.logsumexp(z, dim=-1)
        minus_log_p = logsumexp[:, None] - z
        return (torch.exp(-minus_log_p) * minus_log_p).sum(-1), logsumexp


def picked_grad_from_logsumexp(logits: torch.Tensor, targets: torch.Tensor, grad_picked: torch.Tensor,
                               logsumexp: torch.Tensor, temperature: float) -> torch.Tensor:
    """`picked_logits_grad` given each row's log-normalizer from the forward: g (onehot(target) - p) / temperature,
    p = exp(logits / temperature - lse), in the logits' dtype. Elementwise, no reduction: compiled, one read of
    the logits and one write of the gradient."""
    z = logits.float() / temperature
    hit = torch.arange(logits.shape[-1], device=logits.device) == targets[:, None]
    return ((hit.float() - torch.exp(z - logsumexp[:, None])) * (grad_picked / temperature)[:, None]).to(logits.dtype)


def score_completions(
    model: PreTrainedModel,
    prompts: list[list[int]],
    completions: list[list[int]],
    pad_id: int,
    temperature: float = 1.0,
    chunk_tokens: int = CHUNK_TOKENS,
    pack: bool = False,
) -> TokenScores:
    """Teacher-forced log-prob (and entropy) of each completion token given everything before it.

    Computed in fp32 from logits / temperature, the same distribution the engine samples from, `chunk_tokens`
    completion tokens at a time (0: the whole vocabulary at once), the sequences packed without padding if `pack`
    (within fp32 rounding of the padded rows on SDPA; bf16 rounding through the GPU's varlen attention); a model
    with the exact forward picks each token's log-prob with the engine's own kernel (`qarl_token_logprobs`,
    qarl/backends/exact_forward.py). Carries grad when grad is enabled.
    """
    found = completion_states(model, prompts, completions, pad_id, pack) if chunk_tokens > 0 else None
    if found is None:
        logits, targets, mask = completion_logits(model, prompts, completions, pad_id)
        picked, entropy = token_scores(logits, targets, temperature, getattr(model, "qarl_token_logprobs", None))
        return TokenScores(logprobs=picked * mask, entropy=entropy * mask, mask=mask)
    return scored_states(model, found, temperature, chunk_tokens)


def scored_states(model: torch.nn.Module, found: CompletionStates, temperature: float, chunk_tokens: int
                  ) -> TokenScores:
    """`score_completions` of the states that predict the completion tokens, `chunk_tokens` (> 0) at a time."""
    pick = getattr(model, "qarl_token_logprobs", None)
    if pick is None:
        weight, fused = linear_weight(found.head), getattr(found.head, FUSED_SCORES, False)
    else:  # the exact forward: its head's plain weight, if it has one; its gradients compiled on a GPU
        weight, fused = model.qarl_head_weight(), found.states.is_cuda
    if weight is not None:
        picked, entropy = LinearHeadScores.apply(found.states, weight, found.targets, temperature, chunk_tokens, fused,
                                                 pick)
    else:
        picked, entropy = in_chunks(lambda states, targets: token_scores(found.head(states), targets, temperature, pick),
                                    chunk_tokens, found.states, found.targets)
    return TokenScores(logprobs=found.scatter(picked), entropy=found.scatter(entropy), mask=found.mask)


def compile_scores(model: torch.nn.Module) -> None:
    """Score `model`'s linear head with compiled kernels (`LinearHeadScores`, `fused`; `policy.compile_scores`). A
    head that is not a plain linear map (a bias, adapters, its own forward, active quantizers) is refused: it is
    scored through autograd's chunks, which this does not compile."""
    parts = body_and_head(model)
    if parts is None:
        raise ConfigError("policy.compile_scores fuses the scoring of a linear head over the final hidden states; "
                          "this model's logits are changed after its head (soft-capping, logit scaling) and are "
                          "scored whole: set policy.compile_scores=false")
    head = parts[1]  # the head scoring calls
    if linear_weight(head) is None:
        raise ConfigError(f"policy.compile_scores fuses the scoring of a plain linear head; this model's head "
                          f"({type(head).__name__}) is scored through autograd's chunks (adapters on lm_head, a bias, "
                          "its own forward or active quantizers): set policy.compile_scores=false")
    setattr(head, FUSED_SCORES, True)
