"""Each sampled token's log-prob, kept where vLLM's sampler computes it, instead of passing through vLLM's bookkeeping.

qarl needs one number per generated token: the log-prob the engine sampled it with (importance weights,
the mismatch metrics). Asked for it (`logprobs=0`), vLLM carries it from the sampler to the caller request by
request and step by step in Python: copied to lists in the model runner, sliced in the scheduler, appended in
the output processor. In-process, that work sits between every two decode steps, where on a GPU it cost a
large share of the rollout's throughput (measured: benchmarks/results/gpu/rollout_profile.md, README.md there).

`SampledLogprobs` gives the model runner's sampler a mixin instead. While `recording()`, the sampler runs as
vLLM's own with the log-probs of the sampled tokens switched on (so the numbers are the ones vLLM would return,
computed by the same code from the same logits), keeps them on the device with the sampled token ids and
the batch's request ids, and hands vLLM a sampler output without log-probs, so nothing downstream touches
them. After `generate`, one copy brings them to the host; each request's log-probs are its recorded samples
in step order, minus the rows vLLM discards (a partial prefill's), cut to the tokens vLLM returned and
checked token by token against them: a sample that does not line up is an error, never a shifted log-prob.

vLLM has two model runners with two samplers: the v1 runner's (CPU, and GPU where the v2 runner does not
serve) and the v2 runner's (vLLM 0.26's GPU default for dense models). Each gets its own small mixin, kept
with qarl's other vLLM patches (`vllm_compat.record_at_sampler`). A sampler of another shape (another vLLM
version's) or speculative decoding gets none, and the engine asks vLLM for the log-probs. A step in which
some request asks vLLM for log-probs itself is passed through unrecorded (the check after `generate` then
refuses the records, loudly).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections import defaultdict
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from qarl.generation import vllm_compat


@dataclasses.dataclass
class _Step:
    req_ids: list[str]  # the batch's rows: request ids as the model runner knows them
    kept: torch.Tensor | None  # [rows] bool, False where vLLM throws the sample away as it samples (a partial
    # prefill's); None: all kept. A sample taken after its request finished is kept here and cut in `logprobs`
    token_ids: torch.Tensor  # [rows] the sampled tokens
    logprobs: torch.Tensor  # [rows] their log-probs


class SampledLogprobs:
    """Records the sampled tokens' log-probs at vLLM's sampler (see the module docstring)."""

    def __init__(self) -> None:
        self._steps: list[_Step] | None = None  # None: not recording
        self._taken: list[_Step] = []  # the latest recording's, until `logprobs` reads them

    @classmethod
    def attach(cls, runner: Any) -> SampledLogprobs | None:
        """A recorder on `runner`'s sampler, or None where it does not serve: a sampler it does not know
        (another vLLM version's), or speculative decoding (several tokens a step, sampled elsewhere). The sampler
        gets a mixin (`vllm_compat.record_at_sampler`) that hands this recorder each step's samples."""
        recorder = cls()
        return recorder if vllm_compat.record_at_sampler(runner, recorder) else None

    @property
    def active(self) -> bool:
        return self._steps is not None

    def record(self, req_ids: list[str], kept: torch.Tensor | None, token_ids: torch.Tensor,
               logprobs: torch.Tensor) -> None:
        """One sampler call: its rows' request ids, which rows' samples vLLM keeps, the sampled tokens and their
        log-probs."""
        self._steps.append(_Step(list(req_ids), kept, token_ids, logprobs))

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Record every sample of the body's `generate` (which must not ask vLLM for log-probs itself)."""
        self._steps = []
        try:
            yield
        finally:
            self._taken, self._steps = self._steps, None

    def logprobs(self, outputs: Sequence[Any]) -> list[list[float]]:
        """The log-prob of every token of each of vLLM's `RequestOutput`s (one sample each), from the
        latest `recording()`."""
        steps, self._taken = self._taken, []
        rows: dict[str, list[int]] = defaultdict(list)  # request id -> its kept samples' indices, in step order
        token_ids, logprobs = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)
        if steps:
            device = steps[0].token_ids.device
            token_ids = torch.cat([s.token_ids for s in steps]).cpu().numpy()
            logprobs = torch.cat([s.logprobs for s in steps]).float().cpu().numpy()
            kept = torch.cat([s.kept.to(device) if s.kept is not None else torch.ones(len(s.req_ids), dtype=torch.bool,
                                                                                      device=device)
                              for s in steps]).tolist()
            req_ids = itertools.chain.from_iterable(s.req_ids for s in steps)
            for index, (req_id, keep) in enumerate(zip(req_ids, kept)):
                if keep:
                    rows[req_id].append(index)
        wanted = {out.request_id for out in outputs}
        by_request = {vllm_compat.caller_request_id(req_id, wanted): indices for req_id, indices in rows.items()}
        if len(by_request) != len(rows):
            raise RuntimeError("two of vLLM's requests map to one caller request id; qarl's engine cannot tell "
                               "their log-probs apart")
        result = []
        for out in outputs:
            sample = out.outputs[0]
            indices = by_request.get(out.request_id, [])[:len(sample.token_ids)]
            if len(indices) != len(sample.token_ids) or not np.array_equal(token_ids[indices], sample.token_ids):
                raise RuntimeError(
                    f"the sampler's records of request {out.request_id} do not line up with the {len(sample.token_ids)} "
                    f"tokens vLLM returned ({len(indices)} samples recorded); this vLLM version schedules samples in a "
                    "way qarl does not follow. Please report it with the vLLM version.")
            result.append(logprobs[indices].tolist())
        return result
