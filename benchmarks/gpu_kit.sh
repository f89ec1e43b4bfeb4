#!/usr/bin/env bash
# Bring vLLM, ModelOpt and megatron-core to this project's GPU machine, which reaches no package index:
# build the workplace's GPU kit (wheels for Python 3.12 / torch 2.11, split in parts of < 47 MB) into
# .gpu-kit (kept out of git), then send it in two back-to-back device calls:
#   1. carry .gpu-kit/part1; command: mkdir -p /tmp/kit && mv .gpu-kit/part1/* /tmp/kit/
#   2. carry .gpu-kit/part2; command: . .gpu-kit/part2/assemble.sh && bash benchmarks/gpu_runs.sh STAGE $OUT
# A machine keeps /tmp only while warm (~30 s after a call): if it went back, send part 1 again.
# Users with a network install vLLM with pip instead (README, "GPU machines").
#   bash benchmarks/gpu_kit.sh            (QARL_GPU_KIT: where the kit lives, default ../shared/gpu-kit)
#   bash benchmarks/gpu_kit.sh --moe      (with vLLM's MoE kernels, for the moe_* stages: three parts, one call each,
#                                          the last one sourcing .gpu-kit/part3/assemble.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
kit="${QARL_GPU_KIT:-../shared/gpu-kit}"
[ -f "$kit/build.sh" ] || { echo "no GPU kit at $kit (set QARL_GPU_KIT)" >&2; exit 2; }
mkdir -p .git/info
grep -qx '/.gpu-kit/' .git/info/exclude 2>/dev/null || echo /.gpu-kit/ >> .git/info/exclude
bash "$kit/build.sh" .gpu-kit "$@"
