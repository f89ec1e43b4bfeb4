"""One torch.distributed process of a Megatron-backend test (run by torchrun from tests/integration/test_megatron.py):
for each format, build the Megatron model from a Hugging Face directory at the given TP, quantize and
calibrate it, and write from rank 0 what the test compares with the HF backend: logits, folded weights,
gradients of a log-likelihood loss and quantizer state by Hugging Face name (`<out>/<format>.safetensors`). Several
comma-separated model directories run one after another in the same processes, each written to `<out>/<its name>/`
(starting torchrun and its imports is most of a small run's time)."""

import argparse
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("out")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--formats", default="none", help="comma-separated quant configs ('none': unquantized)")
    parser.add_argument("--save", action="store_true", help="also write <out>/<format>_checkpoint (Megatron's save_policy)")
    parser.add_argument("--train-steps", type=int, default=0,
                        help="first take this many AdamW steps on a policy-gradient loss of qarl's completion scores")
    parser.add_argument("--data-parallel", action="store_true",
                        help="the final loss of each data-parallel rank covers its own rows only (rank::dp)")
    parser.add_argument("--refit", action="store_true",
                        help="(one process) refit a vLLM engine from the Megatron model and from the HF backend")
    parser.add_argument("--state-from", help="load each format's quantizer state from <dir>/<format>_checkpoint")
    args = parser.parse_args()
    ids = torch.randint(2, 100, (4, 24), generator=torch.Generator().manual_seed(0))
    model_dirs = args.model_dir.split(",")
    if len(model_dirs) > 1 and (args.refit or args.state_from):
        parser.error("--refit and --state-from take one model directory")
    for model_dir in model_dirs:
        out = Path(args.out) / Path(model_dir).name if len(model_dirs) > 1 else Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        if run_model(model_dir, out, args, ids) == "refitted":
            return
    dist.barrier()


def run_model(model_dir: str, out: Path, args: argparse.Namespace, ids: torch.Tensor) -> str:
    """Every format of one model: what the test compares, written to `out`; "refitted" once an engine has run."""
    for name in args.formats.split(","):
        fmt = resolve_format(name)
        built = build_megatron_model(model_dir, args.tp, getattr(torch, args.dtype), torch.device("cpu"),
                                     fmt=fmt, calibration=lambda: [{"input_ids": ids[:2]}, {"input_ids": ids[2:]}])
        if fmt is not None and args.state_from:
            saved = Path(args.state_from) / f"{Path(name).stem}_checkpoint" / "quantizer_state.safetensors"
            built.load_quantizer_state(load_file(str(saved)))
        optimizer = torch.optim.AdamW(built.parameters(), lr=1e-3)
        for _ in range(args.train_steps):
            train_step(built, optimizer, ids)
        if args.save:
            built.save_policy(out / f"{Path(name).stem}_checkpoint", fmt, AutoTokenizer.from_pretrained(model_dir))
        built.model.zero_grad(set_to_none=True)
        logits = built.logits(ids)
        # a real loss through the fake-quantized forward: straight-through gradients reach every weight
        token_logprobs = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])
        if args.data_parallel:
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
        if args.refit:  # last, in a world of one: the engine's shutdown destroys torch.distributed's default group
            refit_both(built, model_dir, fmt, ids, out / f"{Path(name).stem}_refit.safetensors")
            return "refitted"
    return "done"


if __name__ == "__main__":
    main()
