"""`qarl export`: the command-line face of qarl.export.

    qarl export CHECKPOINT --target export/nvfp4_w4a16_modelopt.yaml --out DIR [--then-verify] [--vllm]
    qarl export --verify DIR [--checkpoint CKPT] [--vllm]
    qarl export MODEL --calibrate --target ... --out DIR      # PTQ of an unquantized model (warns)
    qarl export CHECKPOINT --dequantized --out DIR [--dtype bfloat16]
                                    # the weights the policy computes with, dequantized (a qlora adapter
                                    # merged into its dequantized base): a plain model to re-quantize later

A LoRA checkpoint exports in its deployed form: mode=merged as one quantized model of the merged weights,
mode=qlora as the quantized base plus a PEFT adapter directory in DIR/adapter.

Prints one JSON object: the export summary (sizes, bytes per parameter, bit identity) and/or the
verification report (weights, fused scales, max |Δ logit| per loader). Exit status 1 if the
verification fails.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import Any

from qarl.config import ConfigError
from qarl.dir_lock import beside, check_out_dir, owning
from qarl.export.targets import load_target


def add_export_command(subparsers: Any) -> argparse.ArgumentParser:
    """Register `export` on the `qarl` command's subparsers; returns the new parser."""
    parser = subparsers.add_parser(
        "export", help="write a trained quantized policy as a real NVFP4/FP8 Hugging Face checkpoint, or verify one",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", nargs="?",
                        help="a checkpoint (step_N) or run directory (its newest complete checkpoint); with "
                             "--calibrate also a model directory or embedded:NAME")
    parser.add_argument("--target", help="an export target: export/<name>.yaml or just <name>")
    parser.add_argument("--out", help="the directory to write (must not exist or be empty, unless --overwrite)")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    parser.add_argument("--calibrate", action="store_true",
                        help="PTQ: quantize an unquantized model with fresh calibration (warns)")
    parser.add_argument("--calib-data", default="task",
                        help="with --calibrate: 'task' (the embedded task's prompts) or a local data file")
    parser.add_argument("--dequantized", action="store_true",
                        help="write the fake-quantized weights dequantized (adapters merged) as a plain model")
    parser.add_argument("--dtype", default="bfloat16", help="with --dequantized: the dtype written")
    parser.add_argument("--then-verify", action="store_true", help="verify the export right after writing it")
    parser.add_argument("--verify", metavar="DIR", help="verify an existing export instead of writing one")
    parser.add_argument("--checkpoint", dest="reference", metavar="CKPT",
                        help="with --verify: the checkpoint to compare with (default: the one the export names)")
    parser.add_argument("--vllm", action="store_true",
                        help="also load the export in vLLM (a subprocess; only formats with a kernel here)")
    parser.set_defaults(func=run_export_command)
    return parser


def run_export_command(args: argparse.Namespace) -> int:
    # Libraries print progress to stdout (ModelOpt's "Inserted N quantizers", ...): send it to stderr
    # so stdout carries exactly one JSON object.
    with contextlib.redirect_stdout(sys.stderr):
        result = _run(args)
    print(json.dumps(result, indent=2))
    return 0 if result.get("verify", {}).get("ok", True) else 1


def _run(args: argparse.Namespace) -> dict[str, Any]:
    if args.verify:
        if args.checkpoint or args.target or args.out:
            raise ConfigError("--verify DIR checks an existing export; give the reference checkpoint with "
                              "--checkpoint CKPT, not as a positional argument, and no --target/--out")
        from qarl.export import verify_export

        return {"verify": verify_export(args.verify, args.reference, vllm=args.vllm)}
    if args.dequantized:
        if not args.checkpoint or not args.out or args.target:
            raise ConfigError("qarl export CHECKPOINT --dequantized --out DIR takes no --target")
    else:
        missing = [flag for flag, value in (("CHECKPOINT", args.checkpoint), ("--target", args.target),
                                            ("--out", args.out)) if not value]
        if missing:
            raise ConfigError(f"qarl export needs {', '.join(missing)} (or --verify DIR)")
    if not Path(args.checkpoint).exists():
        raise ConfigError(f"checkpoint {args.checkpoint} not found: give a qarl checkpoint (RUN/checkpoints/step_N) or "
                          "run directory")
    if args.target:
        load_target(args.target)  # a name or file that is no target, said before anything loads
    out = Path(args.out)
    # --out is owned while the export runs (a lock beside it: the export replaces it whole by a rename), and must be
    # empty: both answered before anything loads.
    with owning(beside(out), f"--out {out}", args.overwrite, "--overwrite", "choose another --out"):
        check_out_dir(out, args.overwrite)
        return _dequantized(args) if args.dequantized else _export(args)


def _dequantized(args: argparse.Namespace) -> dict[str, Any]:
    from qarl.checkpoint import load_policy_checkpoint, trained_dtype
    from qarl.run_dir import resolve_checkpoint
    from qarl.config import PolicyConfig
    from qarl.export.dequantized import export_dequantized

    checkpoint = resolve_checkpoint(args.checkpoint)
    policy = load_policy_checkpoint(checkpoint, PolicyConfig(dtype=trained_dtype(checkpoint)))
    return {"export": export_dequantized(policy, args.out, args.dtype, overwrite=args.overwrite)}


def _export(args: argparse.Namespace) -> dict[str, Any]:
    from qarl.export import verify_export
    from qarl.export.core import export_policy, load_source, ptq_warning
    from qarl.export.targets import load_target

    target = load_target(args.target)
    policy, source, fp8_kernel = load_source(args.checkpoint, target, args.calibrate, args.calib_data)
    result: dict[str, Any] = {"export": export_policy(policy, target, args.out, source=source,
                                                      source_dir=Path(policy.model_dir), overwrite=args.overwrite,
                                                      fp8_kernel=fp8_kernel)}
    result["export"]["ptq"] = bool(args.calibrate)
    if args.calibrate:
        result["warnings"] = [ptq_warning(source, target.resolved_format().source, args.calib_data)]
    if args.then_verify:  # against the policy in memory: a PTQ export has no trained checkpoint
        result["verify"] = verify_export(args.out, policy=policy, vllm=args.vllm)
    return result
