#!/usr/bin/env bash
# The multi-GPU evidence on one host of four or eight H200s, in one command; summary.json (from
# benchmarks/multi_gpu_summary.py) says what passed, with the commit and dirty flag.
#
# GPUS=4 (the runbook's layout: a TP=2 x CP=2 trainer against two TP=2 rollout engines):
#   rr-small, rr-medium   `rlk run --steps 2 --trace`, CI_TEST=1, default workload, then the
#                         trace check (IPC all-gather, all-reduce and reduce-scatter launched, no
#                         NCCL payload)
#   matrix                `rlk matrix run --baseline` at that layout, then its report
#   gate-tp2cp2, gate-cp4 `rlk attention-gate --world-size 4`, both transports
#   ipc-bench             benchmarks/ipc_collectives.py on the four GPUs
#   step-time             benchmarks/step_time.py, R/R against P/P at that layout
#   megatron-rr-small     the rr step with `--trainer megatron`
#   megatron-pp-small     every route P under `--trainer megatron`: Megatron's DDP sums over CP
# GPUS=8:
#   gate-cp8, gate-tp2cp4, gate-tp2cp2x2   `rlk attention-gate --world-size 8` (the last: two
#                         replicas of TP=2 x CP=2), both transports
#   ipc-bench             on the eight GPUs
#   rr-medium-dp2         TP=2 x CP=2 x DP=2 trainer against four TP=2 engines, 2 prompts x 2
#                         samples, traced, then the trace check
#
#     OUT=h200-multi GPUS=4 bash benchmarks/h200_multi.sh
#
# ARCHIVE=, WHEELS=, STEPS=, EXT_OUT=, EXT_CACHE=, EXT_PREBUILT=, SOURCE_BUNDLE= and DEVICE=cpu
# SKIP_BUILD=1: see benchmarks/gpu_steps.sh (on the CPU a GPU is a rank process; PRESETS="tiny"
# keeps the runs small there).
cd "$(dirname "$0")/.."
source benchmarks/gpu_steps.sh
# The GPUs this process may use (CUDA_VISIBLE_DEVICES counts), unless GPUS says.
GPUS="${GPUS:-$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)}"
if (( GPUS != 4 && GPUS != 8 )); then
  echo "GPUS=$GPUS: this script runs the layouts of 4 or 8 GPUs; set GPUS=4 or GPUS=8" >&2
  exit 2
fi
LAYOUT=(--tp 2 --cp 2 --actor-gpus "$GPUS" --rollout-gpus "$GPUS" --rollout-gpus-per-engine 2)

rr() {  # rr NAME PRESET [VAR=VALUE...]: a strict R/R run at the layout, then its trace check
  local name=$1 preset=$2
  shift 2
  wanted "$name" || return 0
  model "$preset" || return 1
  step "$name" 900 env CI_TEST=1 "$@" "${RLK[@]}" run --device "$DEVICE" --model-root "$MODEL" \
    "${LAYOUT[@]}" --steps 2 --trace --artifact-dir "$WORK/$name" ${FLAGS:-}
  keep "$WORK/$name" "$name"
  step "$name-trace-gate" 300 "${RLK[@]}" trace gate --trace "$WORK/$name/trace" \
    --device "$DEVICE" --world-size "$GPUS" --tp 2 --output "$OUT/$name-trace-gate.json"
}

gate() {  # gate NAME TP CP: the attention parity gate on every GPU, both transports
  step "$1" 600 "${RLK[@]}" attention-gate --device "$DEVICE" --world-size "$GPUS" --tp "$2" \
    --cp "$3" --output-dir "$OUT/attention-gate"
}

prepare
if [[ $DEVICE == cuda ]]; then
  step ipc-bench 600 "$PY" benchmarks/ipc_collectives.py --gpus "$GPUS" \
    --out "$OUT/ipc_collectives.json"
fi
if (( GPUS == 4 )); then
  rr rr-small small
  rr rr-medium medium
  gate gate-tp2cp2 2 2
  gate gate-cp4 1 4
  if wanted matrix; then
    model small
    step matrix 1800 "${RLK[@]}" matrix run --device "$DEVICE" --baseline --model-root "$MODEL" \
      "${LAYOUT[@]}" --matrix-root "$WORK/matrix" --no-history
    step matrix-analyze 300 "${RLK[@]}" matrix analyze --baseline --matrix-root "$WORK/matrix" \
      --output "$OUT/matrix-report.json"
  fi
  step step-time 900 "$PY" benchmarks/step_time.py --model "${PRESETS:-small}" \
    --device "$DEVICE" --repeats 1 "${LAYOUT[@]}" --out "$OUT/step_time.json"
  FLAGS="--trainer megatron" rr megatron-rr-small small
  # Every route P: Megatron's DDP sums the gradients over the CP ranks (the readbacks name it).
  if wanted megatron-pp-small; then
    model small
    step megatron-pp-small 900 env "${ALL_P[@]}" "${RLK[@]}" run --device "$DEVICE" \
      --trainer megatron --model-root "$MODEL" "${LAYOUT[@]}" --steps 2 \
      --artifact-dir "$WORK/megatron-pp-small"
    keep "$WORK/megatron-pp-small" megatron-pp-small
  fi
else
  gate gate-cp8 1 8
  gate gate-tp2cp4 2 4
  gate gate-tp2cp2x2 2 2
  rr rr-medium-dp2 medium ROLLOUT_BATCH_SIZE=2 N_SAMPLES_PER_PROMPT=2
fi
"$PY" benchmarks/multi_gpu_summary.py "$OUT" --gpus "$GPUS" --out "$OUT/summary.json"
rc=$?
pack
exit $rc
