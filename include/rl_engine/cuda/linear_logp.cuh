// Selected-token log-prob pieces for Hopper, without [T, V] logits.
//
// Forward: the det_gemm main loop computes a 64 x 256 logit fragment per consumer warpgroup; the
// LogpTileEpilogue turns it into (max, sum exp(logit - max)) of each sub-tile of `sub` columns
// (sub = 64, 128 or 256, aligned to the shard's column 0, which is aligned to absolute vocab ids),
// plus the target's logit. rlk_linear_logp_tree_kernel then folds the sub-tiles of each vocab tile in
// vocab order and merges the tiles through the fixed binary tree; rlk_linear_logp_combine_kernel merges
// shard roots through the upper levels of the same tree. Every merge is lse_merge, so a 2^k-way
// vocab split followed by logp_combine gives the bits of the unsplit call.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "rl_engine/cuda/det_gemm.cuh"
#include "rl_engine/cuda/types.cuh"

namespace rl_engine::cuda {

// The one merge rule of (max, sumexp) pairs. Explicit _rn operations keep the compiler from
// contracting it differently in different kernels; a padding side (max = -inf) is exactly neutral.
__device__ __forceinline__ float2 lse_merge(float2 a, float2 b) {
  if (b.x == kNegInf) return a;
  if (a.x == kNegInf) return b;
  const float m = fmaxf(a.x, b.x);
  return make_float2(m, __fadd_rn(__fmul_rn(a.y, __expf(a.x - m)), __fmul_rn(b.y, __expf(b.x - m))));
}

__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

// Sum over the 4 lanes that share a fragment row; commutativity gives all four the same bits.
__device__ __forceinline__ float quad_sum(float v) {
  v = v + __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

__device__ __forceinline__ float sel4(const float (&v)[4], int i) {
  return i == 0 ? v[0] : i == 1 ? v[1] : i == 2 ? v[2] : v[3];
}

struct LogpTileEpilogue {
  float2* part;           // [T, part_ld]: (max, sumexp) of sub-tile p of the shard
  int64_t part_ld;        // n_blocks * 256 / sub
  float* target_logit;    // [T], -inf beforehand
  const int64_t* target;  // [T] absolute ids
  int64_t vocab_start;
  int sub;                // 64, 128 or 256

  // Order inside a sub-tile, fixed by column index only: each thread takes its values in column
  // order (per 64-column group), groups are added pairwise, then the 4 lanes of the row add up.
  __device__ __forceinline__ void operator()(const float (&acc)[128], int row0, int col0, int m,
                                             int n) const {
    const int t = threadIdx.x % 128, lane = t % 32, q = lane % 4;
    const int cq = col0 + 2 * q;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row0 + (t / 32) * 16 + lane / 4 + 8 * h;
      float g[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        float mx = kNegInf;
#pragma unroll
        for (int j = 8 * u; j < 8 * u + 8; ++j) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            if (cq + 8 * j + e < n) mx = fmaxf(mx, acc[4 * j + 2 * h + e]);
          }
        }
        g[u] = mx;
      }
      float mu[4];  // the max of the sub-tile that holds each 64-column group
      if (sub == 64) {
#pragma unroll
        for (int u = 0; u < 4; ++u) mu[u] = quad_max(g[u]);
      } else if (sub == 128) {
        mu[0] = mu[1] = quad_max(fmaxf(g[0], g[1]));
        mu[2] = mu[3] = quad_max(fmaxf(g[2], g[3]));
      } else {
        mu[0] = mu[1] = mu[2] = mu[3] = quad_max(fmaxf(fmaxf(g[0], g[1]), fmaxf(g[2], g[3])));
      }
      float s64[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        float s = 0.f;
#pragma unroll
        for (int j = 8 * u; j < 8 * u + 8; ++j) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            if (cq + 8 * j + e < n) s = s + __expf(acc[4 * j + 2 * h + e] - mu[u]);
          }
        }
        s64[u] = s;
      }
      float so[4];
      if (sub == 64) {
#pragma unroll
        for (int u = 0; u < 4; ++u) so[u] = quad_sum(s64[u]);
      } else if (sub == 128) {
        so[0] = quad_sum(s64[0] + s64[1]);
        so[1] = quad_sum(s64[2] + s64[3]);
        so[2] = so[3] = 0.f;
      } else {
        so[0] = quad_sum((s64[0] + s64[1]) + (s64[2] + s64[3]));
        so[1] = so[2] = so[3] = 0.f;
      }
      if (row >= m) continue;
      const int nsub = 256 / sub;
      if (q < nsub) {
        const float mq = sel4(mu, q * (sub / 64));
        // An all-padding sub-tile has max -inf and sum 0 (its exp terms were skipped).
        part[row * part_ld + col0 / sub + q] = make_float2(mq, mq == kNegInf ? 0.f : sel4(so, q));
      }
      const int64_t tl = target[row] - vocab_start;
      if (tl >= cq && tl < col0 + 256 && tl < n) {
#pragma unroll
        for (int j = 0; j < 32; ++j) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            if (cq + 8 * j + e == tl) target_logit[row] = acc[4 * j + 2 * h + e];
          }
        }
      }
    }
  }
};

