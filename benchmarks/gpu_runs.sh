#!/usr/bin/env bash
# The GPU results of benchmarks/results/gpu_*.md, one stage per call of at most 10 minutes:
#   bash benchmarks/gpu_runs.sh STAGE [OUT_DIR]
# Stages, in order (later ones reuse the embedded 0.5B model, warm start and runs of earlier ones):
#   kernels   fast fake-quant kernels vs ModelOpt's, bit for bit and timed; GPU tests without an engine; policy-side step time
#   parity    `qarl parity` on the embedded 0.5B model in bf16, fp16 and fp32
#   grpo      the warm-start length that gives a low success rate (benchmarks/warm_start_sweep.py), then
#             QA-GRPO NVFP4 W4A16 on the 0.5B model, bf16 compute + fp32 masters, colocated
#   memory    8 steps of that run colocated (engine asleep during updates) and 8 with the engine awake
#   fp16      the same run in fp16 compute (dynamic loss scaling)
#   qad       QAD NVFP4 W4A4 on the 0.5B model
#   export    the QA-GRPO checkpoint exported (ModelOpt NVFP4, compressed-tensors NVFP4) and loaded by vLLM
#   fp8       a short FP8 QA-GRPO run exported (ModelOpt FP8, compressed-tensors FP8) and loaded by vLLM
#   graphs [K]  GPU tests of the engine with CUDA graphs (refits reach the graphs; the input-quant op equals ModelOpt's;
#             engines restart); K: a pytest -k expression picking some
#   pytest ARGS  pytest with these arguments (some GPU tests: 'pytest tests/unit/test_memory.py')
#   rollout   rollout tokens/s: plain vLLM against qarl's engine per format (benchmarks/gpu_rollout.py)
#   rollout_user_shape  the same at the user shape (256 x 1,024 tokens): GRPO, W4A16, and W4A4 with the exact forward
#   parity_graphs  `qarl parity` bf16 with CUDA graphs and with enforce_eager, in one call
#   e2e       step time of GRPO (unquantized) and QA-GRPO NVFP4 W4A16 on the 0.5B model, graphs; W4A16 eager
#   megatron  HF vs Megatron-core backend log-probs on the 0.5B model, fp32 and bf16, every format, TP = the
#             number of GPUs (benchmarks/megatron_parity.py; one GPU: TP=1, two: TP=2)
#   megatron_grpo  QA-GRPO NVFP4 W4A16 of the 0.5B model on the Megatron backend (TP=1; the `grpo` stage's recipe)
#   megatron_resume  a shorter such run at TP = the number of GPUs, SIGKILLed after its first checkpoint and resumed,
#             against the same run uninterrupted (benchmarks/resume_check.py --nproc)
#   megatron_user_shape [SHAPE [TP]]  QA-GRPO NVFP4 W4A16 of a real shape (default qwen3-8b: no room on one GPU for its
#             full-training state) on the Megatron backend over every GPU, TP (default all), the rest data parallel
#   megatron_qad  QAD NVFP4 W4A4 of the 0.5B model on the Megatron backend (the `qad` stage's recipe)
#   share     the e2e runs with the policy's compute weights shared with the engine and copied (share_weights)
#   exact [DTYPE:EAGER ...]  the exact forward: its kernels' row invariance, then `qarl parity` with
#             policy.exact_forward=true on the 0.5B model, bf16 and fp16, eager and with CUDA graphs (arguments: some of
#             them, e.g. bfloat16:false for bf16 with graphs)
#   exact_grpo  QA-GRPO of the 0.5B model with the exact forward on or off (arguments: format, true|false)
#   exact_matmul  which matmul the exact forward could run: cuBLASLt (vLLM's mode), cuBLAS (refused in that mode) and vLLM's
#             persistent Triton kernel, each row's bits in batches of 1-2,048 rows against 8,264, their GPU time (CUDA
#             graphs) and host time a call (eager launches) (benchmarks/exact_matmul.py)
#   exact_cost [user_shape [FORMAT]]  the policy's forward + backward with the exact forward on against off
#             (benchmarks/exact_step_time.py; user_shape: one micro-batch of the user shape's recipe, profiled; FORMAT:
#             a quant config other than NVFP4 W4A4, e.g. quant_configs/fp8_w8a8.yaml, profiled into user_shape_NAME)
#   exact_tests  the GPU tests of the exact forward (tests/integration/test_gpu_exact.py)
#   host_waits_ab DIR  one user-shape micro-batch's forward + backward, exact and default, with an earlier qarl package
#             (in DIR) against this checkout's: what the update's host waits cost (issue 74)
#   graph_probe  one user-shape micro-batch of the update (W4A4 exact forward, then W4A16 default) against a CUDA
#             graph: its host synchronizations by qarl frame, one capture and, if it holds, replay against eager bits
#             and time (benchmarks/graph_probe.py; issue 74's first measurement)
#   update_profile [FORMAT ...]  one step's whole update at the user shape with CUDA graphs on and off, each in its own
#             process: the host's busy time against the GPU's (torch.profiler) and the update's MFU
#             (benchmarks/update_profile.py; formats: none, nvfp4_a16 (default path), nvfp4_w4a4_exact, fp8_w8a8_exact;
#             default nvfp4_a16 nvfp4_w4a4_exact)
#   kv_cache_exact  the FP8 KV cache's GPU tests (refits in place under graphs; the exact forward's parity with the
#             cache), then `qarl parity` of the 0.5B model with the cache, exact forward on and off (issue 73 item 2)
#   kv_cache_user_shape [LENGTH ...]  the FP8 KV cache at the user shape: cache capacity and decode tokens/s after
#             16k/4k/1k-token contexts (arguments: some of 16384 4096 1024), bf16 cache against FP8, plain vLLM
#             beside qarl's engine (issue 73 item 5); for QA-GRPO with and without the cache: exact_grpo OUT
#             nvfp4_a16_kv_fp8 true|false (false needs policy.generation.allow_quant_mismatch=true: EXTRA)
#   kv_cache_export  the exact_grpo checkpoints of nvfp4_a16_kv_fp8 and nvfp4_a16 (exact forward on) exported, ModelOpt
#             and compressed-tensors, and served by vLLM, with its FP8 cache where the export has KV scales (issue 73)
#   profile   where the time goes: a no-grad scoring pass per activation format (benchmarks/gpu_profile_update.py
#             --score) and a rollout at batch 512 with and without log-probs and seeds (gpu_profile_rollout.py)
#   fast_settings [K]  what `auto` decides for each kind of run on a GPU (start-up lines, 2 steps each), its tests
#             (K: a pytest -k expression picking some runs)
#   fast_table [ROW ...]  the fast settings' table at the user shape (3 steps a row; default every row, ~3.5 min
#             each: split them over calls): grpo_eager, w4a16_eager (compilation, token budgets and graphs off, the
#             settings before auto), grpo_auto, w4a16_auto (the defaults), grpo_graphs, w4a16_graphs (the defaults
#             and trainer.cuda_graphs=on), w4a4_exact, fp8_exact (the exact forward), w4a4_exact_graphs,
#             fp8_exact_graphs (trainer.cuda_graphs=on, micro-batches of 9,216 tokens); then the table of every row run on this machine so far
#   user_shape FMT  a user's shape (benchmarks/user_shape.py): the Qwen3-1.7B shape (151,936 vocabulary) made
#             locally, then the shipped recipe, 256 x 1,024 tokens, micro-batch 8, 3 steps, in format FMT (none: GRPO);
#             further arguments: recipe overrides; TAG=_x names the run user_shape_FMT_x; SHAPE=llama3.2-1b another shape
#   user_shape_long  QA-GRPO NVFP4 W4A16 of that model with completions of 16,384 tokens, 8 a step
#   user_shape_longest TOKENS  one qlora step of 2 completions of TOKENS tokens on that model (micro-batch 1,
#             checkpointing): the longest completion that trains
#   user_shape_qad  QAD NVFP4 W4A4 of that model with a bf16 teacher of the same shape, completions of 4,096 tokens
#   families  `qarl parity` bf16 of a real-shape model of each family (benchmarks/user_shape.py; arguments: the shapes,
#             default every dense one and qwen3-moe-2b, which runs NVFP4 W4A16 only)
#   families_grpo  4 steps of GRPO and of QA-GRPO NVFP4 W4A16 (64 x 256 tokens) on a real-shape model of each dense
#             family (arguments: the shapes; default the five of `families`), step time and mismatch from the report
#   moe_tests the GPU tests of MoE refits into vLLM's fused experts under CUDA graphs (tests/integration/test_gpu_moe.py)
#   moe_rollout  rollout tokens/s of the qwen3-moe-2b shape: plain vLLM against qarl's engine, unquantized and W4A16,
#             one engine per process
#   moe_export  one short QA-GRPO NVFP4 W4A16 step of the qwen3-moe-2b shape (32 x 128 tokens), its checkpoint exported
#             (arguments: the targets; default compressed-tensors and ModelOpt NVFP4 W4A16) and loaded by vLLM
#   moe_qlora qlora QA-GRPO NVFP4 W4A16 of a Qwen3-30B-A3B shape (32 of its 48 layers, 128 experts, ~20.5B), its
#             experts packed on the policy, the engine merging the adapters (qlora_adapters=auto; add
#             policy.generation.qlora_adapters=lora for qarl's eager hooks), 2 steps of 32 x 512 tokens
#   qlora     the packed qlora base on the GPU (tests/unit/test_packed.py; test_memory.py: the driver-view peak; the
#             device memory packing leaves cached, benchmarks/gpu_pack_memory.py), qlora adapters through vLLM's LoRA with
#             CUDA graphs (tests/integration/test_gpu_lora.py), the engine serving the base packed with vLLM's FP4 Marlin
#             kernel (tests/integration/test_gpu_packed_base.py), and `qarl parity` bf16 with qlora on the 0.5B model
#   packed_rollout  rollout tokens/s of the user-shape model's NVFP4 W4A16 engine: its base folded in bf16 and packed
#             (4-bit), each without and with qlora adapters (vLLM's LoRA), batches 8, 64, 256, one engine per process
#   profile_exact_rollout  the kernels of the exact forward's W4A4 engine decoding 256 rows of the user_shape model
#             (benchmarks/gpu_profile_rollout.py --exact)
#   profile_user_shape [--compile norms mlp layers scores] [--pack]  the torch profiler over one update micro-batch of
#             the user_shape model (8 x (100 + 1,024) tokens, padded or packed), GRPO: where the train phase's time goes
#   score_kernels  each fp32 function of the linear head's scoring on one chunk of logits (512 x 151,936), eager and
#             compiled, in the default mode and in vLLM's batch-invariant mode (benchmarks/score_kernels.py)
#   head_scoring  LinearHeadScores against the head's chunks through autograd (benchmarks/head_scoring.py), one
#             micro-batch of 8 x (100 + 1,024) tokens of the user_shape model: time and peak memory
#   step_time  the weight cache, held weights and fast inputs against ModelOpt on the GPU (tests), then
#             benchmarks/gpu_step_time.py (interleaved), with the cache and with ModelOpt's own path, and
#             W4A16's scoring pass against its plain-torch floor (benchmarks/gpu_scoring_floor.py)
#   queue 'ENTRY' 'ENTRY'...  the stages of these entries one after another, each "[VAR=value ...] STAGE [ARGS...]"
#             (e.g. 'SHAPE=qwen3-8b TAG=_x user_shape nvfp4_a16 trainer.steps=2'; words split on spaces, no quoting), the
#             time and exit status of each logged; CLEAN=1 in an entry removes the checkpoints written while it ran (the
#             machine's disk is small; later stages that read a run's checkpoints, e.g. export, need them kept); with
#             `background`, one device session's whole plan in one job
#   background STAGE ARGS...  run that stage in a process session of its own, writing to OUT_DIR: on the device tool's
#             machine such a process outlives the call that started it (while the machine is held), for runs longer
#             than one call; `collect OUT_DIR SECONDS` waits that long at most for it to end and shows its log. The
#             machine is held only while calls come: a running background job does not keep it, so call `collect`
#             back to back (e.g. 560 s each) until the job ends
# Needs vLLM, ModelOpt and qarl importable (on this project's GPU machine: source the gpu-kit first).
set -uo pipefail
stage="$1"
out="${2:-${OUT:-benchmarks/results/gpu}}"
mkdir -p "$out"
case "$stage" in
  background)
    setsid nohup bash "$0" "$3" "$out" "${@:4}" > "$out/background.log" 2>&1 < /dev/null &
    echo $! > "$out/background.pid"
    echo "started: bash $0 $3 $out ${*:4} (pid $!, log $out/background.log)"
    exit 0 ;;
  queue)
    mkdir -p runs
    for entry in "${@:3}"; do
      read -ra words <<< "$entry"
      vars=(); clean=0
      while [[ ${words[0]:-} == *=* ]]; do
        if [ "${words[0]}" = CLEAN=1 ]; then clean=1; else vars+=("${words[0]}"); fi
        words=("${words[@]:1}")
      done
      marker="$(mktemp runs/.queue.XXXXXX)"
      echo "== $(date -u +%H:%M:%S) ${entry}"
      env "${vars[@]}" bash "$0" "${words[0]}" "$out" "${words[@]:1}"
      echo "== exit $? (${words[0]})"
      [ "$clean" = 1 ] && find runs -mindepth 2 -maxdepth 2 -name checkpoints -newer "$marker" -exec rm -rf {} +
      rm -f "$marker"
    done
    echo "== $(date -u +%H:%M:%S) queue done"
    exit 0 ;;
  collect)
    pid="$(cat "$out/background.pid")"
    for _ in $(seq "${3:-0}"); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    kill -0 "$pid" 2>/dev/null && echo "still running (pid $pid)" || echo "done"
    grep -v -E 'it/s\]|s/it\]' "$out/background.log" | tail -20
    exit 0 ;;
