"""The `qarl` command: `qarl parity RECIPE [a.b=c ...] [--json]` (more subcommands per workflow)."""

from __future__ import annotations

import argparse
import json
import sys

from qarl.config import ConfigError, RecipeConfig, load_recipe


def _parity(args: argparse.Namespace) -> int:
    from qarl.parity import format_table, run_parity

    cfg = load_recipe(args.recipe, args.overrides, RecipeConfig)
    results = run_parity(cfg)
    print(json.dumps(results, indent=2) if args.json else format_table(results))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qarl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    parity = sub.add_parser("parity", help="train/rollout log-prob mismatch per quantization format")
    parity.add_argument("recipe")
    parity.add_argument("overrides", nargs="*", help="a.b=c recipe overrides")
    parity.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parity.set_defaults(func=_parity)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"qarl: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
