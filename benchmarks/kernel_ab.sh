#!/usr/bin/env bash
# A/B of the Hopper kernels between a git revision and the working tree, on one sm_90a GPU:
#
#   bash benchmarks/kernel_ab.sh BASE_REV [attn|decode|gemm]
#
# Builds benchmarks/kernel_ab.cu (plain CUDA: seconds for attn and decode, but gemm instantiates
# every det_gemm tile in one unit a side: more than seven minutes on the H200's host) once against
# BASE_REV's include/ and csrc/ and once against the working tree's, runs the two builds in turn
# twice (base, new, base, new: a drift of the clocks does not favour one side) on the same inputs,
# and prints each case's faster time on both sides with the working tree's speed-up. Exit status:
# 0 when every output's bits are the same on both sides, 3 when some differ, 1 when a build or a
# run fails, 2 for a wrong argument. A change meant to keep the bits proves it here before the
# extension is built.
#
# The build needs nvcc but no GPU, so it can be made where device time is not spent:
#   KERNEL_AB_OUT=DIR bash benchmarks/kernel_ab.sh BASE_REV SET     (builds, writes DIR, runs nothing)
#   KERNEL_AB_PREBUILT=DIR bash benchmarks/kernel_ab.sh BASE_REV SET  (runs DIR's builds, no nvcc)
# where BASE_REV may be the full hash of a commit the running checkout lacks.
# DIR/built-for names the base commit, what the build holds (gemm: every set; attn-decode: those
# two) and a hash of the working tree's kernel sources; a prebuilt DIR made for another base, from
# other sources than this tree's or without gemm is refused.
set -euo pipefail

usage="usage: bash benchmarks/kernel_ab.sh BASE_REV [attn|decode|gemm]"
base=${1:?$usage}
what=${2:-attn}
case "$what" in
  attn | decode | gemm) ;;
  *) echo "kernel_ab: unknown case set '$what'; $usage" >&2; exit 2 ;;
esac
root=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
if ! base_commit=$(git -C "$root" rev-parse --verify -q "$base^{commit}"); then
  # Running prebuilt binaries needs no object of the base: a GPU machine's copy of the history may
  # stop before it, so a full commit hash is taken as written (built-for must name it all the same).
  if [ -n "${KERNEL_AB_PREBUILT:-}" ] && [[ "$base" =~ ^[0-9a-f]{40}$ ]]; then
    base_commit=$base
  else
    echo "kernel_ab: '$base' is not a commit of this repository (with KERNEL_AB_PREBUILT, a full" \
      "40-digit hash need not be); $usage" >&2
    exit 2
  fi
fi
holds=attn-decode
[ "$what" = gemm ] && holds=gemm
sources() {  # the hash of what the working tree's side is built from
  # LC_ALL=C: the file order, and so the hash, must not depend on the machine's collation.
  (cd "$root" && find include csrc benchmarks/kernel_ab.cu -type f -print0 | LC_ALL=C sort -z \
    | xargs -0 sha256sum) | sha256sum | cut -c1-16
}
tree_sources=$(sources)
work=$(mktemp -d)
trap 'wait; rm -rf "$work"' EXIT

if [ -n "${KERNEL_AB_PREBUILT:-}" ]; then
  bin=$KERNEL_AB_PREBUILT
  read -r built_base built_holds built_sources _ < "$bin/built-for" || {
    echo "kernel_ab: $bin/built-for is missing; make DIR with KERNEL_AB_OUT=DIR" >&2; exit 2; }
  if [ "$built_base" != "$base_commit" ] || [ "$built_sources" != "$tree_sources" ] \
     || { [ "$what" = gemm ] && [ "$built_holds" != gemm ]; }; then
    echo "kernel_ab: $bin was built against $built_base ($built_holds) from sources $built_sources," \
      "not $base_commit ($holds) from this tree's $tree_sources; rebuild it with" \
      "KERNEL_AB_OUT=$bin bash benchmarks/kernel_ab.sh $base $what" >&2
    exit 2
  fi
  for side in base new; do
    [ -x "$bin/kernel_ab-$side" ] || { echo "kernel_ab: no $bin/kernel_ab-$side" >&2; exit 2; }
  done
