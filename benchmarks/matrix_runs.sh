#!/usr/bin/env bash
# The runs behind the accuracy matrix and W4A4 study of docs/results/cpu.md (issue 13), on the embedded default, 2 CPU cores.
# Every run shares one held-out split (task.seed=0) and one warm-started base (warm_start.seed=0); run.seed varies.
#   bash benchmarks/matrix_runs.sh        (~45 min), then
#   .venv/bin/qarl matrix recipes/matrix_tiny.yaml          the matrix of docs/results/cpu.md (runs/matrix/table)
#   .venv/bin/qarl matrix recipes/matrix_w4a4_tiny.yaml     the W4A4 study's matrix (runs/matrix/table_w4a4)
#   .venv/bin/python benchmarks/compare_runs.py runs/matrix/{qagrpo_w4a16_s0,qagrpo_w4a4_s0,w4a4_*,grpo_s0,grpo_lr3e-4_s0} \
#       --out benchmarks/results/w4a4_study.png               the W4A4 study's curves
# The recipes read the runs from runs/matrix. Runs that already finished are skipped, so the script
# resumes after an interruption.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=runs/matrix
QARL=".venv/bin/qarl"
W4A4=quant_configs/nvfp4_w4a4.yaml
run() {  # run NAME COMMAND RECIPE OVERRIDES...
  local name=$1 cmd=$2 recipe=$3; shift 3
  if [ -f "$OUT/$name/metrics.jsonl" ] && grep -q '"eval/accuracy"' <(tail -n 1 "$OUT/$name/metrics.jsonl"); then
    echo "== $name: done"; return
  fi
  echo "== $name"
  $QARL "$cmd" "$recipe" run.dir="$OUT/$name" task.seed=0 warm_start.seed=0 trainer.resume=true "$@"
}
for seed in 0 1 2; do
  run "grpo_s$seed" train recipes/qa_grpo_tiny.yaml run.seed=$seed policy.quant_cfg=none
  run "qagrpo_w4a16_s$seed" train recipes/qa_grpo_tiny.yaml run.seed=$seed
  run "qagrpo_w4a4_s$seed" train recipes/qa_grpo_tiny.yaml run.seed=$seed policy.quant_cfg=$W4A4
  # QAD from the same base as the GRPO runs (qa_grpo_tiny's 46-step warm start), which is also its teacher
  run "qad_w4a4_s$seed" distill recipes/qa_distillation_tiny.yaml run.seed=$seed warm_start.steps=46
done
# The W4A4 study: what helps QA-GRPO at NVFP4 W4A4 (seed 0; compare with qagrpo_w4a4_s0 and qagrpo_w4a16_s0)
run w4a4_lr3e-5 train recipes/qa_grpo_tiny.yaml policy.quant_cfg=$W4A4 trainer.lr=3.0e-5
run w4a4_lr3e-4 train recipes/qa_grpo_tiny.yaml policy.quant_cfg=$W4A4 trainer.lr=3.0e-4
run w4a4_no_tis train recipes/qa_grpo_tiny.yaml policy.quant_cfg=$W4A4 trainer.vllm_importance_sampling_correction=false
run w4a4_layer0_fp train recipes/qa_grpo_tiny.yaml policy.quant_cfg=benchmarks/quant_configs/nvfp4_w4a4_layer0_fp.yaml
run w4a4_mlp_only train recipes/qa_grpo_tiny.yaml policy.quant_cfg=benchmarks/quant_configs/nvfp4_w4a4_mlp_only.yaml
# ModelOpt's 4-over-6 NVFP4 (static MSE-searched weight block scales, max 4 or 6 per block; W4A4)
run w4a4_four_over_six train recipes/qa_grpo_tiny.yaml policy.quant_cfg=NVFP4_FOUR_OVER_SIX_CFG
# At trainer.lr=3e-4 W4A4 converges (README, "The W4A4 question"): its other seeds, and GRPO at the same learning rate,
# the fair "train unquantized, then PTQ" comparison
for seed in 1 2; do
  run "w4a4_lr3e-4_s$seed" train recipes/qa_grpo_tiny.yaml run.seed=$seed policy.quant_cfg=$W4A4 trainer.lr=3.0e-4
done
for seed in 0 1 2; do
  run "grpo_lr3e-4_s$seed" train recipes/qa_grpo_tiny.yaml run.seed=$seed policy.quant_cfg=none trainer.lr=3.0e-4
done
