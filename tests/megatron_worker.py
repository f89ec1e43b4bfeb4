"""One torch.distributed process of a Megatron-backend test (run by torchrun from tests/test_megatron.py):
for each format, build the Megatron model from a Hugging Face directory at the given TP, quantize and
calibrate it, and write from rank 0 what the test compares with the HF backend: logits, folded weights,
gradients of a log-likelihood loss and quantizer state by Hugging Face name (`<out>/<format>.safetensors`)."""

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from qarl.backends.megatron import build_megatron_model, quantize_megatron
from qarl.quant import resolve_format


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("out")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--formats", default="none", help="comma-separated quant configs ('none': unquantized)")
    parser.add_argument("--save", action="store_true", help="also write <out>/<format>_checkpoint (Megatron's save_policy)")
    parser.add_argument("--state-from", help="load each format's quantizer state from <dir>/<format>_checkpoint")
    args = parser.parse_args()
    ids = torch.randint(2, 100, (4, 24), generator=torch.Generator().manual_seed(0))
    for name in args.formats.split(","):
        fmt = resolve_format(name)
        built = build_megatron_model(args.model_dir, args.tp, getattr(torch, args.dtype), torch.device("cpu"))
        if fmt is not None:
            quantize_megatron(built, args.model_dir, fmt, [ids[:2], ids[2:]])
            if args.state_from:
                saved = Path(args.state_from) / f"{Path(name).stem}_checkpoint" / "quantizer_state.safetensors"
                built.load_quantizer_state(load_file(str(saved)))
        if args.save:
            built.save_policy(Path(args.out) / f"{Path(name).stem}_checkpoint", args.model_dir, fmt)
        logits = built.logits(ids)
        # a real loss through the fake-quantized forward: straight-through gradients reach every weight
        torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).sum().backward()
        built.finish_gradients()
        tensors = {f"weight/{k}": v.contiguous() for k, v in built.hf_tensors()}
        tensors.update({f"grad/{k}": v.contiguous() for k, v in built.hf_tensors(grads=True)})
        tensors.update({f"amax/{k}": v for k, v in built.quantizer_state().items()})
        if dist.get_rank() == 0:
            save_file({"logits": logits.detach().float().contiguous(), "ids": ids, **tensors},
                      str(Path(args.out) / f"{Path(name).stem}.safetensors"))
    dist.barrier()


if __name__ == "__main__":
    main()
