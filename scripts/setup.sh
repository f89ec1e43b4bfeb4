#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv and install qarl into it.
# Idempotent: a stamp of the install inputs skips the install when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${QARL_VENV:-.venv}"
PY="${PYTHON:-python3}"
TORCH_PIN="${QARL_TORCH:-torch==2.13.0+cpu}"
EXTRAS="${QARL_EXTRAS:-cpu,test}"

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
stamp="$VENV/.qarl-installed"
want="$(cat pyproject.toml scripts/overrides.txt scripts/setup.sh | sha256sum | cut -d' ' -f1) $TORCH_PIN $EXTRAS"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
"$VENV/bin/python" -m pip install -q --upgrade uv
# uv ignores PIP_FIND_LINKS (where the CPU torch wheel lies on this kind of machine): pass it on.
find_links=()
for d in ${PIP_FIND_LINKS:-}; do find_links+=(--find-links "$d"); done
# --compile-bytecode: the libraries' .pyc files written once here. Without them a shell with PYTHONDONTWRITEBYTECODE
# set (as CI's) compiles torch, vLLM and transformers from source in every process: ~12 s of each `qarl` start.
"$VENV/bin/python" -m uv pip install --python "$VENV/bin/python" "${find_links[@]}" --compile-bytecode \
  --override scripts/overrides.txt "$TORCH_PIN" -e ".[$EXTRAS]"
echo "$want" > "$stamp"
