// Rotary embedding (Qwen3 / NeoX rotate-half) for Hopper. For token t at position p and i < D/2:
// angle = float(p) * inv_freq[i] in fp32, c = cos(angle), s = sign * sin(angle), and
//   out[i] = x[i] c - x[i + D/2] s,   out[i + D/2] = x[i + D/2] c + x[i] s.
// cos and sin are evaluated in double precision from the fp32 angle and rounded once, so they are
// accurate for large positions (fast single-precision sin/cos are not). One thread owns V
// frequencies of one token and walks its heads, so each (token, i) pair costs one sincos. The
// arithmetic of an element depends only on its values and its position: batch invariant.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "rl_engine/cuda/types.cuh"

namespace rl_engine::cuda {

// x, out [T, heads, D] contiguous; positions [T]; inv_freq fp32 [D/2]; sign +1 forward, -1 for
// the inverse rotation (the backward). V divides D/2.
template <typename T, int V>
__global__ void __launch_bounds__(256)
    rope_kernel(const T* x, const int64_t* positions, const float* inv_freq, float sign, T* out,
                int64_t tokens, int heads, int d) {
  const int half = d / 2, per_token = half / V;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= tokens * per_token) return;
  const int64_t t = idx / per_token;
  const int i0 = static_cast<int>(idx % per_token) * V;
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
#pragma unroll 4
  for (int hd = 0; hd < heads; ++hd) {
    const int64_t off = (t * heads + hd) * d + i0;
    float x1[V], x2[V], o1[V], o2[V];
    load_f32<T, V>(x + off, x1);
    load_f32<T, V>(x + off + half, x2);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      o1[j] = __fsub_rn(x1[j] * c[j], x2[j] * s[j]);
      o2[j] = __fadd_rn(x2[j] * c[j], x1[j] * s[j]);
    }
    store_f32<T, V>(out + off, o1);
    store_f32<T, V>(out + off + half, o2);
  }
}

}  // namespace rl_engine::cuda
