// SwiGLU for Hopper: gate_up[t] = [gate | up] (2I values), out[t, i] = silu(gate[i]) * up[i] with
// silu(g) = g / (1 + exp(-g)), in fp32 with one rounding. Elementwise, 16-byte accesses when I
// allows, so every value depends only on its own inputs (batch invariant by construction).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "rl_engine/cuda/types.cuh"

namespace rl_engine::cuda {

// gate_up [T, 2I], out [T, I]; V divides I. Grid-stride over (token, vector).
template <typename T, int V>
__global__ void __launch_bounds__(256)
    swiglu_kernel(const T* gate_up, T* out, int64_t tokens, int inter) {
  const int per_token = inter / V;
  const int64_t total = tokens * per_token;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = idx / per_token;
    const int i0 = static_cast<int>(idx % per_token) * V;
    const T* gate = gate_up + t * 2 * inter + i0;
    float g[V], u[V], o[V];
    load_f32<T, V>(gate, g);
    load_f32<T, V>(gate + inter, u);
#pragma unroll
    for (int j = 0; j < V; ++j) o[j] = (g[j] / (1.f + __expf(-g[j]))) * u[j];
    store_f32<T, V>(out + t * inter + i0, o);
  }
}

// d gate = ((dy * up) * sig) * (1 + g (1 - sig)), d up = dy * (g / e), e = 1 + exp(-g), sig = 1 / e:
// the factors and order of the CPU kernel. grad [T, 2I].
template <typename T, int V>
__global__ void __launch_bounds__(256)
    swiglu_bwd_kernel(const T* grad_out, const T* gate_up, T* grad, int64_t tokens, int inter) {
  const int per_token = inter / V;
  const int64_t total = tokens * per_token;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = idx / per_token;
    const int i0 = static_cast<int>(idx % per_token) * V;
    const int64_t row = t * 2 * inter + i0;
    float g[V], u[V], dy[V], dg[V], du[V];
    load_f32<T, V>(gate_up + row, g);
    load_f32<T, V>(gate_up + row + inter, u);
    load_f32<T, V>(grad_out + t * inter + i0, dy);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float e = 1.f + __expf(-g[j]);
      const float sig = 1.f / e;
      dg[j] = ((dy[j] * u[j]) * sig) * __fadd_rn(1.f, g[j] * (1.f - sig));
      du[j] = dy[j] * (g[j] / e);
    }
    store_f32<T, V>(grad + row, dg);
    store_f32<T, V>(grad + row + inter, du);
  }
}

}  // namespace rl_engine::cuda
