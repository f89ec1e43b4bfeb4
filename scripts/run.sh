#!/usr/bin/env bash
# The main job on the embedded default: set up (idempotent), then QA-GRPO on the tiny model.
# Extra arguments are recipe overrides, e.g. `bash scripts/run.sh trainer.steps=20`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/qarl train recipes/qa_grpo_tiny.yaml "$@"
