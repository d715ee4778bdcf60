# Shared by the GPU evidence scripts (h200_e2e.sh, h200_multi.sh): sourced, not run. Sets OUT,
# WORK, PY, DEVICE and RLK, and gives each step its own time limit, log and line in steps.tsv, so a
# run cut short still returns what it finished.
#
# ARCHIVE=path.tgz packs $OUT into that one file after every step (for a machine that hands back
# only a few files). WHEELS=folder installs the wheels in it first (--no-deps): the machine cannot
# download, so a pure-Python dependency such as megatron-core travels as a wheel. STEPS="a b ..."
# runs only the named steps (and the build and models they need). DEVICE=cpu SKIP_BUILD=1 runs the
# same plumbing on a CPU machine, to check a script itself.
#
# SOURCE_BUNDLE=file.bundle (benchmarks/device_ext.sh writes one) makes the checkout's HEAD the
# bundle's, for a machine whose copy of the history stops at an older commit, so that every result
# names the commit it measured; it refuses a tree whose tracked files differ from that commit.
# EXT_PREBUILT=rl_engine_C-COMMIT.so.gz (device_ext.sh too: built on another machine against this
# machine's torch and Python) installs that build instead of compiling, if COMMIT is HEAD.
#
# The sm_90a build takes minutes of GPU-machine time; EXT_OUT=folder keeps what it built there as
# rl_engine_C-KEY.so, and EXT_CACHE=folder holding that file installs it (setup.py's
# RLK_PREBUILT_EXTENSION) instead of building. KEY hashes the content of every file under csrc/
# and include/ and setup.py, the torch, Python ABI, nvcc and host compiler that build them, so a
# changed kernel or toolchain never meets an old build.
set -uo pipefail

OUT="${OUT:?set OUT to the folder for the results}"
WORK="${WORK:-$(mktemp -d)}"
PY="${PYTHON:-python3}"
DEVICE="${DEVICE:-cuda}"
RLK=("$PY" -m rl_engine.cli)
mkdir -p "$OUT" "$WORK"
if [[ -n "${ARCHIVE:-}" && "$(realpath -m "$ARCHIVE")/" == "$(realpath -m "$OUT")/"* ]]; then
  echo "ARCHIVE=$ARCHIVE is inside OUT=$OUT, which it packs: put it beside OUT" >&2
  exit 2
fi
# No NVLink SHARP multicast anywhere: its in-switch sums have no fixed order.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export RLK_STATE_DIR="$WORK/state" PYTHONUNBUFFERED=1

pack() {  # the whole of $OUT in $ARCHIVE, replaced atomically
  if [[ -n "${ARCHIVE:-}" ]]; then
    tar -czf "$WORK/archive.tgz" -C "$OUT" . && mv "$WORK/archive.tgz" "$ARCHIVE"
  fi
}

wanted() {  # wanted NAME: whether STEPS (empty: every step) names NAME
  [[ -z "${STEPS:-}" || " $STEPS " == *" $1 "* ]]
}

step() {  # step NAME LIMIT_SECONDS COMMAND...: runs it, logs to $OUT/NAME.log, records its end
  local name=$1 limit=$2 start rc
  shift 2
  [[ $name == build || $name == model* || $name == wheels ]] || wanted "${name%-trace-gate}" \
    || wanted "${name%-analyze}" || return 0
  start=$(date +%s)
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$(($(date +%s) - start))" | tee -a "$OUT/steps.tsv"
  pack
  return $rc
}

