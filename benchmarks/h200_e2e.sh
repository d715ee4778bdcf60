#!/usr/bin/env bash
# The GPU end-to-end evidence in one command on a host with two H200s: builds the sm_90a extension,
# then runs, in order of importance, the IPC collective tests, the IPC-vs-NCCL benchmark, the
# attention tests and benchmark, strict R/R steps of the `small` model at TP=2 and CP=2 (traced,
# then the trace check), the attention parity gate on two GPUs, the R/R-over-P/P step-time benchmark, the
# ablation matrix, the attention parity gate at TP=2, a traced R/R step on one GPU, the Megatron-core
# trainer (traced R/R, step time, its DDP test), the Hopper ops' tests and speed (with every plan
# of det_gemm), their Nsight Compute profiles, and every CUDA test.
# Every step has its own time limit and leaves its log and JSON under $OUT, so a run that is cut
# short still returns what it finished; steps.tsv says how each step ended.
#
#     OUT=h200-results bash benchmarks/h200_e2e.sh
#
# ARCHIVE=, WHEELS=, STEPS=, EXT_OUT=, EXT_CACHE=, EXT_PREBUILT=, SOURCE_BUNDLE= and DEVICE=cpu
# PRESET=tiny SKIP_BUILD=1: see benchmarks/gpu_steps.sh.
cd "$(dirname "$0")/.."
source benchmarks/gpu_steps.sh
PRESET="${PRESET:-small}"

# A strict R/R step of the model, bitwise required: run NAME GPUS TP CP [VAR=VALUE...]; FLAGS
# holds further `rlk run` flags. The first run generates the model.
run() {
  local name=$1 gpus=$2 tp=$3 cp=$4
  shift 4
  wanted "$name" || return 0
  model "$PRESET" || return 1
  step "$name" 240 env CI_TEST=1 "$@" "${RLK[@]}" run --device "$DEVICE" \
    --model-root "$MODEL" --tp "$tp" --cp "$cp" --actor-gpus "$gpus" \
    --rollout-gpus "$gpus" --rollout-gpus-per-engine "$tp" --artifact-dir "$WORK/$name" ${FLAGS:-}
  keep "$WORK/$name" "$name"
  pack
}

prepare

step ipc_tests 180 "$PY" -m pytest -q -x -p no:cacheprovider tests/distributed/test_cuda_ipc.py \
  tests/distributed/test_rank_order_sum_cuda.py
step ipc_bench 180 "$PY" benchmarks/ipc_collectives.py --gpus 2 --out "$OUT/ipc_collectives.json"

step attention_tests 300 "$PY" -m pytest -q -p no:cacheprovider tests/ops/test_cuda_attention.py
step attention_bench 300 "$PY" benchmarks/hopper_attention.py --out "$OUT/hopper_attention.json"

FLAGS=--trace run rr-tp2 2 2 1
step rr-tp2-trace-gate 120 "${RLK[@]}" trace gate --trace "$WORK/rr-tp2/trace" --device "$DEVICE" \
  --world-size 2 --tp 2 --output "$OUT/rr-tp2-trace-gate.json"
FLAGS=--trace run rr-cp2 2 1 2
step rr-cp2-trace-gate 120 "${RLK[@]}" trace gate --trace "$WORK/rr-cp2/trace" --device "$DEVICE" \
  --world-size 2 --tp 1 --output "$OUT/rr-cp2-trace-gate.json"

step attention-gate-cp2 180 "${RLK[@]}" attention-gate --device "$DEVICE" --world-size 2 --cp 2 \
  --output-dir "$OUT/attention-gate"

step step-time 400 "$PY" benchmarks/step_time.py --model "$PRESET" --device "$DEVICE" --repeats 1 \
  --tp 2 --cp 1 --actor-gpus 2 --rollout-gpus 2 --rollout-gpus-per-engine 2 \
  --out "$OUT/step_time_h200.json"

step matrix 600 "${RLK[@]}" matrix run --device "$DEVICE" --workload ci --matrix-root "$WORK/matrix"
step matrix-analyze 120 "${RLK[@]}" matrix analyze --matrix-root "$WORK/matrix" \
  --output "$OUT/matrix/matrix-report.json"

step attention-gate-tp2 180 "${RLK[@]}" attention-gate --device "$DEVICE" --world-size 2 --tp 2 \
  --output-dir "$OUT/attention-gate"
FLAGS=--trace run rr-tp1 1 1 1 CUDA_VISIBLE_DEVICES=0
step rr-tp1-trace-gate 120 "${RLK[@]}" trace gate --trace "$WORK/rr-tp1/trace" --device "$DEVICE" \
  --world-size 1 --tp 1 --output "$OUT/rr-tp1-trace-gate.json"
# The Megatron-core trainer against the built-in rollout engine on one GPU: a traced R/R run, its
# trace check, and Megatron R/R against Megatron P/P step time in one run.
FLAGS="--trace --trainer megatron --steps 2" run megatron-rr-tp1 1 1 1 CUDA_VISIBLE_DEVICES=0
step megatron-rr-tp1-trace-gate 120 "${RLK[@]}" trace gate --trace "$WORK/megatron-rr-tp1/trace" \
  --device "$DEVICE" --world-size 1 --tp 1 --output "$OUT/megatron-rr-tp1-trace-gate.json"
# Every route P: Megatron's stock modules, its DDP summing the gradients (the training readback
# names it), the bits differing from the rollout's.
if wanted megatron-pp-tp1 && model "$PRESET"; then
  step megatron-pp-tp1 240 env CUDA_VISIBLE_DEVICES=0 "${ALL_P[@]}" "${RLK[@]}" run \
    --device "$DEVICE" --trainer megatron --steps 2 --model-root "$MODEL" --tp 1 --cp 1 \
    --actor-gpus 1 --rollout-gpus 1 --rollout-gpus-per-engine 1 \
    --artifact-dir "$WORK/megatron-pp-tp1"
  keep "$WORK/megatron-pp-tp1" megatron-pp-tp1
fi
step megatron-step-time 400 env CUDA_VISIBLE_DEVICES=0 "$PY" benchmarks/step_time.py \
  --model "$PRESET" --device "$DEVICE" --trainer megatron --repeats 1 --tp 1 --cp 1 \
  --actor-gpus 1 --rollout-gpus 1 --rollout-gpus-per-engine 1 \
  --out "$OUT/step_time_megatron_h200.json"
# Megatron's DDP on every-P runs: its reduced grads against the gradients each parameter received.
step megatron-ddp 300 "$PY" -m pytest -q -p no:cacheprovider tests/adapters/test_megatron_ddp.py
# The Hopper ops: their CUDA tests (rows bitwise at every M, offsets and tile choices), then the
# speed of every op against its production twin.
step ops-tests 400 "$PY" -m pytest -q -p no:cacheprovider tests/ops/test_cuda_ops.py
step hopper-ops 400 "$PY" benchmarks/hopper_ops.py --out "$OUT/hopper_ops.json"
# Every plan det_gemm could run, against cuBLAS: where the tile choice leaves speed behind.
step det-gemm-plans 400 "$PY" benchmarks/det_gemm_plans.py --out "$OUT/det_gemm_plans.json"
# What bounds the kernels that miss their speed targets: Nsight Compute's figures for each.
step ncu-profile 600 "$PY" benchmarks/ncu_profile.py --out "$OUT/ncu_profile.json"
# The modules that hold CUDA tests (the others need Airflow, Ray or FastAPI, not installed there).
step cuda_tests 600 "$PY" -m pytest -q -m cuda -p no:cacheprovider tests/distributed tests/ops \
  tests/step tests/validation
exit 0