esac
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
qarl() { python3 -m qarl.cli "$@"; }
keep() { # keep a run's metrics and plot
  local run="$1" name="$2"
  cp "$run/metrics.jsonl" "$out/$name.metrics.jsonl" 2>/dev/null
  cp "$run/metrics.png" "$out/$name.png" 2>/dev/null
}
show_parity() { # one line per format of a `qarl parity --json` file
  python3 -c "
import json, sys
for name, r in json.load(open(sys.argv[1])).items():
    s, u, f = r['synced'], r['unsynced'], r['unquantized']
    print(name, 'synced', s['mean_abs'], s['max_abs'], s['flipped_tokens'], '/', s['tokens'], 'unsynced', u['mean_abs'],
          'floor', f['mean_abs'], f['max_abs'], f['flipped_tokens'])" "$1"
}
show_steps() { # medians from a run's third step on (the first steps warm up allocators)
  python3 -c "
import json, statistics as st, sys
rows = [json.loads(l) for l in open(sys.argv[1] + '/metrics.jsonl') if 'perf/step_s' in l][2:]
print(sys.argv[2], {k: round(st.median(r[k] for r in rows), 4) for k in
      ('perf/step_s', 'perf/rollout_s', 'perf/train_s', 'perf/sleep_wake_s', 'perf/refit_s', 'perf/rollout_tokens_per_s',
       'mismatch/kl', 'perf/refit_bytes', 'perf/refit_shared_bytes', 'perf/gpu_mem_after_rollout_gib',
       'perf/gpu_mem_after_update_gib', 'perf/torch_peak_rollout_gib', 'perf/torch_peak_update_gib')
      if all(k in r for r in rows)})" "$1" "$2"
}
timed_steps() { # NAME LABEL OVERRIDES...: 10 QA-GRPO steps of the 0.5B recipe after the warm start, kept and shown
  local name="$1" label="$2"; shift 2
  qarl train recipes/qa_grpo_0p5b_gpu.yaml "$@" "run.dir=runs/$name" trainer.steps=10 eval.every=100 \
    checkpoint.every=100 "warm_start.steps=${WARM_START_STEPS:-80}" 2>&1 | grep -v -i "warn\|it/s\]" | tail -2
  keep "runs/$name" "$name"
  show_steps "runs/$name" "$label"
}
logged() { # NAME COMMAND...: run a command, its whole output kept in OUT/NAME.log, its exit status and the lines
  # that tell why it failed shown (a traceback's last line is not always among a log's last lines)
  local name="$1"; shift
  "$@" > "$out/$name.log" 2>&1
  local status=$?
  echo "exit $status ($name)"; grep -E "memory plan|Error|error:|out of memory" "$out/$name.log" | tail -5
  return $status
}
served_export() { # RUN TARGET NAME: the run's checkpoint exported to export/TARGET.yaml in exports/NAME, verified and
  # served by vLLM: its report in OUT/NAME.json, its log in OUT/NAME.log; returns qarl export's exit status
  qarl export "$1" --target "export/$2.yaml" --out "exports/$3" --overwrite --then-verify --vllm \
    > "$out/$3.json" 2> "$out/$3.log"
}
user_run() { # COMMAND RECIPE NAME OVERRIDES...: a run on the user-shape model, its log and metrics kept, its report;
  # RUN_LIMIT=SECONDS stops the run after that long and keeps what it wrote (a call's time limit would keep nothing)
  local command="$1" recipe="$2" name="$3"; shift 3
  logged "$name" timeout "${RUN_LIMIT:-0}" python3 -m qarl.cli "$command" "$recipe" "policy.model_name=$shape_dir" \
    "run.dir=runs/$name" "$@"
  keep "runs/$name" "$name"
  python3 benchmarks/user_shape.py report "runs/$name" | tee "$out/$name.txt"
}
shape="${SHAPE:-qwen3-1.7b}"  # the user_shape stage's model (benchmarks/user_shape.py SHAPES)
shape_dir="runs/$(echo "$shape" | tr .- p_)_shape"
case "$stage" in
  kernels)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/device.txt"
    python3 benchmarks/fake_quant_gpu_check.py --out "$out/fake_quant_gpu_check.md" 2>&1 | tail -40
    # the GPU tests without an engine (those with one: the graphs and exact_tests stages)
    python3 -m pytest -q -p no:cacheprovider -m gpu tests/integration/test_gpu_kernels.py tests/unit/test_nvfp4_cpu.py \
      2>&1 | tail -15
    # the weight cache against ModelOpt's uncached path, and the quantized policy, on the GPU's kernels
    # (the GPU kit carries no `datasets`: the calibration-file test needs it)
    python3 -m pytest -q -p no:cacheprovider tests/unit/test_weight_cache.py tests/unit/test_quantize.py \
      --deselect tests/unit/test_quantize.py::test_missing_calibration_data_is_an_error_before_loading_the_model 2>&1 | tail -5
    python3 benchmarks/gpu_step_time.py --out "$out/gpu_step_time.md" 2>&1 | grep -v -i warn | tail -12
    python3 benchmarks/gpu_step_time.py --no-cache --out "$out/gpu_step_time_nocache.md" 2>&1 | grep -v -i warn | tail -12
    python3 benchmarks/gpu_scoring_floor.py --out "$out/gpu_scoring_floor.md" 2>&1 | grep -v -i warn | tail -8
    ;;
  parity)
    for dtype in bfloat16 float16 float32; do
      qarl parity recipes/parity_0p5b_gpu.yaml "policy.dtype=$dtype" --json > "$out/parity_$dtype.json" 2> "$out/parity_$dtype.log"
      echo "== $dtype"; tail -3 "$out/parity_$dtype.log"; show_parity "$out/parity_$dtype.json"
    done
    ;;
  grpo)
    mkdir -p runs
    python3 benchmarks/warm_start_sweep.py recipes/qa_grpo_0p5b_gpu.yaml --steps 40 60 80 2>&1 \
      | grep -v -i "warn\|it/s\]" | tee "$out/warm_start_sweep.md" | tail -7
    grep -o "steps=[0-9]*" "$out/warm_start_sweep.md" | tail -1 | cut -d= -f2 > runs/warm_start_steps
    qarl train recipes/qa_grpo_0p5b_gpu.yaml "warm_start.steps=$(cat runs/warm_start_steps)" 2>&1 \
      | grep -v -i "warn\|it/s\]" | tail -12
    keep runs/qa_grpo_0p5b qa_grpo_0p5b_bf16
    ;;
  memory)
    # colocated (the engine sleeps during updates) vs awake: device memory at the end of each phase
    for sleep in on off; do
      qarl train recipes/qa_grpo_0p5b_gpu.yaml "run.dir=runs/sleep_$sleep" trainer.steps=8 eval.every=100 \
        "policy.generation.sleep_between_rollouts=$sleep" 2>&1 | tail -2
      keep "runs/sleep_$sleep" "memory_sleep_$sleep"
      python3 -c "