keep() {  # keep RUN_DIR NAME: the run's JSON evidence and log, without its bulky trace and tensors
  local run=$1 name=$2
  mkdir -p "$OUT/$name"
  cp "$run"/*.json "$run"/run.log "$run"/exit-code "$OUT/$name/" 2>/dev/null
  cp -r "$run/readbacks" "$OUT/$name/" 2>/dev/null
}

model() {  # model PRESET: $MODEL is that preset's model, generated once under $WORK;
  # PRESETS="tiny" (on a CPU) stands in for every preset
  local preset=${PRESETS:-$1}
  MODEL="$WORK/model-$preset"
  [[ -d "$MODEL" ]] || step "model-$preset" 180 "${RLK[@]}" model init --preset "$preset" \
    --out "$MODEL"
}

# The environment of a run with every route P.
ALL_P=(RL_KERNEL_ATTENTION_CASE=P/P RL_KERNEL_FFN_CASE=P/P RL_KERNEL_LOGP_CASE=P/P)

ext_key() {  # the hash of what the extension is built from (see the top of this file)
  if [[ ! -d csrc || ! -d include || ! -f setup.py ]]; then
    echo "ext_key: run it from the repository root" >&2
    return 1
  fi
  { find csrc include setup.py -type f -print0 | sort -z | xargs -0 sha256sum
    "$PY" - <<'PY'
import subprocess, sysconfig, torch
from torch.utils.cpp_extension import CUDA_HOME
print(torch.__version__, torch.version.cuda, sysconfig.get_config_var("EXT_SUFFIX"))
for tool in ([f"{CUDA_HOME}/bin/nvcc"] if CUDA_HOME else []) + ["c++"]:
    try:
        print(subprocess.run([tool, "--version"], capture_output=True, text=True).stdout.split("\n")[:4])
    except OSError:
        print(tool, "absent")
PY
  } | sha256sum | cut -c1-16
}

ext_suffix() { "$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))'; }

source_commit() {  # HEAD := SOURCE_BUNDLE's HEAD, where the tracked files are that commit's
  git fetch -q "$SOURCE_BUNDLE" HEAD || return 1
  # The files against that commit's own index (this checkout's index is older's: it would miss files
  # the commit added).
  local index
  index=$(mktemp)
  if ! GIT_INDEX_FILE=$index git read-tree FETCH_HEAD; then
    rm -f "$index"
    return 1
  fi
  GIT_INDEX_FILE=$index git update-index -q --refresh >/dev/null
  if ! GIT_INDEX_FILE=$index git diff --quiet; then
    echo "SOURCE_BUNDLE=$SOURCE_BUNDLE: the tree differs from its commit" \
      "$(git rev-parse FETCH_HEAD); make the bundle from the commit the tree was copied from:" >&2
    GIT_INDEX_FILE=$index git diff --stat >&2
    rm -f "$index"
    return 1
  fi
  rm -f "$index"
  git reset -q FETCH_HEAD
}

prebuilt() {  # installs EXT_PREBUILT, a build of HEAD (its name says which commit)
  local name so="$WORK/rl_engine_C-prebuilt.so"
  name=$(basename "$EXT_PREBUILT")
  if [[ $name != "rl_engine_C-$(git rev-parse --short=12 HEAD).so"* ]]; then
    echo "EXT_PREBUILT=$EXT_PREBUILT is not a build of HEAD $(git rev-parse --short=12 HEAD):" \
      "pass SOURCE_BUNDLE= too where this checkout's history stops before its files," \
      "or build HEAD with benchmarks/device_ext.sh" >&2
    return 1
  fi
  if [[ $name == *.gz ]]; then
    gunzip -c "$EXT_PREBUILT" >"$so" || return 1
  else
    cp "$EXT_PREBUILT" "$so" || return 1
  fi
  install_built "$so"
}

install_built() {  # install_built FILE: an editable install as the build makes it, no compiler run
  step build 120 env RLK_PREBUILT_EXTENSION="$1" "$PY" -m pip install -q --no-deps \
    --no-build-isolation -e .
}

prepare() {  # the commit, the GPUs' names, the carried wheels, the sm_90a build
  if [[ -n "${SOURCE_BUNDLE:-}" ]]; then source_commit || exit 1; fi
  nvidia-smi --query-gpu=name,memory.total --format=csv >"$OUT/gpus.csv" 2>&1
  if [[ -n "${WHEELS:-}" ]]; then
    step wheels 120 bash -c "$PY -m pip install -q --no-deps $WHEELS/*.whl" || exit 1
  fi
  [[ -z "${SKIP_BUILD:-}" ]] || return 0
  if [[ -n "${EXT_PREBUILT:-}" ]]; then prebuilt || exit 1; return 0; fi
  local key built
  key=$(ext_key) || exit 1
  built="${EXT_CACHE:-/nonexistent}/rl_engine_C-$key.so"
  if [[ -f "$built" ]]; then
    install_built "$built" || exit 1
    return 0
  fi
  step build 480 env MAX_JOBS=16 RLK_BUILD_CUDA=1 "$PY" -m pip install -q --no-deps \
    --no-build-isolation -e . || exit 1
  if [[ -n "${EXT_OUT:-}" ]]; then
    mkdir -p "$EXT_OUT" && cp "rl_engine/_C$(ext_suffix)" "$EXT_OUT/rl_engine_C-$key.so" \
      || echo "prepare: could not keep the build in EXT_OUT=$EXT_OUT" | tee -a "$OUT/build.log" >&2
  fi
}
