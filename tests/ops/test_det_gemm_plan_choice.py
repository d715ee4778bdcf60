"""det_gemm's plan choice is host code in include/rl_engine/cuda/det_gemm.cuh, so it is checked here
without a GPU: compiled with nvcc into a small program that walks a grid of shapes and SM counts and
checks that the plan plan_det_gemm picks is one that det_gemm_plan_options lists (the set that
_det_gemm_plans exposes and the CUDA tests hold to the same bits), that the list has no duplicate,
that its size is what the enumeration promises, and that its K ranges depend on N and K alone. A
change to the tile choice that picks a tile the list lacks fails here, before any GPU run. Skipped
where there is no nvcc (CI has one)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)

PROGRAM = r"""
#include <cstdio>
#include "rl_engine/cuda/det_gemm.cuh"
using namespace rl_engine::cuda;

int main() {
  const int ns[] = {1, 8, 264, 576, 584, 1000, 1001, 1024, 2048, 2176, 2560, 3072, 3073, 4096, 4232,
                    6144, 8448, 9728, 12288, 16896, 19456, 24576, 33792, 75968, 151936};
  const int ks[] = {64, 520, 1000, 2560, 4096, 12288};
  const int sms[] = {132, 114, 78};
  long checked = 0;
  for (int sm : sms)
    for (int n : ns)
      for (int k : ks)
        for (int m = 1; m <= 9000; m += m < 300 ? 1 : m < 1100 ? 7 : 61) {
          GemmPlan all[kGemmPlanOptions];
          const int count = det_gemm_plan_options(m, n, k, all);
          const bool split = choose_gemm_split(n, k).splits > 1;
          const int want = 9 + 3 * (m <= 256) + 6 * split;
          if (count != want) {
            std::printf("m=%d n=%d k=%d: %d plans, not %d\n", m, n, k, count, want);
            return 1;
          }
          for (int i = 0; i < count; ++i) {
            if (all[i].split.splits != choose_gemm_split(n, k).splits) {
              std::printf("m=%d n=%d k=%d: a plan's K ranges are not choose_gemm_split's\n", m, n, k);
              return 1;
            }
            for (int j = 0; j < i; ++j)
              if (same_gemm_plan(all[i], all[j])) {
                std::printf("m=%d n=%d k=%d: plans %d and %d are the same\n", m, n, k, j, i);
                return 1;
              }
          }
          const GemmPlan pick = plan_det_gemm(m, n, k, sm, true);
          if (!is_det_gemm_plan_option(m, n, k, pick)) {
            std::printf("m=%d n=%d k=%d sms=%d: plan_det_gemm picks %dx%d%s (%s) that the list lacks\n", m, n, k,
                        sm, pick.tile.bm, pick.tile.bn, pick.tile.swap ? " swapped" : "",
                        pick.split.across ? "across" : "within");
            return 1;
          }
          ++checked;
        }
  std::printf("checked %ld shapes\n", checked);
  return 0;
}
"""


def build_and_run(tmp_path, name, source):
    """Compiles source against include/ and runs it; its stdout (both must exit 0)."""
    src = tmp_path / f"{name}.cu"
    src.write_text(source)
    exe = tmp_path / name
    build = subprocess.run([NVCC, "-O2", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a",
                            "--expt-relaxed-constexpr", "-I", str(ROOT / "include"), "-o", str(exe), str(src)],
                           capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


@pytest.mark.skipif(NVCC is None, reason="needs nvcc (the program is host code, but the header is CUDA)")
def test_every_pick_is_a_listed_plan(tmp_path):
    out = build_and_run(tmp_path, "plan_choice", PROGRAM)
    checked = int(out.split()[1])
    assert checked > 100_000, out


PICKS = r"""
#include <cstdio>
#include "rl_engine/cuda/det_gemm.cuh"
using namespace rl_engine::cuda;

