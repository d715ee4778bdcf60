// RMSNorm for Hopper: out[r, i] = (x[r, i] * rstd[r]) * w[i], rstd[r] = rsqrt(sum_i x^2 / H + eps).
//
// A row is handled by a group of G threads (G = 16, 32, 128, 512 or 1024, chosen from H alone):
// thread g takes vectors g, g + G, ... of V elements (16-byte accesses when the row allows), sums
// squares in that order, then the group adds through group_sum's fixed tree. So the reduction tree
// of a row depends only on H and the dtype, never on the number of rows or the row's position.
// The row stays in registers, packed, between the two passes.
//
// Backward: each group walks `subs` consecutive chunks of kRmsChunk rows in order, writing grad_x
// and adding g * (x * rstd) into its own per-column slots in shared memory, one chunk at a time from
// zero; it adds its chunks' sums in order and writes that partial to memory, and
// rlk_rmsnorm_column_tree_kernel adds the partials, 32 consecutive ones at a time in order, level by
// level. grad_weight therefore sums rows through a fixed tree anchored at row 0 whose shape depends
// on the number of rows (and, for very wide rows, on H: rms_bwd_subs), never on the device.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "rl_engine/cuda/types.cuh"

namespace rl_engine::cuda {

constexpr int kRmsChunk = 16;
constexpr int kRmsMaxV = 4;  // vectors per thread

// Chunks one backward group walks: 1, 2 or 4, the most that leave at least 512 groups. Each group
// writes one fp32 row of partials (4 H bytes) and the column tree reads it back, against the 6 H
// bytes a row of bf16 moves: at one chunk a group those two are 8% of the op's traffic, at four
// 2%. 512 groups keep the H200's 528 group slots at H = 4096 (two blocks of two groups an SM) about
// full. The shape of the sum depends on the number of rows (and, past H = 29040, on H), never on
// the device. A group's two rows of H floats (this chunk's sums and the running one) must fit the
// block's 227 KB of shared memory beside its other groups' and the kernel's static red[32]: at one
// group a block, H above 29040 walks one chunk.
inline int rms_bwd_subs(int64_t rows, int64_t h, int groups_per_block) {
  constexpr int64_t kDynamicLimit = 227 * 1024 - 32 * static_cast<int64_t>(sizeof(float));
  const int64_t per = rows / (512 * kRmsChunk);
  if (2 * groups_per_block * h * static_cast<int64_t>(sizeof(float)) > kDynamicLimit) return 1;
  return per >= 4 ? 4 : per >= 2 ? 2 : 1;
}

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
// dw_part[group, i] = ((0 + s_0) + s_1) ... over the group's chunks, s_c the sum over chunk c's rows,
// in row order from zero, of g * (x * rstd) (with one chunk, dw_part is s_0 itself). Dynamic shared
// memory: (blockDim.x / G) * h floats, twice that when subs > 1 (the running sum of the chunks).
// Two 256-thread blocks per SM for the narrow groups, each group with two rows in flight (the one it
// reduces and the next), within 128 registers a thread.
template <typename T, int G, int V>
__global__ void __launch_bounds__(rms_block<G>(), G <= 128 ? 2 : 1)
    rlk_rmsnorm_bwd_kernel(const T* __restrict__ g, const T* __restrict__ x, const T* __restrict__ w,
                       const float* __restrict__ rstd, T* __restrict__ dx, float* __restrict__ dw_part,
                       int64_t rows, int h, float inv_h, int subs, unsigned* __restrict__ tree_done,
                       int tree_slices) {
  __shared__ float red[32];
  // The column tree's counters (rlk_rmsnorm_column_tree_kernel runs next in the stream).
  if (blockIdx.x == 0)
    for (int i = threadIdx.x; i < tree_slices; i += blockDim.x) tree_done[i] = 0;
  extern __shared__ float dw_smem[];
  const int gt = threadIdx.x % G;
  const int span = kRmsChunk * subs;  // rows a group walks
  const int64_t group = static_cast<int64_t>(blockIdx.x) * (blockDim.x / G) + threadIdx.x / G;
  const int64_t first = group * span;
  const bool live = first < rows;
  // This group's columns, slot (j, vi) for column vi * V + j: each slot has one owner thread, and
  // neighbouring lanes hit neighbouring banks. tot (subs > 1) holds the sum of the chunks so far.
  float* dw = dw_smem + (threadIdx.x / G) * h;
  float* tot = dw_smem + (blockDim.x / G + threadIdx.x / G) * h;
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
    const int64_t row = first + r;
    if (row >= rows) return;
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
  for (int r = 0; r < span; ++r) {  // same trip count in every group: group_sum syncs
    const int64_t row = first + r;
    const bool valid = row < rows;
    Raw<T, V> gv[kRmsMaxV], xv[kRmsMaxV];
#pragma unroll
    for (int i = 0; i < kRmsMaxV; ++i) gv[i] = gn[i], xv[i] = xn[i];
    if (r + 1 < span) load_row(r + 1, gn, xn);
    float dot = 0.f;
#pragma unroll
    for (int i = 0; i < kRmsMaxV; ++i) {
      if (valid && gt + i * G < nv) {
#pragma unroll
        for (int j = 0; j < V; ++j) dot = fmaf(gv[i].get(j) * wv[i].get(j), xv[i].get(j), dot);
      }
    }
    const float total = group_sum<G>(dot, red);
    if (valid) {
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
    // The end of a chunk that has rows: its sum joins the running one, and the next starts at zero.
    const int64_t chunk_first = first + r / kRmsChunk * kRmsChunk;
    if (subs > 1 && r % kRmsChunk == kRmsChunk - 1 && chunk_first < rows) {
#pragma unroll
      for (int i = 0; i < kRmsMaxV; ++i) {
        const int vi = gt + i * G;
        if (vi < nv) {
#pragma unroll
          for (int j = 0; j < V; ++j) {
            tot[j * nv + vi] = (r < kRmsChunk ? 0.f : tot[j * nv + vi]) + dw[j * nv + vi];
            dw[j * nv + vi] = 0.f;
          }
        }
      }
    }
  }
  if (!live) return;
  const float* sum = subs > 1 ? tot : dw;
#pragma unroll
  for (int i = 0; i < kRmsMaxV; ++i) {
    const int vi = gt + i * G;
    if (vi < nv) {
#pragma unroll
      for (int j = 0; j < V; ++j) dw_part[group * h + vi * V + j] = sum[j * nv + vi];
    }
  }
}

// The fixed column-sum tree in one launch: level-1 row q of column c adds part[c', c] for group
// partials c' in [32 q, 32 q + 32) in order, and each level above adds 32 consecutive rows of the
// one below in order, until one row (grad_weight) is left: a fixed tree over the group partials
// that depends only on their number. Block (q, slice) computes level-1 row q of 128 columns; the
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