// Backward: the recomputed logit tile turned into dlogit[r, c] = grad[r] * (1[id0 + c == target[r]] -
// exp(logit - lse[r])) in registers and stored rounded once to Out, so the chunk's fp32 logits
// never reach memory. The same operations on the same fp32 logits as
// rlk_linear_logp_dlogit_kernel, so the same bits; both spell them as round-to-nearest intrinsics,
// which the compiler may not fuse into other operations, so that it cannot compile the two apart.
template <typename Out>
struct DlogitEpilogue {
  StoreEpilogue<Out> store;  // dlogit [T, ldd] of one vocab chunk, no bias, no accumulate
  const int64_t* target;     // [T] absolute ids
  const float* lse;          // [T]
  const float* grad;         // [T]
  int64_t id0;               // the absolute id of the chunk's column 0

  __device__ __forceinline__ void operator()(const float (&acc)[128], int row0, int col0, int m,
                                             int n) const {
    const int t = threadIdx.x % 128;
    const int r = row0 + (t / 32) * 16 + (t % 32) / 4, cq = col0 + (t % 4) * 2;
    float l[2], g[2];
    int tc[2];  // the target's column in the chunk, -1 where it is in another chunk (an int compare
                // a value instead of a 64-bit one)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = r + 8 * h;
      const bool in = row < m;
      l[h] = in ? lse[row] : 0.f;
      g[h] = in ? grad[row] : 0.f;
      const int64_t col = in ? target[row] - id0 : -1;
      tc[h] = col >= 0 && col < n ? static_cast<int>(col) : -1;
    }
    // Four 8-column blocks at a time, each stored as soon as it is made: a whole second fragment
    // would not fit in the registers beside the accumulator.
#pragma unroll
    for (int q = 0; q < 8; ++q) {
      float d[16];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int j = 4 * q + i;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float p = __expf(__fsub_rn(acc[4 * j + 2 * h + e], l[h]));
            d[4 * i + 2 * h + e] = __fmul_rn(g[h], __fsub_rn(cq + 8 * j + e == tc[h] ? 1.f : 0.f, p));
          }
        }
      }
      store(d, row0, col0 + 32 * q, m, n);
    }
  }
};

