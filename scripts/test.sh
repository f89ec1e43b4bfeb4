#!/usr/bin/env bash
# The test suite: set up (idempotent), then pytest. Long runs are behind `-m slow` (see pyproject.toml).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
