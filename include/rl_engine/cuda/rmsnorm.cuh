// RMSNorm for Hopper: out[r, i] = (x[r, i] * rstd[r]) * w[i], rstd[r] = rsqrt(sum_i x^2 / H + eps).
//
// A row is handled by a group of G threads (G = 16, 32, 128, 512 or 1024, chosen from H alone):
// thread g takes vectors g, g + G, ... of V elements (16-byte accesses when the row allows), sums
// squares in that order, then the group adds through group_sum's fixed tree. So the reduction tree
// of a row depends only on H and the dtype, never on the number of rows or the row's position.
// The row stays in registers, packed, between the two passes.
//
// Backward: each group walks a fixed chunk of kRmsChunk rows in order, writing grad_x and adding
// g * (x * rstd) into its own per-column slots in shared memory; the chunk partials go to memory and
// rlk_rmsnorm_column_tree_kernel adds them, 32 consecutive ones at a time in order, level by level.
// grad_weight therefore sums rows through a fixed tree anchored at row 0.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "rl_engine/cuda/types.cuh"

namespace rl_engine::cuda {

constexpr int kRmsChunk = 16;
constexpr int kRmsMaxV = 4;  // vectors per thread

template <int G>
constexpr int rms_block() { return G > 256 ? G : 256; }

template <typename T, int G, int V>
__global__ void __launch_bounds__(rms_block<G>())
    rlk_rmsnorm_fwd_kernel(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ out,
                       float* __restrict__ rstd, int64_t rows, int h, float inv_h, float eps) {
  __shared__ float red[32];
  const int gt = threadIdx.x % G;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / G) + threadIdx.x / G;
  const bool valid = row < rows;
  const int nv = h / V;
  const T* xr = x + row * h;
  Raw<T, V> xv[kRmsMaxV];
#pragma unroll
  for (int i = 0; i < kRmsMaxV; ++i) {
    if (valid && gt + i * G < nv) xv[i].load(xr + (gt + i * G) * V);
  }
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < kRmsMaxV; ++i) {
    if (valid && gt + i * G < nv) {
#pragma unroll
      for (int j = 0; j < V; ++j) ss = fmaf(xv[i].get(j), xv[i].get(j), ss);
    }
  }
  const float total = group_sum<G>(ss, red);
  if (!valid) return;
  const float rs = rsqrtf(total * inv_h + eps);
  if (gt == 0) rstd[row] = rs;
  T* o = out + row * h;
#pragma unroll
  for (int i = 0; i < kRmsMaxV; ++i) {
    const int vi = gt + i * G;
    if (vi < nv) {
      Raw<T, V> wv;
      wv.load(w + vi * V);
      float ov[V];
#pragma unroll
      for (int j = 0; j < V; ++j) ov[j] = (xv[i].get(j) * rs) * wv.get(j);
      store_f32<T, V>(o + vi * V, ov);
    }
  }
}

// dx = rstd * (g w - x * c), c = ((sum_j (g_j w_j) x_j) * rstd) * rstd / H, as the CPU kernel;
// dw_part[chunk, i] = sum over the chunk's rows, in row order, of g * (x * rstd). Dynamic shared
// memory: (blockDim.x / G) * h floats.
// Two 256-thread blocks per SM for the narrow groups, each group with two rows in flight (the one it
// reduces and the next), within 128 registers a thread. (32768 rows of 4096 make 2048 chunks: 3.9
// waves of these groups, where three blocks an SM left the last of 3 waves 60% full.)
template <typename T, int G, int V>
__global__ void __launch_bounds__(rms_block<G>(), G <= 128 ? 2 : 1)
    rlk_rmsnorm_bwd_kernel(const T* __restrict__ g, const T* __restrict__ x, const T* __restrict__ w,
                       const float* __restrict__ rstd, T* __restrict__ dx, float* __restrict__ dw_part,
                       int64_t rows, int h, float inv_h, unsigned* __restrict__ tree_done, int tree_slices) {
  __shared__ float red[32];
  // The column tree's counters (rlk_rmsnorm_column_tree_kernel runs next in the stream).
  if (blockIdx.x == 0)
    for (int i = threadIdx.x; i < tree_slices; i += blockDim.x) tree_done[i] = 0;
  extern __shared__ float dw_smem[];
  const int gt = threadIdx.x % G;
  const int64_t chunk = static_cast<int64_t>(blockIdx.x) * (blockDim.x / G) + threadIdx.x / G;
  const int64_t chunks = (rows + kRmsChunk - 1) / kRmsChunk;
  // This group's columns, slot (j, vi) for column vi * V + j: each slot has one owner thread, and
  // neighbouring lanes hit neighbouring banks.
  float* dw = dw_smem + (threadIdx.x / G) * h;
  const int nv = h / V;
  Raw<T, V> wv[kRmsMaxV];
#pragma unroll
  for (int i = 0; i < kRmsMaxV; ++i) {
    const int vi = gt + i * G;
    if (vi < nv) {
      wv[i].load(w + vi * V);
#pragma unroll
      for (int j = 0; j < V; ++j) dw[j * nv + vi] = 0.f;
    }
  }
  // Row r + 1 is loaded while row r is reduced and written: the group_sum barriers would otherwise
  // keep each group to one row's loads in flight.
  auto load_row = [&](int r, Raw<T, V>(&gv)[kRmsMaxV], Raw<T, V>(&xv)[kRmsMaxV]) {
    const int64_t row = chunk * kRmsChunk + r;
    if (chunk >= chunks || row >= rows) return;
#pragma unroll
    for (int i = 0; i < kRmsMaxV; ++i) {
      const int vi = gt + i * G;
      if (vi < nv) {
        gv[i].load(g + row * h + vi * V);
        xv[i].load(x + row * h + vi * V);
      }
    }
  };
  Raw<T, V> gn[kRmsMaxV], xn[kRmsMaxV];
  load_row(0, gn, xn);
  for (int r = 0; r < kRmsChunk; ++r) {  // same trip count in every group: group_sum syncs
    const int64_t row = chunk * kRmsChunk + r;
    const bool valid = chunk < chunks && row < rows;
    Raw<T, V> gv[kRmsMaxV], xv[kRmsMaxV];
#pragma unroll
    for (int i = 0; i < kRmsMaxV; ++i) gv[i] = gn[i], xv[i] = xn[i];
    if (r + 1 < kRmsChunk) load_row(r + 1, gn, xn);
    float dot = 0.f;
#pragma unroll
    for (int i = 0; i < kRmsMaxV; ++i) {
      if (valid && gt + i * G < nv) {
#pragma unroll
        for (int j = 0; j < V; ++j) dot = fmaf(gv[i].get(j) * wv[i].get(j), xv[i].get(j), dot);
      }
    }
    const float total = group_sum<G>(dot, red);
    if (!valid) continue;
    const float rs = rstd[row];
    const float c = ((total * rs) * rs) * inv_h;
#pragma unroll
    for (int i = 0; i < kRmsMaxV; ++i) {
      const int vi = gt + i * G;
      if (vi < nv) {
        float dv[V];
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const float gx = gv[i].get(j), xx = xv[i].get(j);
          dv[j] = rs * __fsub_rn(gx * wv[i].get(j), xx * c);
          dw[j * nv + vi] = fmaf(gx, xx * rs, dw[j * nv + vi]);
        }
        store_f32<T, V>(dx + row * h + vi * V, dv);
      }
    }
  }
  if (chunk >= chunks) return;
