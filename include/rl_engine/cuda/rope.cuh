// Rotary embedding (Qwen3 / NeoX rotate-half) for Hopper. For token t at position p and i < D/2:
// angle = float(p) * inv_freq[i] in fp32, c = cos(angle), s = sign * sin(angle), and
//   out[i] = x[i] c - x[i + D/2] s,   out[i + D/2] = x[i + D/2] c + x[i] s.
// cos and sin are evaluated in double precision from the fp32 angle and rounded once, so they are
// accurate for large positions (fast single-precision sin/cos are not). One thread owns V
// frequencies of one token for a group of heads, so one sincos serves kRopeHeads heads. The
// arithmetic of an element depends only on its values and its position: batch invariant.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "rl_engine/cuda/types.cuh"

namespace rl_engine::cuda {

constexpr int kRopeHeads = 8;  // heads per thread: one sincos serves all of them
constexpr int kRopeBatch = 4;  // heads loaded before any is stored

// x, out [T, heads, D] contiguous; positions [T]; inv_freq fp32 [D/2]; sign +1 forward, -1 for
// the inverse rotation (the backward). V divides D/2. Thread order: frequency chunk fastest, then
// head group, then token, so neighbouring threads touch neighbouring 16-byte pieces.
template <typename T, int V>
__global__ void __launch_bounds__(256, 3)
    rlk_rope_kernel(const T* __restrict__ x, const int64_t* __restrict__ positions,
                const float* __restrict__ inv_freq, float sign, T* __restrict__ out, int64_t tokens,
                int heads, int d) {
  const int half = d / 2, chunks = half / V, groups = (heads + kRopeHeads - 1) / kRopeHeads;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= tokens * groups * chunks) return;
  const int64_t t = idx / (groups * chunks);
  const int rem = static_cast<int>(idx % (groups * chunks));
  const int h0 = (rem / chunks) * kRopeHeads, i0 = (rem % chunks) * V;
  const float p = static_cast<float>(positions[t]);
  float c[V], s[V];
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const float angle = p * inv_freq[i0 + j];
    double sd, cd;
    sincos(static_cast<double>(angle), &sd, &cd);
    c[j] = static_cast<float>(cd);
    s[j] = sign * static_cast<float>(sd);
  }
#pragma unroll
  for (int b = 0; b < kRopeHeads; b += kRopeBatch) {
    Raw<T, V> x1[kRopeBatch], x2[kRopeBatch];
#pragma unroll
    for (int u = 0; u < kRopeBatch; ++u) {
      if (h0 + b + u < heads) {
        const int64_t off = (t * heads + h0 + b + u) * d + i0;
        x1[u].load(x + off);
        x2[u].load(x + off + half);
      }
    }
#pragma unroll
    for (int u = 0; u < kRopeBatch; ++u) {
      if (h0 + b + u < heads) {
        const int64_t off = (t * heads + h0 + b + u) * d + i0;
        float o1[V], o2[V];
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const float a = x1[u].get(j), e = x2[u].get(j);
          o1[j] = __fsub_rn(a * c[j], e * s[j]);
          o2[j] = __fadd_rn(e * c[j], a * s[j]);
        }
        store_f32<T, V>(out + off, o1);
        store_f32<T, V>(out + off + half, o2);
      }
    }
  }
}

}  // namespace rl_engine::cuda
