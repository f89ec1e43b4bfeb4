"""The bad inputs of tests/unit/test_recipe_errors.py, run as a user would, with each message and time: the table of
the docs' troubleshooting page.

    python benchmarks/bad_inputs.py --markdown > /tmp/bad_inputs.md   # then paste under docs/troubleshooting.md
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: the cases live in its tests
from tests.unit.test_recipe_errors import CASES, REPO, make_fixtures, placed, run_case  # noqa: E402


def shown(text: str, fixtures: Path) -> str:
    """`text` with the fixtures' folder as FIXTURES and the checkout as REPO: the same table on any machine."""
    return text.replace(str(fixtures), "FIXTURES").replace(str(REPO), "REPO")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--markdown", action="store_true", help="a Markdown table (default: plain lines)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fixtures = make_fixtures(Path(tmp) / "fixtures")
        rows = []
        for case in CASES:
            code, stderr, seconds = run_case(case, fixtures)
            message = shown(stderr.strip().splitlines()[-1], fixtures) if stderr.strip() else ""
            rows.append((case, code, message, seconds))
    if args.markdown:
        print("| input | command (after `qarl`) | message | exit | seconds |\n|---|---|---|---|---|")
        for case, code, message, seconds in rows:
            env = "".join(f" (with {k}={v})" for k, v in case.env)
            command = shown(placed(" ".join(case.args) + env, fixtures), fixtures)
            print(f"| {case.name} | `{command}` | {message.replace('|', '/')} | {code} | {seconds:.2f} |")
    else:
        for case, code, message, seconds in rows:
            print(f"{seconds:5.2f} s  exit {code}  {case.name}: {message}")


if __name__ == "__main__":
    main()
