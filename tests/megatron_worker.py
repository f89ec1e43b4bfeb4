"""One torch.distributed process of the Megatron-backend tests (run by torchrun from tests/integration/test_megatron.py).
It runs a list of jobs, one after another in the same processes (starting torchrun and its imports is most of a small
run's time): for each format of a job, build the Megatron model from a Hugging Face directory at the job's TP (the
processes beyond TP are data-parallel ranks), quantize and calibrate it, and write from rank 0 what the tests compare
with the HF backend: logits, folded weights, gradients of a log-likelihood loss and quantizer state by Hugging Face
name (`<job out>/<format>.safetensors`)."""

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from qarl.backends.megatron import build_megatron_model
from qarl.quant import resolve_format


def train_step(model, optimizer: torch.optim.Optimizer, ids: torch.Tensor) -> None:
    """One optimizer step of a policy-gradient loss: completions (the last 8 tokens of each row) scored by
    qarl's own `score_completions`, weighted by fixed advantages. The same function trains the HF backend in
    tests/integration/test_megatron.py."""
    from qarl.scoring import score_completions

    prompts, completions = [row[:16].tolist() for row in ids], [row[16:].tolist() for row in ids]
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])[: len(prompts), None]
    scores = score_completions(model, prompts, completions, pad_id=0)
    optimizer.zero_grad()
    (-(scores.logprobs * advantages).sum() / scores.mask.sum()).backward()
    getattr(model, "finish_gradients", lambda: None)()
    optimizer.step()


def refit_both(built, model_dir: str, fmt, ids: torch.Tensor, out: Path) -> None:
    """A vLLM engine in this process, refitted from the Megatron model, then from the HF backend quantized on the
    same batches: the engine's log-probs of the same greedy completions after each, and the Megatron model's."""
    from transformers import AutoModelForCausalLM

    from qarl.config import GenerationConfig
    from qarl.generation import VLLMEngine
    from qarl.scoring import score_completions
    from qarl.quant import quantize_policy

    prompts = [row[:8].tolist() for row in ids]
    engine = VLLMEngine(model_dir, GenerationConfig(max_new_tokens=8), "float32", 0, quant_format=fmt)
    engine.refit(built)
    completions = engine.generate(prompts, greedy=True)
    tokens = [c.token_ids for c in completions]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if fmt is not None:
        quantize_policy(hf, fmt, lambda: [{"input_ids": ids[:2]}, {"input_ids": ids[2:]}])
    engine.refit(hf)
    again = engine.generate(prompts, greedy=True)
    with torch.no_grad():
        policy = score_completions(built, prompts, tokens, pad_id=0).logprobs
    save_file({"engine_megatron": torch.tensor([c.logprobs for c in completions]),
               "engine_hf": torch.tensor([c.logprobs for c in again]),
               "same_tokens": torch.tensor([c.token_ids == t for c, t in zip(again, tokens)]),
               "policy": policy.contiguous()}, str(out))


@dataclass
class Job:
    """One model directory at one TP, each of `formats` (quant configs; "none": unquantized) in turn."""

    model_dir: str
    out: str
    tp: int = 1
    formats: tuple[str, ...] = ("none",)
    save: bool = False  # also write <out>/<format>_checkpoint (Megatron's save_policy)
    train_steps: int = 0  # first take this many AdamW steps on a policy-gradient loss of qarl's completion scores
    data_parallel: bool = False  # the final loss of each data-parallel rank covers its own rows only (rank::dp)
    refit: bool = False  # (a world of one, the last job) refit a vLLM engine from the Megatron model and the HF backend
    state_from: str | None = None  # load each format's quantizer state from <state_from>/<format>_checkpoint


def main() -> None:
    """`megatron_worker.py JOBS.json`: a JSON list of `Job` fields."""
    jobs = [Job(**job) for job in json.loads(Path(sys.argv[1]).read_text())]
    if any(job.refit for job in jobs[:-1]) or any(len(job.formats) > 1 for job in jobs if job.refit):
        raise SystemExit("a refit job must be the last, of one format: the engine's shutdown ends torch.distributed's "
                         "default group")
    ids = torch.randint(2, 100, (4, 24), generator=torch.Generator().manual_seed(0))
    for job in jobs:
        Path(job.out).mkdir(parents=True, exist_ok=True)
        run_job(job, ids)
    if not jobs[-1].refit:
        dist.barrier()


def run_job(job: Job, ids: torch.Tensor) -> None:
    """Every format of one job: what the tests compare, written to `job.out`."""
    out = Path(job.out)
    for name in job.formats:
        fmt = resolve_format(name)
        built = build_megatron_model(job.model_dir, job.tp, torch.float32, torch.device("cpu"),
                                     fmt=fmt, calibration=lambda: [{"input_ids": ids[:2]}, {"input_ids": ids[2:]}])
        if fmt is not None and job.state_from:
            saved = Path(job.state_from) / f"{Path(name).stem}_checkpoint" / "quantizer_state.safetensors"
            built.load_quantizer_state(load_file(str(saved)))
        optimizer = torch.optim.AdamW(built.parameters(), lr=1e-3)
        for _ in range(job.train_steps):
            train_step(built, optimizer, ids)
        if job.save:
            built.save_policy(out / f"{Path(name).stem}_checkpoint", fmt, AutoTokenizer.from_pretrained(job.model_dir))
        built.model.zero_grad(set_to_none=True)
        logits = built.logits(ids)
        # a real loss through the fake-quantized forward: straight-through gradients reach every weight
        token_logprobs = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])
        if job.data_parallel:
            from megatron.core import parallel_state

            dp = parallel_state.get_data_parallel_world_size()
            token_logprobs = token_logprobs[parallel_state.get_data_parallel_rank()::dp]
        token_logprobs.sum().backward()
        built.finish_gradients()
        tensors = {f"weight/{k}": v.contiguous() for k, v in built.hf_tensors()}
        tensors.update({f"master/{k}": v.clone() for k, v in built.hf_tensors(fold=False)})
        tensors.update({f"grad/{k}": v.contiguous() for k, v in built.hf_tensors(grads=True)})
        tensors.update({f"amax/{k}": v for k, v in built.quantizer_state().items()})
        if dist.get_rank() == 0:
            save_file({"logits": logits.detach().float().contiguous(), "ids": ids, **tensors},
                      str(out / f"{Path(name).stem}.safetensors"))
        if job.refit:
            refit_both(built, job.model_dir, fmt, ids, out / f"{Path(name).stem}_refit.safetensors")


if __name__ == "__main__":
    main()
