#!/usr/bin/env bash
# Which sm_90a kernels a change touches, without a GPU: compiles CUDA units of csrc/cuda from a git
# revision's include/ and csrc/ and from the working tree's, with setup.py's nvcc flags, and compares
# each kernel's SASS (cuobjdump -sass, instruction addresses taken out) between the two:
#
#   bash benchmarks/sass_diff.sh BASE_REV [UNIT ...]
#
# UNIT is a file under csrc/cuda (attention_bwd.cu); by default every unit of either tree that
# includes no torch header. Each kernel gets a line: `same` or `CHANGED` (or `only in base` / `only in new`), its
# registers and spill stores on both sides (ptxas -v). `same` means the same instructions and the
# same resources (ptxas's `Used ...` line: registers, barriers, constant and static shared memory),
# so the kernel itself needs no GPU A/B; host code (launch configurations, the tile choice in units
# with torch headers, which this check leaves out) is not compared.
# Exit status: 0 when every kernel is the same, 3 when some differ, 1 when a build fails, 2 for a
# wrong argument. NVCC (default: nvcc on PATH, else CUDA_HOME/bin/nvcc) and CUOBJDUMP (default:
# cuobjdump on PATH, else beside nvcc) name the tools; cuobjdump needs nvdisasm beside it.
set -euo pipefail

usage="usage: bash benchmarks/sass_diff.sh BASE_REV [UNIT ...]"
[ $# -ge 1 ] || { echo "sass_diff: no BASE_REV; $usage" >&2; exit 2; }
base=$1
shift
root=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
base_commit=$(git -C "$root" rev-parse --verify -q "$base^{commit}") || {
  echo "sass_diff: '$base' is not a commit of this repository; $usage" >&2
  exit 2
}
units=("$@")
torch_headers='#include <torch/\|#include <ATen/'  # units with these are left out (no torch here)
if [ ${#units[@]} -eq 0 ]; then
  # The units of both trees, so that one added or removed is compared too.
  for u in $( (ls "$root/csrc/cuda"; git -C "$root" ls-tree --name-only "$base_commit" csrc/cuda/ | xargs -rn1 basename) \
      2>/dev/null | grep '\.cu$' | sort -u); do
    text=$(git -C "$root" show "$base_commit:csrc/cuda/$u" 2>/dev/null; cat "$root/csrc/cuda/$u" 2>/dev/null || true)
    grep -q "$torch_headers" <<<"$text" || units+=("$u")
  done
  if [ ${#units[@]} -eq 0 ]; then
    echo "sass_diff: no unit under csrc/cuda without torch headers to compare; name one; $usage" >&2
    exit 2
  fi
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
  if grep -q "$torch_headers" "$root/csrc/cuda/$u" 2>/dev/null; then
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
# in <n>.name, and a line "name registers spill-bytes|rest of ptxas's Used line" a kernel in regs
# (empty where the unit is not on that side).
build() {
  local side=$1 unit=$2 out=$work/$1-$2
  mkdir -p "$out"
  : >"$out/regs"
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
  awk '/Compiling entry function/ { match($0, /\047[^\047]+\047/); name = substr($0, RSTART + 1, RLENGTH - 2); spill = "" }
       /spill stores/ { for (i = 1; i <= NF; i++) if ($(i + 1) == "bytes" && $(i + 2) == "spill" && $(i + 3) == "stores,") spill = $i }
       /Used [0-9]+ registers/ && name != "" {
         for (i = 1; i <= NF; i++) if ($i == "Used") print name, $(i + 1), spill "|" substr($0, index($0, "Used"))
         name = "" }' \
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
  declare -A base_file=() new_file=() base_res=() new_res=()
  for f in "$work/base-$u"/*.name; do [ -e "$f" ] && base_file[$(cat "$f")]=${f%.name}.sass; done
  for f in "$work/new-$u"/*.name; do [ -e "$f" ] && new_file[$(cat "$f")]=${f%.name}.sass; done
  while read -r name rest; do base_res[$name]=$rest; done <"$work/base-$u/regs"
  while read -r name rest; do new_res[$name]=$rest; done <"$work/new-$u/regs"
  for name in $(printf '%s\n' "${!base_file[@]}" "${!new_file[@]}" | sort -u); do
    IFS='|' read -r regs_a used_a <<<"${base_res[$name]:-}"
    IFS='|' read -r regs_b used_b <<<"${new_res[$name]:-}"
    read -r regs_a spill_a <<<"$regs_a"
    read -r regs_b spill_b <<<"$regs_b"
    if [ -z "${new_file[$name]:-}" ]; then
      verdict="only in base"
    elif [ -z "${base_file[$name]:-}" ]; then
      verdict="only in new"
    elif cmp -s "${base_file[$name]}" "${new_file[$name]}" && [ "$used_a" = "$used_b" ]; then
      verdict="same"
    else
      verdict="CHANGED"
    fi
    [ "$verdict" = same ] || changed=$((changed + 1))
    printf '  %-12s %s  regs %s -> %s, spill stores %s -> %s bytes\n' "$verdict" "$name" "${regs_a:--}" \
      "${regs_b:--}" "${spill_a:--}" "${spill_b:--}"
  done
  unset base_file new_file base_res new_res
done
echo
if [ "$changed" -eq 0 ]; then
  echo "every kernel is the same (its SASS and its resources)"
  exit 0
fi
echo "$changed kernel(s) differ"
exit 3