#pragma unroll
  for (int i = 0; i < kRmsMaxV; ++i) {
    const int vi = gt + i * G;
    if (vi < nv) {
#pragma unroll
      for (int j = 0; j < V; ++j) dw_part[chunk * h + vi * V + j] = dw[j * nv + vi];
    }
  }
}

// The fixed column-sum tree in one launch: level-1 row q of column c adds part[c' , c] for chunks
// c' in [32 q, 32 q + 32) in order, and each level above adds 32 consecutive rows of the one below
// in order, until one row (grad_weight) is left. So grad_weight is a fixed tree over chunks that
// depends only on the number of rows. Block (q, slice) computes level-1 row q of 128 columns; the
// last block of a slice to finish (counted in done[slice], which the backward kernel cleared) adds
// the levels above for its columns, one thread a column, each level in place over `level`. One
// launch instead of one a level (three launches of 2-3 us at 32768 rows of 4096).
constexpr int kRmsFanIn = 32;
constexpr int kRmsTreeThreads = 128;

// Rows [first, end) of column col of src (row stride h), end - first <= 32, added in order from
// zero. The loads are issued together before the adds, so their latencies overlap (a loop of
// load-then-add waits out one L2 round trip per row: 16 us a launch at 32768 rows).
__device__ __forceinline__ float add_column_rows(const float* src, int64_t first, int64_t end, int h, int col) {
  float v[kRmsFanIn];
#pragma unroll
  for (int i = 0; i < kRmsFanIn; ++i) v[i] = first + i < end ? __ldcg(src + (first + i) * h + col) : 0.f;
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < kRmsFanIn; ++i)
    if (first + i < end) s = s + v[i];
  return s;
}

__global__ void __launch_bounds__(kRmsTreeThreads)
    rlk_rmsnorm_column_tree_kernel(const float* __restrict__ part, int64_t n, int h, float* level,
                                   float* __restrict__ out, unsigned* __restrict__ done) {
  __shared__ bool last;
  const int64_t rows1 = (n + kRmsFanIn - 1) / kRmsFanIn, q = blockIdx.x;
  const int col = blockIdx.y * kRmsTreeThreads + threadIdx.x;
  if (col < h)
    (rows1 == 1 ? out : level)[q * h + col] = add_column_rows(part, q * kRmsFanIn, min(n, (q + 1) * kRmsFanIn), h, col);
  if (rows1 == 1) return;
  __threadfence();  // this block's level-1 values are visible before it is counted
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(done + blockIdx.y, 1u) == rows1 - 1;
  __syncthreads();
  if (!last || col >= h) return;
  __threadfence();
  for (int64_t m = rows1; m > 1;) {
    const int64_t up = (m + kRmsFanIn - 1) / kRmsFanIn;
    float* dst = up == 1 ? out : level;
    // Row u is written after rows [32 u, 32 u + 32) are read, and no later row reads below 32 u + 32.
    for (int64_t u = 0; u < up; ++u)
      dst[u * h + col] = add_column_rows(level, u * kRmsFanIn, min(m, (u + 1) * kRmsFanIn), h, col);
    m = up;
  }
}

}  // namespace rl_engine::cuda
