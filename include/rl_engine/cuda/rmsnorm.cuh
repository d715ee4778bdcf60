// RMSNorm for Hopper: out[r, i] = (x[r, i] * rstd[r]) * w[i], rstd[r] = rsqrt(sum_i x^2 / H + eps).
//
// A row is handled by a group of G threads (G = 32, 128 or 512, chosen from H alone): thread g
// takes vectors g, g + G, ... of V elements (16-byte accesses when the row allows), sums squares in
// that order, then the group adds through group_sum's fixed tree. So the reduction tree of a row
// depends only on H and the dtype, never on the number of rows or the row's position.
//
// Backward: each group walks a fixed chunk of kRmsChunk rows in order, writing grad_x and keeping
// a per-column partial of g * (x * rstd); rmsnorm_column_sum_kernel adds the chunk partials in
// chunk order. grad_weight therefore sums rows in a fixed order anchored at row 0.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "rl_engine/cuda/types.cuh"

namespace rl_engine::cuda {

constexpr int kRmsChunk = 16;

template <typename T, int G, int kMaxV, int V>
__global__ void __launch_bounds__(G > 256 ? G : 256)
    rmsnorm_fwd_kernel(const T* x, const T* w, T* out, float* rstd, int64_t rows, int h, float inv_h,
                       float eps) {
  __shared__ float red[32];
  const int gt = threadIdx.x % G;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / G) + threadIdx.x / G;
  const bool valid = row < rows;
  const int nv = h / V;
  const T* xr = x + row * h;
  float xv[kMaxV][V];
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < kMaxV; ++i) {
    const int vi = gt + i * G;
    if (valid && vi < nv) {
      load_f32<T, V>(xr + vi * V, xv[i]);
#pragma unroll
      for (int j = 0; j < V; ++j) ss = fmaf(xv[i][j], xv[i][j], ss);
    }
  }
  const float total = group_sum<G>(ss, red);
  if (!valid) return;
  const float rs = rsqrtf(total * inv_h + eps);
  if (gt == 0) rstd[row] = rs;
  T* o = out + row * h;
#pragma unroll
  for (int i = 0; i < kMaxV; ++i) {
    const int vi = gt + i * G;
    if (vi < nv) {
      float wv[V], ov[V];
      load_f32<T, V>(w + vi * V, wv);
#pragma unroll
      for (int j = 0; j < V; ++j) ov[j] = (xv[i][j] * rs) * wv[j];
      store_f32<T, V>(o + vi * V, ov);
    }
  }
}

// dx = rstd * (g w - x * c), c = ((sum_j (g_j w_j) x_j) * rstd) * rstd / H, as the CPU kernel;
// dw_part[chunk, i] = sum over the chunk's rows, in row order, of g * (x * rstd).
template <typename T, int G, int kMaxV, int V>
__global__ void __launch_bounds__(G > 256 ? G : 256)
    rmsnorm_bwd_kernel(const T* g, const T* x, const T* w, const float* rstd, T* dx, float* dw_part,
                       int64_t rows, int h, float inv_h) {
  __shared__ float red[32];
  const int gt = threadIdx.x % G;
  const int64_t chunk = static_cast<int64_t>(blockIdx.x) * (blockDim.x / G) + threadIdx.x / G;
  const int64_t chunks = (rows + kRmsChunk - 1) / kRmsChunk;
  const int nv = h / V;
  float wv[kMaxV][V], dw[kMaxV][V];
#pragma unroll
  for (int i = 0; i < kMaxV; ++i) {
    const int vi = gt + i * G;
#pragma unroll
    for (int j = 0; j < V; ++j) wv[i][j] = dw[i][j] = 0.f;
    if (vi < nv) load_f32<T, V>(w + vi * V, wv[i]);
  }
  for (int r = 0; r < kRmsChunk; ++r) {  // same trip count in every group: group_sum syncs
    const int64_t row = chunk * kRmsChunk + r;
    const bool valid = chunk < chunks && row < rows;
    float gv[kMaxV][V], xv[kMaxV][V];
    float dot = 0.f;
#pragma unroll
    for (int i = 0; i < kMaxV; ++i) {
      const int vi = gt + i * G;
      if (valid && vi < nv) {
        load_f32<T, V>(g + row * h + vi * V, gv[i]);
        load_f32<T, V>(x + row * h + vi * V, xv[i]);
#pragma unroll
        for (int j = 0; j < V; ++j) dot = fmaf(gv[i][j] * wv[i][j], xv[i][j], dot);
      }
    }
    const float total = group_sum<G>(dot, red);
    if (!valid) continue;
    const float rs = rstd[row];
    const float c = ((total * rs) * rs) * inv_h;
#pragma unroll
    for (int i = 0; i < kMaxV; ++i) {
      const int vi = gt + i * G;
      if (vi < nv) {
        float dv[V];
#pragma unroll
        for (int j = 0; j < V; ++j) {
          dv[j] = rs * __fsub_rn(gv[i][j] * wv[i][j], xv[i][j] * c);
          dw[i][j] = fmaf(gv[i][j], xv[i][j] * rs, dw[i][j]);
        }
        store_f32<T, V>(dx + row * h + vi * V, dv);
      }
    }
  }
  if (chunk >= chunks) return;
#pragma unroll
  for (int i = 0; i < kMaxV; ++i) {
    const int vi = gt + i * G;
    if (vi < nv) {
#pragma unroll
      for (int j = 0; j < V; ++j) dw_part[chunk * h + vi * V + j] = dw[i][j];
    }
  }
}

// dw[i] = sum of dw_part[c, i] over chunks c = 0, 1, ... in order.
__global__ void rmsnorm_column_sum_kernel(const float* dw_part, int64_t chunks, int h, float* dw) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= h) return;
  float s = 0.f;
#pragma unroll 8
  for (int64_t c = 0; c < chunks; ++c) s = s + dw_part[c * h + i];
  dw[i] = s;
}

}  // namespace rl_engine::cuda
