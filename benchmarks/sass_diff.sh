#!/usr/bin/env bash
# Which sm_90a kernels a change touches, without a GPU: compiles CUDA units of csrc/cuda from a git
# revision's include/ and csrc/ and from the working tree's, with setup.py's nvcc flags, and compares
# each kernel's SASS (cuobjdump -sass, instruction addresses taken out) between the two:
#
#   bash benchmarks/sass_diff.sh BASE_REV [UNIT ...]
#
# UNIT is a file under csrc/cuda (attention_bwd.cu); by default every unit that includes no torch
# header. Each kernel gets a line: `same` or `CHANGED` (or `only in base` / `only in new`), its
# registers and spill stores on both sides (ptxas -v). A kernel whose SASS is the same runs the
# same instructions, so a change that leaves every kernel `same` needs no GPU A/B.
# Exit status: 0 when every kernel is the same, 3 when some differ, 1 when a build fails, 2 for a
# wrong argument. NVCC (default: nvcc on PATH, else CUDA_HOME/bin/nvcc) and CUOBJDUMP (default:
# cuobjdump on PATH, else beside nvcc) name the tools; cuobjdump needs nvdisasm beside it.
set -euo pipefail

usage="usage: bash benchmarks/sass_diff.sh BASE_REV [UNIT ...]"
base=${1:?$usage}
shift
root=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
base_commit=$(git -C "$root" rev-parse --verify -q "$base^{commit}") || {
  echo "sass_diff: '$base' is not a commit of this repository; $usage" >&2
  exit 2
}
units=("$@")
if [ ${#units[@]} -eq 0 ]; then
  for f in "$root"/csrc/cuda/*.cu; do
    grep -q '#include <torch/\|#include <ATen/' "$f" || units+=("$(basename "$f")")
  done
fi
for u in "${units[@]}"; do
  if [[ "$u" == */* || "$u" != *.cu ]]; then
    echo "sass_diff: '$u' is not a unit name (a .cu file under csrc/cuda, given by its name alone); $usage" >&2
    exit 2
  fi
  if [ ! -f "$root/csrc/cuda/$u" ] && ! git -C "$root" cat-file -e "$base_commit:csrc/cuda/$u" 2>/dev/null; then
    echo "sass_diff: csrc/cuda/$u is in neither the working tree nor $base; $usage" >&2
    exit 2
  fi
  if grep -q '#include <torch/\|#include <ATen/' "$root/csrc/cuda/$u" 2>/dev/null; then
    echo "sass_diff: csrc/cuda/$u includes torch headers, which this check builds without; compare" \
      "the kernels it launches through a unit that instantiates them without torch" >&2
    exit 2
  fi
done

cuda=${CUDA_HOME:-/usr/local/cuda}
nvcc=${NVCC:-$(command -v nvcc || echo "$cuda/bin/nvcc")}
cuobjdump=${CUOBJDUMP:-$(command -v cuobjdump || echo "$(dirname "$nvcc")/cuobjdump")}
for tool in "$nvcc" "$cuobjdump"; do
  [ -x "$tool" ] || { echo "sass_diff: no $(basename "$tool") at $tool (set NVCC / CUOBJDUMP)" >&2; exit 2; }
done
export PATH="$(dirname "$cuobjdump"):$PATH"  # cuobjdump runs nvdisasm from PATH
# setup.py's nvcc list (tests/benchmarks/test_sass_diff.py holds the two equal).
flags=(-O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a --use_fast_math -lineinfo --expt-relaxed-constexpr)

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/base" "$work/new"
git -C "$root" archive "$base_commit" include csrc | tar -x -C "$work/base"
(cd "$root" && tar -c include csrc) | tar -x -C "$work/new"

# Compiles one side's unit into $work/SIDE-UNIT/: the n-th kernel's SASS in <n>.sass and its name
# in <n>.name, and one "name registers spill-bytes" line a kernel in regs.
build() {
  local side=$1 unit=$2 out=$work/$1-$2
  mkdir -p "$out"
  [ -f "$work/$side/csrc/cuda/$unit" ] || return 0
  if ! (cd "$work/$side" && "$nvcc" "${flags[@]}" -DRL_ENGINE_WITH_SM90 -Iinclude -Icsrc -cubin -Xptxas -v \
      -o "$out/unit.cubin" "csrc/cuda/$unit") >"$out/ptxas.txt" 2>&1; then
    echo "sass_diff: $unit does not build on the $side side:" >&2
    tail -20 "$out/ptxas.txt" >&2
    return 1
  fi
  # nvdisasm warns about the ELF format on every call: its stderr is shown only when it fails.
  if ! "$cuobjdump" -sass "$out/unit.cubin" >"$out/unit.sass" 2>"$out/cuobjdump.txt"; then
    echo "sass_diff: cuobjdump failed on $unit ($side):" >&2
    cat "$out/cuobjdump.txt" >&2
    return 1
  fi
  sed -E 's#/\*[0-9a-f]+\*/##' "$out/unit.sass" | awk -v dir="$out" '
    /Function : / { if (n) close(dir "/" n ".sass"); n++; name = $3; print name > (dir "/" n ".name"); close(dir "/" n ".name") }
    n > 0 && NF > 0 { print > (dir "/" n ".sass") }'
  awk '/Compiling entry function/ { match($0, /\047[^\047]+\047/); name = substr($0, RSTART + 1, RLENGTH - 2) }
       /spill stores/ { for (i = 1; i <= NF; i++) if ($(i + 1) == "bytes" && $(i + 2) == "spill" && $(i + 3) == "stores,") spill = $i }
       /Used [0-9]+ registers/ { for (i = 1; i <= NF; i++) if ($i == "Used") print name, $(i + 1), spill }' \
    "$out/ptxas.txt" >"$out/regs"
}

echo "SASS of $(git -C "$root" rev-parse --short=12 "$base_commit") (base) and the working tree (new)," \
  "nvcc $("$nvcc" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p')"
changed=0
for u in "${units[@]}"; do
  build base "$u" || exit 1
  build new "$u" || exit 1
  echo
  echo "csrc/cuda/$u"
  declare -A base_file=() new_file=()
  for f in "$work/base-$u"/*.name; do [ -e "$f" ] && base_file[$(cat "$f")]=${f%.name}.sass; done
  for f in "$work/new-$u"/*.name; do [ -e "$f" ] && new_file[$(cat "$f")]=${f%.name}.sass; done
  for name in $(printf '%s\n' "${!base_file[@]}" "${!new_file[@]}" | sort -u); do
    read -r regs_a spill_a < <(awk -v n="$name" '$1 == n { print $2, $3 }' "$work/base-$u/regs"; echo)
    read -r regs_b spill_b < <(awk -v n="$name" '$1 == n { print $2, $3 }' "$work/new-$u/regs"; echo)
    if [ -z "${new_file[$name]:-}" ]; then
      verdict="only in base"
    elif [ -z "${base_file[$name]:-}" ]; then
      verdict="only in new"
    elif cmp -s "${base_file[$name]}" "${new_file[$name]}"; then
      verdict="same"
    else
      verdict="CHANGED"
    fi
    [ "$verdict" = same ] || changed=$((changed + 1))
    printf '  %-12s %s  regs %s -> %s, spill stores %s -> %s bytes\n' "$verdict" "$name" "${regs_a:--}" \
      "${regs_b:--}" "${spill_a:--}" "${spill_b:--}"
  done
  unset base_file new_file
done
echo
if [ "$changed" -eq 0 ]; then
  echo "every kernel's SASS is the same"
  exit 0
fi
echo "$changed kernel(s) differ"
exit 3
