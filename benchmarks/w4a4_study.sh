#!/usr/bin/env bash
# The W4A4 study (issue 72) in one sitting, on SmolLM2-135M-Instruct: three seeds of GRPO bf16 (the teachers and the
# PTQ rows), QA-GRPO W4A4 with the exact forward from the base, and the chain GRPO -> QAD W4A4 -> QA-GRPO W4A4 in plain
# NVFP4 W4A4, with each activation-error method alone and with the methods together, every chain from the same GRPO
# teachers, and QAD W4A4 with down_proj left unquantized (the mixed format that exports); then three of the pipeline's
# tables (MATRICES: QAD W4A4 plain and with down_proj unquantized, paired, with their exports; the plain chain with
# GRPO after W4A4 PTQ and its exports served by vLLM; the methods together, trained rows: no engine serves their
# formats) and `keep`'s table.md with every row.
#   bash benchmarks/w4a4_study.sh plan          # every run's `qarl` arguments, nothing started
#   bash benchmarks/w4a4_study.sh start         # then `wait S` and `keep TAR`, as benchmarks/smollm2_gpu.sh's
# The stages are benchmarks/smollm2_gpu.sh's (its header: WORKDIR, SEEDS, MAX_RUNS_PER_GPU, ...); this script only
# names the runs. One method alone is a variant of the chain's two quantized stages, both in its quant config (the
# third stage takes the second's amax only in the same format):
#   pt    per-token second-level activation scales   quant_configs/nvfp4_w4a4_per_token.yaml
#   fos   4-over-6 block scales of the inputs        quant_configs/nvfp4_w4a4_four_over_six.yaml
#   fosw  4-over-6 of the weights and the inputs     quant_configs/nvfp4_w4a4_four_over_six_all.yaml
#   had   inputs rotated by a Hadamard of 16, online quant_configs/nvfp4_w4a4_hadamard.yaml
#   down  down_proj's input at 16 bits (75 % of the linear multiply-adds left in W4A4)
#                                                    quant_configs/nvfp4_w4a4_down_a16.yaml
# Size: 3 seeds x 17 runs (GRPO, QA-GRPO W4A4, seven chains of two stages, QAD with down_proj unquantized); by the stage times in
# benchmarks/smollm2_gpu.sh's header, hours on one GPU, shared by several GPUs of one machine. Not yet run whole.
set -euo pipefail
cd "$(dirname "$0")/.."

RUNS="grpo_bf16 qa_grpo_w4a4 qad_w4a4 qad_w4a4_down_bf16 qad_grpo_then_qa_grpo_w4a4 qad_w4a4_methods
      qad_grpo_then_qa_grpo_w4a4_methods"
for method in pt=nvfp4_w4a4_per_token fos=nvfp4_w4a4_four_over_six fosw=nvfp4_w4a4_four_over_six_all \
              had=nvfp4_w4a4_hadamard down=nvfp4_w4a4_down_a16; do
  tag="${method%%=*}"
  RUNS+=" qad_w4a4+$tag qad_grpo_then_qa_grpo_w4a4+$tag"
  export "ARGS_qad_w4a4_$tag=policy.quant_cfg=quant_configs/${method#*=}.yaml"
  export "ARGS_qad_grpo_then_qa_grpo_w4a4_$tag=policy.quant_cfg=quant_configs/${method#*=}.yaml"
done
export RUNS MATRICES="${MATRICES:-matrix_smollm2_qad_paired matrix_smollm2_w4a4_chain matrix_smollm2_w4a4_chain_methods}"
exec bash benchmarks/smollm2_gpu.sh "$@"