int main() {
  // m n k: the tile plan_det_gemm runs at 132 SMs
  const int cases[][3] = {{1030, 1024, 4096}, {1030, 1024, 2560}, {1025, 1024, 4096}, {1152, 1024, 4096},
                          {1024, 1024, 4096}, {300, 6144, 2560}, {8, 6144, 4096}, {16, 6144, 2560},
                          {32, 6144, 4096}, {8, 4096, 4096}, {8, 12288, 4096}, {8, 1024, 4096},
                          {128, 1024, 2560}, {192, 1024, 2560}, {256, 1024, 2560}, {96, 1024, 4096},
                          {128, 1024, 4096}, {128, 2560, 4096}, {193, 1024, 2560}, {256, 1024, 4096},
                          {256, 2560, 4096}, {192, 1024, 4096}, {129, 1024, 4096}, {192, 2560, 4096},
                          {129, 2560, 4096}, {192, 2560, 9728}, {256, 2560, 9728}, {64, 4096, 2560},
                          {48, 4096, 4096}, {64, 4096, 12288}, {64, 6144, 2560}, {32, 4096, 2560},
                          {192, 6144, 4096}, {160, 6144, 4096}, {192, 6144, 2560}, {96, 19456, 2560},
                          {100, 19456, 2560}, {96, 24576, 4096}, {1, 4096, 12288}, {4, 4096, 12288},
                          {8, 4096, 12288}, {2, 4096, 4096}, {2, 4096, 12288}, {1, 4096, 4096}};
  for (const auto& c : cases) {
    const GemmPlan p = plan_det_gemm(c[0], c[1], c[2], 132, true);
    std::printf("%d %d %d %dx%d%s%s\n", c[0], c[1], c[2], p.tile.bm, p.tile.bn, p.tile.swap ? " swapped" : "",
                p.split.across ? " across" : "");
  }
  return 0;
}
"""


@pytest.mark.skipif(NVCC is None, reason="needs nvcc (the program is host code, but the header is CUDA)")
def test_picks_measured_on_a_sweep(tmp_path):
    """Picks that a recorded sweep settled (benchmarks/results/h100/f8d484b/): at the KV projections'
    N = 1024, M = 1025-1152 makes 72 tiles of 128 x 128, a wave 54.5% full, which beat 64 x 32's
    five waves 0.62 to 0.30-0.33 of cuBLAS at M = 1030 (the M timed; the others make the same
    grid); at M = 1024 128 x 64 fills the wave (0.90 against 0.64 on 128 x 128's 48%); tiles other
    than 128 x 128 keep the 55% bar (the fused QKV projection at M = 300 keeps 64 x 128, 0.80
    against 0.57 on 128 x 256's wave, 54.5% full). At M <= 16 the fused QKV projections
    (N = 6144) stream the weight in 16-row slabs, three rounds of 132 SMs where 32-row ones take
    two of twice the rows (0.6-5% faster at M = 4-16 in five sweeps); M = 32, the square and wide
    shapes (the same rows an SM either way) and the KV projection, whose K is split across CTAs,
    keep 32. From M = 65 with K split across CTAs, 4B's KV projection (80 items of the 128-row
    tiles) runs swapped 64 x 64 tiles while their items fit in one pass (160 at M = 128, 240 at
    192; at 256, 320 do not): 6-12% and 15-20% faster in every H100 sweep. 8B's (96 items) and the
    o projection (120) keep theirs: 8B's swapped was 12-18% slower at M = 96-100. Past that, at
    M = 193-256, 4B's KV projection runs 64 x 32 tiles with the ranges met in the CTA (128 tiles,
    three an SM): 0.84 of cuBLAS against 0.71 at M = 256 (split_probe/); 8B's and the o projection
    keep 128 x 128 across CTAs. 8B's KV projection at M = 129-192, where 128-row tiles leave the
    second row block at most half used and their 96 items more than a fifth of the SMs idle (36 of
    132), runs 64 x 128 across CTAs (144 items, all resident): 0.64-0.65 -> 0.75-0.78 at M = 192 in
    the 11 earlier sweeps, 0.66 -> 0.77 at 8f167b9. So does 4B's o projection there (120 items,
    12 SMs idle), whose ranges are short (24 K blocks): 8-12% faster at M = 192 in 9 of those 11
    sweeps, 11-13% at M = 129-160 and 2-6% at 192 in two at 8f167b9; its down projection, whose
    ranges are 52 blocks and which was 3-9% slower on 64 x 128 at M = 192, keeps 128 x 128, as
    both do at 256. From M = 33 to 64 at N = 4096, where 64 x 32 tiles make one wave of 128, swapped
    32-row slabs run in their place where K is at most 64 blocks: 3.7-6.5% faster at K = 2560 and
    0.7-3.3% at 4096 in each of 8 sweeps; K = 12288 (0.8% faster to 2.1% slower) keeps 64 x 32, and
    the fused QKV projection (N = 6144, 192 tiles in one resident pass) keeps its tile. 8B's fused
    QKV projection at M = 129-192 (K = 4096) runs 64 x 128 unsplit, two CTAs an SM, instead of
    128 x 128: 2.3-13.8% faster at M = 192 in each of 9 sweeps; 4B's (K = 2560), between 2% slower
    and 4% faster, keeps 128 x 128. 4B's gate-up projection (N = 19456) at M = 96-100 runs 128 x 160
    (60% bar in one row block) instead of 128 x 256's part wave: 2.6-6.7% faster in 9 sweeps at
    M = 96, 6.0% at 100; 8B's (N = 24576) keeps 128 x 192. 8B's down projection (K = 12288) never
    streams the weight in 64-row slabs: one an SM, they were 7-10% slower at M = 1-4 in both plan
    sweeps at 5f89127 (benchmarks/results/h100/5f89127/). At M = 1-2 it streams 16-row slabs, two
    CTAs an SM: faster than 32-row ones in 11 / 12 of 13 sweeps (median 0.7% / 1.7%, 3-5% in the
    latest three, 1d955c4/ among them); M = 4-8 (a coin toss) and the square shape's K = 4096 (16
    rows 1-8% slower in every sweep) keep 32."""
    out = build_and_run(tmp_path, "picks", PICKS)
    assert out.splitlines() == [
        "1030 1024 4096 128x128", "1030 1024 2560 128x128", "1025 1024 4096 128x128",
        "1152 1024 4096 128x128", "1024 1024 4096 128x64", "300 6144 2560 64x128",
        "8 6144 4096 16x8 swapped", "16 6144 2560 16x16 swapped", "32 6144 4096 32x32 swapped",
        "8 4096 4096 32x8 swapped", "8 12288 4096 32x8 swapped", "8 1024 4096 32x8 swapped across",
        "128 1024 2560 64x64 swapped across", "192 1024 2560 64x64 swapped across",
        "256 1024 2560 64x32", "96 1024 4096 128x64 across", "128 1024 4096 128x64 across",
        "128 2560 4096 128x64 across", "193 1024 2560 64x32", "256 1024 4096 128x128 across",
        "256 2560 4096 128x128 across", "192 1024 4096 64x128 across", "129 1024 4096 64x128 across",
        "192 2560 4096 64x128 across", "129 2560 4096 64x128 across", "192 2560 9728 128x128 across",
        "256 2560 9728 128x128 across", "64 4096 2560 32x64 swapped", "48 4096 4096 32x64 swapped",
        "64 4096 12288 64x32", "64 6144 2560 64x32", "32 4096 2560 32x32 swapped",
        "192 6144 4096 64x128", "160 6144 4096 64x128", "192 6144 2560 128x128", "96 19456 2560 128x160",
        "100 19456 2560 128x160", "96 24576 4096 128x192", "1 4096 12288 16x8 swapped",
        "4 4096 12288 32x8 swapped", "8 4096 12288 32x8 swapped", "2 4096 4096 32x8 swapped",
        "2 4096 12288 16x8 swapped", "1 4096 4096 32x8 swapped"], out


PAIRS = r"""
#include <cstdio>
#include "rl_engine/cuda/det_gemm.cuh"
using namespace rl_engine::cuda;