else
  bin=$work
  NVCC=${NVCC:-nvcc}
  mkdir -p "$work/tree"
  git -C "$root" archive "$base_commit" include csrc | tar -x -C "$work/tree"
  flags=(-O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a --use_fast_math --expt-relaxed-constexpr -lineinfo)
  [ "$what" = gemm ] || flags+=(-DKERNEL_AB_NO_GEMM)
  pids=()
  for side in base new; do
    tree=$root
    [ "$side" = base ] && tree=$work/tree
    for src in "$root/benchmarks/kernel_ab.cu" "$tree/csrc/cuda/attention.cu" "$tree/csrc/cuda/attention_bwd.cu" \
               "$tree/csrc/cuda/attention_decode.cu"; do
      "$NVCC" "${flags[@]}" -I "$tree/include" -I "$tree/csrc" -c -o "$work/$side-$(basename "$src" .cu).o" "$src" &
      pids+=($!)
    done
  done
  failed=0
  for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
  if [ "$failed" = 1 ]; then echo "kernel_ab: a build failed (its nvcc output is above)" >&2; exit 1; fi
  for side in base new; do
    "$NVCC" -gencode=arch=compute_90a,code=sm_90a -o "$work/kernel_ab-$side" "$work/$side"-*.o
  done
  if [ -n "${KERNEL_AB_OUT:-}" ]; then
    mkdir -p "$KERNEL_AB_OUT"
    cp "$work/kernel_ab-base" "$work/kernel_ab-new" "$KERNEL_AB_OUT/"
    # Then, for the reader, the working tree's commit and whether tracked files differed from it.
    dirty=$(git -C "$root" status --porcelain --untracked-files=no | grep -q . && echo dirty || echo clean)
    echo "$base_commit $holds $tree_sources $(git -C "$root" rev-parse HEAD) $dirty" > "$KERNEL_AB_OUT/built-for"
    echo "kernel_ab: $KERNEL_AB_OUT holds the two builds ($(cat "$KERNEL_AB_OUT/built-for"))"
    exit 0
  fi
fi
for round in 1 2; do
  for side in base new; do "$bin/kernel_ab-$side" "$what" > "$work/$side-$round.txt"; done
done

python3 - "$work" <<'PY'
import sys

NAME_KEYS = ("t", "d", "block", "batch", "table", "lens", "m", "n", "k")
HASH_KEYS = ("out", "lse", "dq", "dk", "dv")
EXTRA_KEYS = ("dq_ms", "dkdv_ms", "tbs", "tile", "splits")

def cases(path):
    out = {}
    for line in open(path):
        words = line.split()
        fields = dict(w.split("=", 1) for w in words if "=" in w)
        name = " ".join(w for w in words if "=" not in w or w.split("=")[0] in NAME_KEYS)
        time_key = "ms" if "ms" in fields else "us"
        out[name] = (float(fields[time_key]), {k: v for k, v in fields.items() if k in HASH_KEYS}, fields)
    return out

def side(name):  # the faster of the two rounds; the hashes must agree between them
    a, b = (cases(f"{sys.argv[1]}/{name}-{r}.txt") for r in (1, 2))
    for case in a:
        if a[case][1] != b[case][1]:
            sys.exit(f"kernel_ab: {name} gave different bits in two runs of {case}: not deterministic")
    return {case: min(a[case], b[case], key=lambda x: x[0]) for case in a}

base, new = side("base"), side("new")
differ = 0
for name, (t_new, h_new, f_new) in new.items():
    t_base, h_base, f_base = base[name]
    same = h_base == h_new
    differ += not same
    extra = [f"{k} {f_base[k]} -> {f_new[k]}" if f_base[k] != f_new[k] or k.endswith("ms") else f"{k} {f_new[k]}"
             for k in EXTRA_KEYS if k in f_new]
    print(f"{name:44s} base {t_base:9.4f} new {t_new:9.4f} speed-up {t_base / t_new:5.3f} "
          f"bits {'same' if same else 'DIFFER'}  {'  '.join(extra)}")
print(f"kernel_ab: {len(new)} cases, " + (f"{differ} with different bits" if differ else "bits the same in every case"))
sys.exit(3 if differ else 0)
PY