import json, statistics as st
rows = [json.loads(l) for l in open('runs/sleep_$sleep/metrics.jsonl') if 'perf/step_s' in l][1:]
med = lambda k: st.median(r[k] for r in rows)
print('sleep=$sleep', {k: round(med(k), 2) for k in ('perf/gpu_mem_after_rollout_gib', 'perf/gpu_mem_after_update_gib',
      'perf/torch_peak_rollout_gib', 'perf/torch_peak_update_gib', 'perf/step_s', 'perf/rollout_s', 'perf/train_s')})"
    done
    ;;
  fp16)
    qarl train recipes/qa_grpo_0p5b_gpu.yaml policy.dtype=float16 run.dir=runs/qa_grpo_0p5b_fp16 \
      "warm_start.steps=$(cat runs/warm_start_steps)" 2>&1 \
      | grep -v -i "warn\|it/s\]" | tail -8
    keep runs/qa_grpo_0p5b_fp16 qa_grpo_0p5b_fp16
    ;;
  qad)
    qarl distill recipes/qa_distillation_0p5b_gpu.yaml "warm_start.steps=$(cat runs/warm_start_steps)" 2>&1 \
      | grep -v -i "warn\|it/s\]" | tail -10
    keep runs/qa_distillation_0p5b qad_0p5b
    ;;
  export)
    for target in nvfp4_w4a16_modelopt nvfp4_w4a16_compressed_tensors; do
      served_export runs/qa_grpo_0p5b "$target" "export_$target"
      echo "== $target"; tail -25 "$out/export_$target.json"
    done
    ;;
  fp8)
    # a short FP8 W8A8 QA-GRPO run of the warm-started 0.5B model, exported (ModelOpt FP8, compressed-tensors
    # FP8) and loaded by vLLM; the warm start is the one the grpo stage chose (80 steps on an H100)
    qarl train recipes/qa_grpo_0p5b_gpu.yaml policy.quant_cfg=fp8_w8a8 run.dir=runs/qa_grpo_0p5b_fp8 \
      trainer.steps=10 eval.every=10 "warm_start.steps=${WARM_START_STEPS:-80}" 2>&1 | grep -v -i "warn\|it/s\]" | tail -4
    for target in fp8_w8a8_modelopt fp8_w8a8_compressed_tensors; do
      served_export runs/qa_grpo_0p5b_fp8 "$target" "export_$target"
      echo "== $target"; grep -A4 '"vllm"\|qarl-decode' "$out/export_$target.json" | head -20
    done
    ;;
  graphs)  # argument (optional): a pytest -k expression picking some of the tests
    python3 -m pytest -q -p no:cacheprovider tests/integration/test_gpu_graphs.py tests/unit/test_engine_quant.py \
      tests/integration/test_gpu_colocation.py ${3:+-k "$3"} 2>&1 | tail -6
    ;;
  rollout)
    python3 benchmarks/gpu_rollout.py --repeats 3 --out "$out/gpu_rollout_interleaved.md" 2>&1 | grep -v -i "warn\|it/s\]" | tail -10
    ;;
  rollout_user_shape)  # issue 59 item 4: qarl's engine against plain vLLM at the user shape (256 x 1,024 tokens, the
    # sampled tokens' log-probs and a seed per sample on both), GRPO and W4A16 interleaved in one process; the exact
    # forward's W4A4 engine in a process of its own (batch-invariant mode is process-wide)
    python3 benchmarks/user_shape.py make "$shape_dir" --shape "$shape" 2>&1 | tail -1
    python3 benchmarks/gpu_rollout.py --model "$shape_dir" --batches 256 --tokens 1024 --repeats 2 --memory 0.25 \
      --formats none nvfp4_a16 --out "$out/rollout_user_shape.md" 2>&1 | grep -v -i "warn\|it/s\]" | tail -7
    python3 benchmarks/gpu_rollout.py --model "$shape_dir" --batches 256 --tokens 1024 --repeats 2 --memory 0.25 \
      --no-plain --formats nvfp4_w4a4 --exact --out "$out/rollout_user_shape_exact.md" 2>&1 | grep -v -i "warn\|it/s\]" | tail -4
    ;;
  kv_cache_user_shape)  # issue 73 item 5: the FP8 KV cache at the user shape, 256 tokens decoded after prompts that
    # fill 16k, 4k and 1k-token contexts (arguments: some of 16384 4096 1024; 16k first, the issue's bar; four engines
    # a context): each engine's cache in tokens and sequences, tokens/s, bf16 cache against FP8, plain vLLM beside
    # qarl's engine (each a fifth of the GPU)
    declare -A batches=([16384]=16 [4096]=64 [1024]=256)  # the batch timed at each context length (more than
    # either cache holds at 16k: ~5 and ~10 sequences in a fifth of an H100)
    lengths=("${@:3}"); [ "${#lengths[@]}" = 0 ] && lengths=(16384 4096 1024)
    for length in "${lengths[@]}"; do
      [ -n "${batches[$length]:-}" ] \
        || { echo "kv_cache_user_shape: contexts are 16384, 4096 or 1024 tokens (got $length)" >&2; exit 2; }
    done
    python3 benchmarks/user_shape.py make "$shape_dir" --shape "$shape" 2>&1 | tail -1
    for length in "${lengths[@]}"; do
      logged "kv_cache_user_shape_$length" python3 benchmarks/gpu_rollout.py --model "$shape_dir" \
        --prompt-tokens $((length - 256)) --tokens 256 --batches ${batches[$length]} --repeats 2 --memory 0.2 \
        --plain-kv-cache fp8 --formats nvfp4_a16 nvfp4_a16_kv_fp8 --out "$out/kv_cache_user_shape_$length.md" \
        && cat "$out/kv_cache_user_shape_$length.md"
    done
    ;;
  update_profile)  # issue 74: host against GPU time of a graphed and an eager update at the user shape
    python3 benchmarks/user_shape.py make "$shape_dir" --shape "$shape" 2>&1 | tail -1
    formats=("${@:3}"); [ "${#formats[@]}" = 0 ] && formats=(nvfp4_a16 nvfp4_w4a4_exact)
    for fmt in "${formats[@]}"; do
      quant="quant_configs/${fmt%_exact}.yaml"; [ "$fmt" = none ] && quant=none
      exact=(); [ "$fmt" != "${fmt%_exact}" ] && exact=(--exact)
      python3 benchmarks/update_profile.py --model "$shape_dir" --format "$quant" "${exact[@]}" \
        --out "$out/update_profile_$fmt.md" 2>&1 | grep -v -i "warn\|it/s\]" | tail -4
    done
    ;;
  parity_graphs)
    for eager in false true; do
      qarl parity recipes/parity_0p5b_gpu.yaml policy.dtype=bfloat16 "policy.generation.enforce_eager=$eager" --json \
        > "$out/parity_graphs_eager_$eager.json" 2> "$out/parity_graphs_eager_$eager.log"
      echo "== enforce_eager=$eager"; tail -2 "$out/parity_graphs_eager_$eager.log"
      show_parity "$out/parity_graphs_eager_$eager.json"
    done
    ;;
  exact)
    python3 -m pytest -q -p no:cacheprovider -x tests/integration/test_gpu_exact.py -k kernels 2>&1 | grep -E "^E |assert|passed|failed" | head -30
    runs=("${@:3}")  # DTYPE:EAGER pairs
    [ ${#runs[@]} -gt 0 ] || runs=(bfloat16:true bfloat16:false float16:true float16:false)
    for run in "${runs[@]}"; do
      dtype="${run%:*}"; eager="${run#*:}"
      name="parity_exact_${dtype}_eager_$eager"
      qarl parity recipes/parity_0p5b_gpu.yaml policy.exact_forward=true "policy.dtype=$dtype" \
        "policy.generation.enforce_eager=$eager" --json > "$out/$name.json" 2> "$out/$name.log"
      echo "== exact forward, $dtype, enforce_eager=$eager"; tail -3 "$out/$name.log"; show_parity "$out/$name.json"
    done
    ;;
  exact_matmul)
    python3 benchmarks/exact_matmul.py --out "$out/exact_matmul.md" 2>&1 | grep -v -i warn | tail -20
    ;;
  exact_cost)
    if [ "${3:-}" = user_shape ]; then  # one micro-batch of the shipped Qwen3-1.7B recipe: 8 x (100 + 1,024) tokens
      python3 benchmarks/user_shape.py make "$shape_dir" --shape "$shape" 2>&1 | tail -1
      fmt="${4:-quant_configs/nvfp4_w4a4.yaml}"
      python3 benchmarks/exact_step_time.py --model "$shape_dir" --format "$fmt" --completions 8 --prompt-tokens 100 \
        --completion-tokens 1024 --repeats 3 --profile "$out/user_shape${4:+_$(basename "$fmt" .yaml)}" 2>&1 \
        | grep -v -i warn | tail -3
      exit 0
    fi
    python3 benchmarks/exact_step_time.py --profile "$out" 2>&1 | grep -v -i warn | tail -3
    # a micro-batch of the QA-GRPO recipe's shape: 128 completions of ~20 + 6 tokens (host-bound)
    python3 benchmarks/exact_step_time.py --completions 128 --prompt-tokens 20 --completion-tokens 6 \
      --profile "$out/short" 2>&1 | grep -v -i warn | tail -3
    ;;
  pytest)  # arguments: pytest's (test files, -k ...); -rP: what passing tests print (their measured figures) in the log
    python3 -m pytest -q -rP -p no:cacheprovider "${@:3}" 2>&1 | tee -a "$out/pytest.log" | grep -E "^E |passed|failed|error" \
      | tail -12  # the whole output in OUT/pytest.log
    ;;
  host_waits_ab)  # issue 74: one user-shape micro-batch's forward + backward (exact_step_time.py: the exact forward and
    # the default path), with the qarl package of an earlier commit against this checkout's, one after the other:
    # $3 a folder holding that package (made where git is: `git archive fe7a25c qarl | tar -x -C .ab/fe7a25c`, carried)
    [ -d "${3:-}/qarl" ] \
      || { echo "host_waits_ab OUT DIR: DIR must hold an earlier qarl package (DIR/qarl; got '${3:-}')" >&2; exit 2; }
    python3 benchmarks/user_shape.py make "$shape_dir" --shape "$shape" 2>&1 | tail -1
    for side in "$3" .; do
      echo "== qarl from $side"
      PYTHONPATH="$(realpath "$side"):$PYTHONPATH" python3 benchmarks/exact_step_time.py --model "$shape_dir" \
        --completions 8 --prompt-tokens 100 --completion-tokens 1024 --repeats 5 2>&1 | grep -v -i warn | tail -3
    done
    ;;
  exact_tests)
    python3 -m pytest -q -p no:cacheprovider tests/integration/test_gpu_exact.py 2>&1 | tail -30
    ;;
  graph_probe)
    python3 benchmarks/user_shape.py make "$shape_dir" --shape "$shape" 2>&1 | tail -1
    python3 benchmarks/graph_probe.py --model "$shape_dir" --exact --out "$out/graph_probe_w4a4_exact.json" 2>&1 \
      | grep -v -i "warn\|it/s\]" | tail -25
    python3 benchmarks/graph_probe.py --model "$shape_dir" --format quant_configs/nvfp4_a16.yaml \
      --out "$out/graph_probe_w4a16_default.json" 2>&1 | grep -v -i "warn\|it/s\]" | tail -25
    ;;
  kv_cache_exact)
    python3 -m pytest -q -s -p no:cacheprovider tests/integration/test_gpu_kv_cache.py \
      tests/integration/test_gpu_exact.py \
      -k "kv_cache or fp8 or gradient_reference" 2>&1 | grep -E "FP8|bf16 cache|kv_fp8|^E |passed|failed" | head -40
    kv_formats="[quant_configs/nvfp4_a16_kv_fp8.yaml,quant_configs/fp8_w8a8_kv_fp8.yaml]"
    for exact in true false; do
      name="parity_kv_cache_exact_$exact"
      qarl parity recipes/parity_0p5b_gpu.yaml policy.dtype=bfloat16 "policy.exact_forward=$exact" \
        "policy.generation.allow_quant_mismatch=$([ $exact = true ] && echo false || echo true)" \
        "parity.formats=$kv_formats" --json > "$out/$name.json" 2> "$out/$name.log"
      echo "== FP8 KV cache, exact forward $exact"; tail -3 "$out/$name.log"; show_parity "$out/$name.json"
    done
    ;;
  kv_cache_export)  # issue 73 item 3: the exact_grpo runs' checkpoints with and without the FP8 KV cache (run those
    # first: exact_grpo OUT nvfp4_a16_kv_fp8 true, exact_grpo OUT nvfp4_a16 true), exported to ModelOpt and
    # compressed-tensors NVFP4 W4A16 and served by vLLM (with its FP8 cache where the export carries KV scales):
    # the scales on disk against the policy's, vLLM's log-probs against the policy's
    for run in nvfp4_a16_kv_fp8 nvfp4_a16; do
      [ -d "runs/qa_grpo_0p5b_${run}_exact_true/checkpoints" ] \
        || { echo "== no run qa_grpo_0p5b_${run}_exact_true"; continue; }
      for target in nvfp4_w4a16_modelopt nvfp4_w4a16_compressed_tensors; do
        name="export_${run}_$target"
        served_export "runs/qa_grpo_0p5b_${run}_exact_true" "$target" "$name"
        echo "== $name exit $?"
        python3 -c "import json, sys; v = json.load(open(sys.argv[1]))['verify']; print('kv_cache', v.get('kv_cache'), \
          'vllm', v['loaders'].get('vllm'))" "$out/$name.json"
        rm -rf "exports/$name"
      done
    done
    ;;
  megatron)
    gpus=$(nvidia-smi -L | wc -l)
    torchrun --standalone --nproc_per_node "$gpus" benchmarks/megatron_parity.py --model embedded:0.5b \
      --out "$out/megatron_parity_tp$gpus.md" 2>&1 | grep -v -i "warn\|deprecated" | tail -14
    ;;
  megatron_grpo)
    qarl train recipes/qa_grpo_0p5b_gpu.yaml policy.backend=megatron run.dir=runs/megatron_grpo_0p5b \
      checkpoint.every=1000 2>&1 | grep -v -i "warn\|it/s\]" | tail -5
    keep runs/megatron_grpo_0p5b megatron_qa_grpo_0p5b_bf16
    ;;
  megatron_resume)  # SIGKILL after a checkpoint, resume, compare: at TP = every GPU of the machine
    gpus=$(nvidia-smi -L | wc -l)
    python3 benchmarks/resume_check.py --nproc "$gpus" recipes/qa_grpo_0p5b_gpu.yaml policy.backend=megatron \
      "policy.tensor_parallel_size=$gpus" trainer.steps=12 checkpoint.every=6 eval.every=6 --kill-at 6 \
      --runs runs/megatron_resume --out "$out/resume_megatron_0p5b_tp$gpus.md" 2>&1 | grep -v -i "warn\|it/s\]" | tail -8
    ;;
  megatron_user_shape)  # QA-GRPO NVFP4 W4A16 of shape $3 (default qwen3-8b) on the Megatron backend over every GPU:
    # TP=$4 (default: all of them), the other processes data parallel; the user-shape recipe (256 x 1,024 tokens)
    gpus=$(nvidia-smi -L | wc -l); name="${3:-qwen3-8b}"; tp="${4:-$gpus}"; shift 4 2>/dev/null || shift $#
    shape_dir="runs/$(echo "$name" | tr .- p_)_shape"
    python3 benchmarks/user_shape.py make "$shape_dir" --shape "$name" 2>&1 | tail -1
    run="megatron_$(echo "$name" | tr .- p_)_tp${tp}_dp$((gpus / tp))"
    torchrun --standalone --nproc_per_node "$gpus" -m qarl train benchmarks/recipes/user_shape_grpo.yaml \
      "policy.model_name=$shape_dir" "run.dir=runs/$run" policy.backend=megatron "policy.tensor_parallel_size=$tp" \
      "$@" > "$out/$run.log" 2>&1
    echo "exit $? ($run)"; grep -E "memory plan|world:|Error|error:|out of memory" "$out/$run.log" | tail -6
    keep "runs/$run" "$run"
    python3 benchmarks/user_shape.py report "runs/$run" | tee "$out/$run.txt"
    ;;
  megatron_qad)
    qarl distill recipes/qa_distillation_0p5b_gpu.yaml policy.backend=megatron warm_start.steps=80 \
      run.dir=runs/megatron_qad_0p5b 2>&1 | grep -v -i "warn\|it/s\]" | tail -8
    keep runs/megatron_qad_0p5b megatron_qad_0p5b
    ;;
  e2e)
    for run in "none auto" "nvfp4_a16 auto" "nvfp4_a16 true"; do
      set -- $run
      timed_steps "e2e_$1_eager_$2" "$1 enforce_eager=$2" "policy.quant_cfg=$1" "policy.generation.enforce_eager=$2"
    done
    ;;
  share)
    # one copy of the rollout weights (policy.generation.share_weights) on and off, CUDA graphs, per format in $3
    # (default "none nvfp4_a16"): step time, refit, sleep/wake and device memory
    for fmt in ${3:-none nvfp4_a16}; do
      for share in true false; do
        timed_steps "share_${fmt}_$share" "$fmt share_weights=$share" "policy.quant_cfg=$fmt" \
          "policy.generation.share_weights=$share"
      done
    done
    ;;
  exact_grpo)
    # one QA-GRPO run of the 0.5B model (STEPS, default 100, after the warm start), format $3 (a quant_configs/ name),
    # policy.exact_forward=$4: bash benchmarks/gpu_runs.sh exact_grpo OUT nvfp4_w4a4 true
    # SEED (default 0) seeds the run (prompt order, sampling); the problems and the warm start stay seed 0's, so every seed
    # starts from one model on one task
    name="qa_grpo_0p5b_$3_exact_$4${SEED:+_seed$SEED}"
    qarl train recipes/qa_grpo_0p5b_gpu.yaml "policy.quant_cfg=quant_configs/$3.yaml" "policy.exact_forward=$4" \
      "run.dir=runs/$name" checkpoint.every=1000 "warm_start.steps=${WARM_START_STEPS:-80}" "trainer.steps=${STEPS:-100}" \
      "run.seed=${SEED:-0}" warm_start.seed=0 task.seed=0 ${EXTRA:-} 2>&1 | grep -v -i "warn\|it/s\]" | tail -3
    keep "runs/$name" "$name"
    show_steps "runs/$name" "$3 exact_forward=$4"
    ;;
  profile)
    python3 benchmarks/gpu_profile_update.py --score --formats none nvfp4_w4a4 fp8_w8a8 > "$out/profile_score.txt" 2>&1
    grep "scoring pass" "$out/profile_score.txt"
    python3 benchmarks/gpu_profile_rollout.py --batch 512 > "$out/profile_rollout.txt" 2>&1
    grep "^== " "$out/profile_rollout.txt"
    ;;
  profile_exact_rollout)  # the exact forward's W4A4 engine at the user shape, 256 rows decoding: its kernels per step
    # (which matmul runs in a decode step, and for how long, inside the engine's CUDA graphs)
    python3 benchmarks/user_shape.py make "$shape_dir" --shape "$shape" 2>&1 | tail -1
    python3 benchmarks/gpu_profile_rollout.py --model "$shape_dir" --format nvfp4_w4a4 --exact --batch 256 \
      --tokens 128 --kernels 25 > "$out/profile_exact_rollout.txt" 2>&1
    grep "^== " "$out/profile_exact_rollout.txt"
    ;;
  profile_user_shape)  # arguments: --compile norms mlp layers scores (some, or nothing), --pack: one micro-batch profiled
    python3 benchmarks/user_shape.py make "$shape_dir" --shape "$shape" 2>&1 | tail -1
    python3 benchmarks/gpu_profile_update.py --model "$shape_dir" --formats none --rows 8 --prompt-tokens 100 \
      --completion-tokens 1024 "${@:3}" > "$out/profile_update_${shape}${TAG:-}.txt" 2>&1
    grep -E "one update|allocated after" "$out/profile_update_${shape}${TAG:-}.txt"
    ;;
  score_kernels)  # a process per mode: vLLM's batch-invariant mode is process-wide
    python3 benchmarks/score_kernels.py --out "$out/score_kernels.md" 2>&1 | grep -v -i warn | tail -10
    python3 benchmarks/score_kernels.py --batch-invariant --out "$out/score_kernels_invariant.md" 2>&1 \
      | grep -v -i warn | tail -10
    ;;
  head_scoring)  # the linear head's scoring against autograd's chunks, one micro-batch of the user_shape model
    python3 benchmarks/user_shape.py make "$shape_dir" --shape "$shape" 2>&1 | tail -1
    python3 benchmarks/head_scoring.py --model "$shape_dir" --rows 8 --prompt-tokens 100 --completion-tokens 1024 \
      2>&1 | grep -v -i warn | tail -5 | tee "$out/head_scoring_${shape}.txt"
    ;;
  step_time)
    python3 -m pytest -q -p no:cacheprovider tests/unit/test_weight_cache.py tests/unit/test_engine_quant.py 2>&1 | tail -3
    python3 benchmarks/gpu_step_time.py --out "$out/gpu_step_time_shared_inputs.md" 2>&1 | grep -v -i warn | tail -8
    python3 benchmarks/gpu_step_time.py --no-cache --out "$out/gpu_step_time_held_nocache.md" 2>&1 | grep -v -i warn | tail -8
    ;;
  fast_settings)  # what `auto` decides per kind of run on a GPU (each run's start-up line), two steps each, and the
    # fast settings' tests
    python3 -m pytest -q -p no:cacheprovider tests/unit/test_fast_settings.py 2>&1 | tail -2
    # each kind of run on the embedded models, 2 steps with what auto picks (tests/integration/test_gpu_fast_settings.py;
    # six runs, ~1 min each: in a background queue, or some per call with a -k expression as argument)
    python3 -m pytest -q -p no:cacheprovider tests/integration/test_gpu_fast_settings.py ${3:+-k "$3"} 2>&1 | \
      grep -E "^E |passed|failed|error" | tail -12
    ;;
  fast_table)
    python3 benchmarks/user_shape.py make "$shape_dir" --shape "$shape" 2>&1 | tail -1
    eager=(policy.compile_layers=off policy.compile_scores=off trainer.max_tokens_per_micro_batch=0
           trainer.cuda_graphs=off)
    all=(grpo_eager w4a16_eager grpo_auto w4a16_auto grpo_graphs w4a16_graphs w4a4_exact w4a4_exact_graphs fp8_exact
         fp8_exact_graphs)
    rows=("${@:3}"); [ "${#rows[@]}" = 0 ] && rows=("${all[@]}")
    for row in "${rows[@]}"; do
      case "$row" in
        grpo_eager) settings=(policy.quant_cfg=none "${eager[@]}") ;;
        w4a16_eager) settings=(policy.quant_cfg=quant_configs/nvfp4_a16.yaml "${eager[@]}") ;;
        grpo_auto) settings=(policy.quant_cfg=none) ;;
        w4a16_auto) settings=(policy.quant_cfg=quant_configs/nvfp4_a16.yaml) ;;
        grpo_graphs) settings=(policy.quant_cfg=none trainer.cuda_graphs=on) ;;
        w4a16_graphs) settings=(policy.quant_cfg=quant_configs/nvfp4_a16.yaml trainer.cuda_graphs=on) ;;
        w4a4_exact) settings=(policy.quant_cfg=quant_configs/nvfp4_w4a4.yaml policy.exact_forward=true) ;;
        w4a4_exact_graphs) settings=(policy.quant_cfg=quant_configs/nvfp4_w4a4.yaml policy.exact_forward=true
                                     trainer.cuda_graphs=on trainer.max_tokens_per_micro_batch=9216) ;;
        fp8_exact) settings=(policy.quant_cfg=quant_configs/fp8_w8a8.yaml policy.exact_forward=true) ;;
        fp8_exact_graphs) settings=(policy.quant_cfg=quant_configs/fp8_w8a8.yaml policy.exact_forward=true
                                    trainer.cuda_graphs=on trainer.max_tokens_per_micro_batch=9216) ;;
        *) echo "fast_table: unknown row $row" >&2; exit 2 ;;
      esac
      user_run train benchmarks/recipes/user_shape_grpo.yaml "fast_table_$row" "${settings[@]}" run.overwrite=true
      grep -h "fast settings" "$out/fast_table_$row.log"
      rm -rf "runs/fast_table_$row/checkpoints"  # the table reads metrics only; four rows' checkpoints fill the disk
    done
    ran=(); for row in "${all[@]}"; do [ -d "runs/fast_table_$row" ] && ran+=("runs/fast_table_$row"); done
    python3 benchmarks/user_shape.py table "${ran[@]}" | tee "$out/fast_table.md"
    ;;
  user_shape)  # argument: the format (none | nvfp4_a16 | ...); further arguments: recipe overrides
    fmt="${3:-nvfp4_a16}"; shift 3 2>/dev/null || shift $#
    python3 benchmarks/user_shape.py make "$shape_dir" --shape "$shape"
    quant="quant_configs/$fmt.yaml"; [ "$fmt" = none ] && quant=none
    user_run train benchmarks/recipes/user_shape_grpo.yaml "user_shape_$fmt${TAG:-}" "policy.quant_cfg=$quant" "$@"
    ;;
  user_shape_long)  # QA-GRPO NVFP4 W4A16, completions of 16,384 tokens; arguments: recipe overrides
    shift 2
    python3 benchmarks/user_shape.py make "$shape_dir" --shape "$shape"
    user_run train benchmarks/recipes/user_shape_grpo.yaml user_shape_long_16k policy.generation.max_new_tokens=16384 \
      policy.generation.max_model_len=16500 policy.generation.gpu_memory_utilization=0.45 trainer.batch_size=8 \
      trainer.steps=2 eval.every=0 "$@"
    ;;
  user_shape_longest)  # one step of 2 completions of $3 tokens, qlora NVFP4 W4A16, checkpointing, micro-batch 1 (the
    # longest completion that trains: SHAPE=qwen3-8b-128k for more than 40,960 positions); further arguments: overrides
    tokens="$3"; shift 3
    python3 benchmarks/user_shape.py make "$shape_dir" --shape "$shape"
    user_run train benchmarks/recipes/user_shape_grpo.yaml "user_shape_longest_$tokens" policy.lora.mode=qlora \
      policy.quant_cfg=quant_configs/nvfp4_a16.yaml "policy.generation.max_new_tokens=$tokens" \
      "policy.generation.max_model_len=$((tokens + 200))" trainer.batch_size=2 trainer.num_generations=2 \
      trainer.micro_batch_size=1 trainer.steps=1 policy.gradient_checkpointing=on eval.every=0 "$@"
    ;;
  user_shape_qad)  # QAD NVFP4 W4A4 with a bf16 teacher of the same shape, 4,096-token completions
    shift 2
    python3 benchmarks/user_shape.py make "$shape_dir" --shape "$shape"
    user_run distill benchmarks/recipes/user_shape_qad.yaml user_shape_qad_4k "teacher.model_name=$shape_dir" \
      policy.generation.max_new_tokens=4096 policy.generation.max_model_len=4200 "$@"
    ;;
  families)
    shapes="${*:3}"; [ -n "$shapes" ] || shapes="qwen3-1.7b llama3.2-1b mistral-7b-8l gemma3-1b phi3-mini-8l qwen3-moe-2b"
    for name in $shapes; do
      dir="runs/$(echo "$name" | tr .- p_)_shape"
      python3 benchmarks/user_shape.py make "$dir" --shape "$name" 2>&1 | tail -1
      formats=(); [[ $name == *moe* ]] && formats=("parity.formats=[quant_configs/nvfp4_a16.yaml]")
      qarl parity recipes/parity_0p5b_gpu.yaml "policy.model_name=$dir" policy.dtype=bfloat16 "${formats[@]}" --json \
        > "$out/parity_$name.json" 2> "$out/parity_$name.log"
      echo "== $name (exit $?)"; grep -E "Error|error:" "$out/parity_$name.log" | tail -3; show_parity "$out/parity_$name.json"
    done
    ;;
  families_grpo)  # a few QA-GRPO W4A16 steps against GRPO per real-shape dense family; arguments: the shapes
    shapes="${*:3}"; [ -n "$shapes" ] || shapes="qwen3-1.7b llama3.2-1b mistral-7b-8l gemma3-1b phi3-mini-8l"
    for name in $shapes; do
      shape_dir="runs/$(echo "$name" | tr .- p_)_shape"
      python3 benchmarks/user_shape.py make "$shape_dir" --shape "$name" 2>&1 | tail -1
      for fmt in none nvfp4_a16; do
        quant="quant_configs/$fmt.yaml"; [ "$fmt" = none ] && quant=none
        user_run train benchmarks/recipes/user_shape_grpo.yaml "family_${name}_$fmt" "policy.quant_cfg=$quant" \
          trainer.batch_size=64 policy.generation.max_new_tokens=256 trainer.steps=4
      done
      rm -rf "runs/family_${name}_none" "runs/family_${name}_nvfp4_a16"
    done
    ;;
  moe_tests)
    python3 -m pytest -q -p no:cacheprovider tests/integration/test_gpu_moe.py 2>&1 | tail -15
    ;;
  moe_rollout)
    python3 benchmarks/user_shape.py make runs/qwen3_moe_2b_shape --shape qwen3-moe-2b 2>&1 | tail -1
    for engine in plain none nvfp4_a16; do  # one engine per process: two MoE engines in one process break graphs
      picked=(--no-plain --formats "$engine"); [ "$engine" = plain ] && picked=(--formats)
      python3 benchmarks/gpu_rollout.py --model runs/qwen3_moe_2b_shape "${picked[@]}" --batches 64 256 --repeats 2 \
        --memory 0.5 --out "$out/gpu_rollout_qwen3_moe_2b_$engine.md" 2>&1 | grep -v -i "warn\|it/s\]" | tail -3
    done
    ;;
  moe_export)
    python3 benchmarks/user_shape.py make runs/qwen3_moe_2b_shape --shape qwen3-moe-2b 2>&1 | tail -1
    qarl train benchmarks/recipes/user_shape_grpo.yaml policy.model_name=runs/qwen3_moe_2b_shape \
      policy.quant_cfg=quant_configs/nvfp4_a16.yaml run.dir=runs/moe_export_run trainer.steps=1 trainer.batch_size=32 \
      policy.generation.max_new_tokens=128 checkpoint.every=1 > "$out/moe_export_run.log" 2>&1
    echo "train exit $?"; grep -E "Error|error:" "$out/moe_export_run.log" | tail -3
    targets="${*:3}"; [ -n "$targets" ] || targets="nvfp4_w4a16_compressed_tensors nvfp4_w4a16_modelopt"
    for target in $targets; do
      served_export runs/moe_export_run "$target" "export_moe_$target"
      echo "== $target (exit $?)"; grep -E "Error|error:" "$out/export_moe_$target.log" | tail -3
      tail -25 "$out/export_moe_$target.json"
    done
    ;;
  packed_rollout)  # rollout tokens/s of NVFP4 W4A16 engines of the user-shape model: folded / packed base, +- qlora
    python3 benchmarks/user_shape.py make "$shape_dir" --shape "$shape" 2>&1 | tail -1
    for engine in folded qlora packed packed_qlora; do  # one engine per process
      case "$engine" in folded) options=() ;; qlora) options=(--qlora) ;; packed) options=(--qlora --packed-base --no-adapters) ;;
        packed_qlora) options=(--qlora --packed-base) ;; esac
      python3 benchmarks/gpu_rollout.py --model "$shape_dir" --no-plain --formats nvfp4_a16 "${options[@]}" \
        --batches 8 64 256 --repeats 2 --memory 0.5 --out "$out/gpu_rollout_${shape}_$engine.md" 2>&1 \
        | grep -v -i "warn\|it/s\]" | tail -3
    done
    ;;
  moe_qlora)  # qlora QA-GRPO NVFP4 W4A16 of a Qwen3-30B-A3B shape (32 of 48 layers), experts packed on the policy
    shift 2
    shape_dir=runs/qwen3_30b_a3b_32l_shape
    python3 benchmarks/user_shape.py make "$shape_dir" --shape qwen3-30b-a3b-32l 2>&1 | tail -1
    # the engine holds a MoE base folded in bf16 (41 GB; packed_base serves dense bases only): its share is most of the GPU
    user_run train benchmarks/recipes/user_shape_grpo.yaml moe_qlora policy.quant_cfg=quant_configs/nvfp4_a16.yaml \
      policy.lora.mode=qlora trainer.steps=2 trainer.batch_size=32 policy.generation.max_new_tokens=512 \
      policy.gradient_checkpointing=on policy.generation.gpu_memory_utilization=0.7 "$@"
    ;;
  qlora)  # the packed base on the GPU's kernels, vLLM's LoRA under CUDA graphs, and qlora parity on the 0.5B model
    python3 -m pytest -q -p no:cacheprovider tests/unit/test_packed.py tests/unit/test_memory.py 2>&1 | tail -3
    python3 benchmarks/gpu_pack_memory.py 2>&1 | grep -E "GiB ->|Error"
    python3 -m pytest -q -s -p no:cacheprovider tests/integration/test_gpu_lora.py tests/integration/test_gpu_packed_base.py \
      2>&1 | grep -E "mean|passed|failed|Error" | tail -6
    qarl parity recipes/parity_0p5b_gpu.yaml policy.dtype=bfloat16 "parity.lora_modes=[qlora]" \
      "parity.formats=[quant_configs/nvfp4_a16.yaml]" --json > "$out/parity_qlora_bfloat16.json" 2> "$out/parity_qlora_bfloat16.log"
    tail -3 "$out/parity_qlora_bfloat16.log"; show_parity "$out/parity_qlora_bfloat16.json"
    ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
