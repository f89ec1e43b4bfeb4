"""Each sampled token's log-prob, kept where vLLM's sampler computes it, instead of passing through vLLM's bookkeeping.

qarl needs one number per generated token: the log-prob the engine sampled it with (importance weights,
the mismatch metrics). Asked for it (`logprobs=0`), vLLM carries it from the sampler to the caller request by
request and step by step in Python: copied to lists in the model runner, sliced in the scheduler, appended in
the output processor. In-process, that work sits between every two decode steps; on an H100 at batch 512 it
cost 40-50 % of the rollout's throughput (benchmarks/results/gpu/rollout_profile.md).

`SampledLogprobs` gives the model runner's sampler a mixin instead. While `recording()`, the sampler runs as
vLLM's own with the log-probs of the sampled tokens switched on (so the numbers are the ones vLLM would return,
computed by the same code from the same logits), keeps them on the device with the sampled token ids and
the batch's request ids, and hands vLLM a sampler output without log-probs, so nothing downstream touches
them. After `generate`, one copy brings them to the host; each request's log-probs are its recorded samples
in step order, minus the rows vLLM discards (a partial prefill's), cut to the tokens vLLM returned and
checked token by token against them: a sample that does not line up is an error, never a shifted log-prob.

vLLM has two model runners with two samplers: the v1 runner's (CPU, and GPU where the v2 runner does not
serve) and the v2 runner's (vLLM 0.26's GPU default for dense models). Each gets its own small mixin. A
sampler of another shape (another vLLM version's) or speculative decoding gets none, and the engine asks
vLLM for the log-probs. A step in which some request asks vLLM for log-probs itself is passed through
unrecorded (the check after `generate` then refuses the records, loudly).
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

from qarl.quant.mixins import with_mixin


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
        (another vLLM version's), or speculative decoding (several tokens a step, sampled elsewhere)."""
        from vllm.v1.sample.sampler import Sampler as V1Sampler

        sampler = getattr(runner, "sampler", None)
        if runner.vllm_config.speculative_config is not None:
            return None
        if isinstance(sampler, V1Sampler) and hasattr(runner, "discard_request_mask"):
            mixin = _V1Recording
        elif (type(sampler).__module__ == "vllm.v1.worker.gpu.sample.sampler"
              and callable(getattr(type(sampler), "returns_logprobs", None))):  # vLLM 0.26's v2 sampler
            mixin = _V2Recording
        else:
            return None
        recorder = cls()
        sampler.__class__ = with_mixin(mixin, type(sampler), "Recording", globals())
        sampler.__dict__.update(_qarl_recorder=recorder, _qarl_runner=runner)
        return recorder

    @property
    def active(self) -> bool:
        return self._steps is not None

    def record(self, req_ids: list[str], kept: torch.Tensor | None, tensors: Any) -> None:
        """One sampler call: its rows' request ids, which rows' samples vLLM keeps, and vLLM's LogprobsTensors
        of the sampled tokens (column 0: the sampled token, as `logprobs=0` returns it)."""
        if tensors is None:
            raise RuntimeError("vLLM's sampler computed no log-probs where qarl switched them on; this vLLM version "
                               "is not supported by qarl's engine. Please report it with the vLLM version.")
        self._steps.append(_Step(list(req_ids), kept, tensors.logprob_token_ids[:, 0], tensors.logprobs[:, 0]))

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
        by_request = {_external_id(req_id, wanted): indices for req_id, indices in rows.items()}
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


def _external_id(req_id: str, wanted: set[str]) -> str:
    """The caller's request id of the model runner's `req_id`: vLLM appends '-' and 8 random characters
    to each (unless VLLM_DISABLE_REQUEST_ID_RANDOMIZATION)."""
    return req_id if req_id in wanted else req_id.rsplit("-", 1)[0]


class _V1Recording:
    """Mixed into the v1 model runner's `Sampler` (an nn.Module; vllm/v1/sample/sampler.py)."""

    def forward(self, logits: torch.Tensor, sampling_metadata: Any, *args: Any, **kwargs: Any) -> Any:
        recorder: SampledLogprobs = self._qarl_recorder
        if (not recorder.active or sampling_metadata.max_num_logprobs is not None
                or getattr(sampling_metadata, "logprob_token_ids", None)):
            return super().forward(logits, sampling_metadata, *args, **kwargs)  # a request asked itself: unrecorded
        output = super().forward(logits, dataclasses.replace(sampling_metadata, max_num_logprobs=0), *args, **kwargs)
        runner = self._qarl_runner
        rows = output.sampled_token_ids.shape[0]
        discarded = runner.discard_request_mask.np[:rows]  # set for this step before sampling
        kept = torch.from_numpy(~discarded) if discarded.any() else None
        recorder.record(runner.input_batch.req_ids[:rows], kept, output.logprobs_tensors)
        return dataclasses.replace(output, logprobs_tensors=None)


class _V2Recording:
    """Mixed into the v2 model runner's `Sampler` (vllm/v1/worker/gpu/sample/sampler.py), which computes the
    sampled tokens' log-probs for a batch when `returns_logprobs` says so."""

    def returns_logprobs(self, idx_mapping_np: np.ndarray) -> bool:
        return self._qarl_recorder.active or super().returns_logprobs(idx_mapping_np)

    def __call__(self, logits: torch.Tensor, input_batch: Any) -> Any:
        recorder: SampledLogprobs = self._qarl_recorder
        if not recorder.active or super().returns_logprobs(input_batch.idx_mapping_np):
            return super().__call__(logits, input_batch)  # a request asked itself: unrecorded
        output = super().__call__(logits, input_batch)
        kept = output.num_sampled > 0  # 0 where a partial prefill's sample is thrown away
        recorder.record(input_batch.req_ids, kept, output.logprobs_tensors)
        return dataclasses.replace(output, logprobs_tensors=None)
