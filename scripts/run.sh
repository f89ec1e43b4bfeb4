#!/usr/bin/env bash
# The main job on the embedded default: set up (idempotent), then QA-GRPO on the tiny model.
# Extra arguments are recipe overrides, e.g. `bash scripts/run.sh trainer.steps=20`. Each run writes to a new
# directory, runs/qa_grpo_tiny/<date-time>, so no run overwrites another; name one with run.dir=DIR (to resume it:
# run.dir=DIR trainer.resume=true).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
run_dir=()
case " $* " in
  *" run.dir="*) ;;
  *) run_dir=("run.dir=runs/qa_grpo_tiny/$(date +%Y%m%d-%H%M%S)") ;;
esac
exec .venv/bin/qarl train recipes/qa_grpo_tiny.yaml "${run_dir[@]}" "$@"