int main() {
  // m n: whether a 128 x 128 two-sum launch at 132 SMs (one CTA an SM) pairs with 66 pairs at once,
  // and with none (a card or build where clusters cannot launch).
  const int cases[][2] = {{8192, 1024}, {4096, 1024}, {4097, 1024}, {2304, 1024}, {2048, 1024},
                          {1152, 1024}, {1000, 2592}, {640, 1024}};
  for (const auto& c : cases) {
    const int mb = (c[0] + 127) / 128, nb = (c[1] + 127) / 128;
    std::printf("%d %d %d %d\n", c[0], c[1], gemm_pairs_fit(mb, nb, 132, 66), gemm_pairs_fit(mb, nb, 132, 0));
  }
  std::printf("%d %d %d\n", gemm_pair_tile(128, 128, true), gemm_pair_tile(128, 128, false), gemm_pair_tile(128, 160, true));
  return 0;
}
"""


@pytest.mark.skipif(NVCC is None, reason="needs nvcc (the program is host code, but the header is CUDA)")
def test_pairs_only_where_measured(tmp_path):
    """CTA pairs run only on the 128 x 128 tile whose K ranges meet within the CTA, and only where
    it takes more than one wave unpaired: the launches benchmarks/results/h100/ddcfeb2/ timed
    faster (the KV projections at M >= 4096); one-wave launches (M <= 2048 at N = 1024) stay
    unpaired, as pairs_cta/ found them slower elsewhere, and so does every launch where no cluster
    fits. M = 2304 makes 144 tiles, two waves of 132, and 72 pairs, two waves of 66: paired."""
    out = build_and_run(tmp_path, "pairs", PAIRS)
    assert out.splitlines() == [
        "8192 1024 1 0", "4096 1024 1 0", "4097 1024 1 0", "2304 1024 1 0", "2048 1024 0 0",
        "1152 1024 0 0", "1000 2592 1 0", "640 1024 0 0", "1 0 0"], out
