#!/usr/bin/env bash
# A/B of the Hopper kernels between a git revision and the working tree, on one sm_90a GPU:
#
#   bash benchmarks/kernel_ab.sh BASE_REV [attn|decode|gemm]
#
# Builds benchmarks/kernel_ab.cu (plain CUDA, seconds to build) once against BASE_REV's include/
# and csrc/ and once against the working tree's, runs both on the same inputs, and prints each
# case's time on both sides with the working tree's speed-up. Exits 1 if any output's bits differ:
# a change meant to keep the bits proves it here before the extension is built.
set -euo pipefail

base=${1:?usage: bash benchmarks/kernel_ab.sh BASE_REV [attn|decode|gemm]}
what=${2:-attn}
root=$(git rev-parse --show-toplevel)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/tree"
git -C "$root" archive "$base" include csrc | tar -x -C "$work/tree"

flags=(-O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a --use_fast_math --expt-relaxed-constexpr -lineinfo)
[ "$what" = gemm ] || flags+=(-DKERNEL_AB_NO_GEMM)
pids=()
for side in base new; do
  tree=$root
  [ "$side" = base ] && tree=$work/tree
  for src in "$root/benchmarks/kernel_ab.cu" "$tree/csrc/cuda/attention.cu" "$tree/csrc/cuda/attention_bwd.cu" \
             "$tree/csrc/cuda/attention_decode.cu"; do
    nvcc "${flags[@]}" -I "$tree/include" -I "$tree/csrc" -c -o "$work/$side-$(basename "$src" .cu).o" "$src" &
    pids+=($!)
  done
done
for pid in "${pids[@]}"; do wait "$pid"; done
for side in base new; do
  nvcc -gencode=arch=compute_90a,code=sm_90a -o "$work/kernel_ab-$side" "$work/$side"-*.o
  "$work/kernel_ab-$side" "$what" > "$work/$side.txt"
done

python3 - "$work/base.txt" "$work/new.txt" <<'PY'
import sys

def cases(path):
    out = {}
    for line in open(path):
        words = line.split()
        fields = dict(w.split("=", 1) for w in words if "=" in w)
        time_key = "ms" if "ms" in fields else "us"
        name = " ".join(w for w in words if "=" not in w or w.split("=")[0] in ("t", "d", "block", "m", "n", "k"))
        hashes = {k: v for k, v in fields.items() if k in ("out", "lse", "dq", "dk", "dv")}
        out[name] = (float(fields[time_key]), hashes, fields)
    return out

base, new = cases(sys.argv[1]), cases(sys.argv[2])
differ = False
for name, (t_new, h_new, f_new) in new.items():
    t_base, h_base, f_base = base[name]
    same = h_base == h_new
    differ |= not same
    parts = [f"{k} {f_base[k]} -> {f_new[k]}" for k in ("dq_ms", "dkdv_ms", "tbs") if k in f_new]
    print(f"{name:40s} base {t_base:9.4f} new {t_new:9.4f} speed-up {t_base / t_new:5.3f} "
          f"bits {'same' if same else 'DIFFER'} {' '.join(parts)}")
sys.exit(1 if differ else 0)
PY
