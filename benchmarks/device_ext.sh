#!/usr/bin/env bash
# Builds the sm_90a extension of HEAD on a machine without a GPU, for the GPU machine's Python and
# torch, so that a GPU run installs it in seconds instead of compiling it there (455 s of device
# time on the H200 machine's 16 cores; 4 min 23 s on a 2-core machine, 8 min 41 s with MAX_JOBS=1
# and the test suite beside it; MAX_JOBS defaults to every core):
#
#     bash benchmarks/device_ext.sh DIR
#
# writes DIR/rl_engine_C-<commit>.so.gz and DIR/source.bundle (HEAD and its history). On the GPU
# machine, with DIR carried along: EXT_PREBUILT=DIR/rl_engine_C-<commit>.so.gz
# SOURCE_BUNDLE=DIR/source.bundle bash benchmarks/h200_e2e.sh (see gpu_steps.sh).
#
# DEVICE_PYTHON (python3.12) and DEVICE_TORCH (2.11.0: the CUDA 13.0 build that PyPI serves) name
# what that machine has; the torch is installed, with its CUDA libraries, into DEVICE_VENV
# (.state/device-venv, about 5 GB), since setup.py imports it. nvcc comes from CUDA_HOME
# (/usr/local/cuda); the CUDA headers that toolkit lacks (cuSPARSE, cuBLAS...) from the torch's
# own CUDA packages; the driver library, which no machine without a GPU has, from a stub that only
# satisfies `-lcuda` at link time (the extension reaches the driver through the runtime).
set -euo pipefail
dir=$(realpath -m "${1:?usage: bash benchmarks/device_ext.sh DIR}")
root=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
cd "$root"
if [[ -n "$(git status --porcelain --untracked-files=no)" ]]; then
  echo "device_ext: the tree has uncommitted changes; commit them (the build is of HEAD)" >&2
  exit 2
fi
py=${DEVICE_PYTHON:-python3.12}
torch_version=${DEVICE_TORCH:-2.11.0}
venv=${DEVICE_VENV:-$root/.state/device-venv}
cuda=${CUDA_HOME:-/usr/local/cuda}
command -v "$py" >/dev/null || { echo "device_ext: no $py (set DEVICE_PYTHON)" >&2; exit 2; }
[[ -x $cuda/bin/nvcc ]] || { echo "device_ext: no nvcc under CUDA_HOME=$cuda" >&2; exit 2; }
command -v cc >/dev/null || { echo "device_ext: no cc for the driver stub" >&2; exit 2; }

[[ -x $venv/bin/python ]] || "$py" -m venv "$venv"
"$venv/bin/python" -m pip install -q "torch==$torch_version" numpy setuptools ninja
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# CUDA 13 wheels put every library's headers in nvidia/cu13/include, CUDA 12 ones one folder each.
headers=$(find "$site/nvidia" -maxdepth 3 -type d -name include 2>/dev/null | sort | paste -sd: -)
if [[ -z $headers ]]; then
  echo "device_ext: torch $torch_version brought no CUDA headers (nvidia/*/include)" >&2
  exit 2
fi

# The commit, its files and its bundle are taken now: a commit made during the build changes none.
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/src" "$work/stub"
commit=$(git rev-parse --short=12 HEAD)
git archive "$commit" | tar -x -C "$work/src"
git bundle create -q "$work/source.bundle" HEAD
echo 'void rlk_no_driver_here(void) {}' >"$work/stub/stub.c"
cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$work/stub/libcuda.so" "$work/stub/stub.c"
(cd "$work/src" && env RLK_BUILD_CUDA=1 MAX_JOBS="${MAX_JOBS:-$(nproc)}" CUDA_HOME="$cuda" \
  CPATH="$headers" LIBRARY_PATH="$work/stub" PATH="$venv/bin:$cuda/bin:$PATH" \
  "$venv/bin/python" setup.py -q build_ext --inplace)

mkdir -p "$dir"
gzip -c "$work/src"/rl_engine/_C*.so >"$work/built.so.gz"
mv "$work/built.so.gz" "$dir/rl_engine_C-$commit.so.gz"
mv "$work/source.bundle" "$dir/source.bundle"
echo "device_ext: $dir/rl_engine_C-$commit.so.gz and $dir/source.bundle (HEAD $commit)"