// One block per row: fold the sub-tiles of each vocab tile in vocab order, then merge the tiles
// pairwise level by level (ping-pong in shared memory: num_tiles * 1.5 float2).
__global__ void __launch_bounds__(256)
    rlk_linear_logp_tree_kernel(const float2* part, int64_t part_ld, int64_t parts_valid, int subs_per_tile,
                         int num_tiles, int64_t rows, float* out_max, float* out_sum) {
  extern __shared__ float2 nodes[];
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const float2* p = part + row * part_ld;
    for (int i = threadIdx.x; i < num_tiles; i += blockDim.x) {
      float2 acc = make_float2(kNegInf, 0.f);
      for (int s = 0; s < subs_per_tile; ++s) {
        const int64_t idx = static_cast<int64_t>(i) * subs_per_tile + s;
        if (idx < parts_valid) acc = lse_merge(acc, p[idx]);
      }
      nodes[i] = acc;
    }
    __syncthreads();
    float2* src = nodes;
    float2* dst = nodes + num_tiles;
    for (int w = num_tiles / 2; w >= 1; w /= 2) {
      for (int i = threadIdx.x; i < w; i += blockDim.x) dst[i] = lse_merge(src[2 * i], src[2 * i + 1]);
      __syncthreads();
      float2* tmp = src;
      src = dst;
      dst = tmp;
    }
    if (threadIdx.x == 0) {
      out_max[row] = src[0].x;
      out_sum[row] = src[0].y;
    }
    __syncthreads();
  }
}

// fp32 path: (max, sumexp) of sub-tiles of `sub` columns of a materialised logit chunk
// [rows, cols] (one thread per row and sub-tile, columns in order), plus the target's logit.
__global__ void rlk_linear_logp_subtile_kernel(const float* logits, int64_t ld, int64_t rows, int cols, int sub,
                                      float2* part, int64_t part_ld, int64_t part_col0,
                                      const int64_t* target, int64_t id0, float* target_logit) {
  const int nsub = (cols + sub - 1) / sub;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= rows * nsub) return;
  const int64_t row = idx / nsub;
  const int u = static_cast<int>(idx % nsub);
  const float* l = logits + row * ld;
  const int c1 = min(cols, (u + 1) * sub);
  float m = kNegInf;
  for (int c = u * sub; c < c1; ++c) m = fmaxf(m, l[c]);
  float s = 0.f;
  if (m != kNegInf) {
    for (int c = u * sub; c < c1; ++c) s = s + __expf(l[c] - m);
  }
  part[row * part_ld + part_col0 + u] = make_float2(m, s);
  const int64_t tl = target[row] - id0;
  if (u == 0 && tl >= 0 && tl < cols) target_logit[row] = l[tl];
}

// logp[t] = target - lse, lse = m + log(s), after merging R shard roots [R, T] pairwise in shard
// order (R a power of two, at most 64); the target logit is finite in exactly one shard.
__global__ void rlk_linear_logp_combine_kernel(const float* mx, const float* se, const float* tl, int r_dim,
                                    int64_t t_dim, float* logp, float* lse) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= t_dim) return;
  float2 nodes[64];
  float target = kNegInf;
  for (int r = 0; r < r_dim; ++r) {
    nodes[r] = make_float2(mx[r * t_dim + t], se[r * t_dim + t]);
    target = fmaxf(target, tl[r * t_dim + t]);
  }
  for (int w = r_dim / 2; w >= 1; w /= 2) {
    for (int i = 0; i < w; ++i) nodes[i] = lse_merge(nodes[2 * i], nodes[2 * i + 1]);
  }
  const float l = nodes[0].x + static_cast<float>(log(static_cast<double>(nodes[0].y)));
  lse[t] = l;
  logp[t] = target - l;
}

// Backward: dlogit[r, c] = grad[r] * (1[id0 + c == target[r]] - exp(logit - lse[r])), rounded once
// to Out; columns cols..ldd-1 are zero (padding for the next GEMM's 16-byte rows).
template <typename Out>
__global__ void rlk_linear_logp_dlogit_kernel(const float* logits, int64_t ld, int64_t rows, int cols, int64_t ldd,
                              int64_t id0, const int64_t* target, const float* lse, const float* grad,
                              Out* dl) {
  const int64_t total = rows * ldd;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / ldd;
    const int c = static_cast<int>(i % ldd);
    float d = 0.f;
    if (c < cols) {
      const float p = __expf(__fsub_rn(logits[r * ld + c], lse[r]));
      d = __fmul_rn(grad[r], __fsub_rn(id0 + c == target[r] ? 1.f : 0.f, p));
    }
    dl[i] = from_float<Out>(d);
  }
}

}  // namespace rl_engine::cuda
