// SwiGLU for Hopper: gate_up[t] = [gate | up] (2I values), out[t, i] = silu(gate[i]) * up[i] with
// silu(g) = g / (1 + exp(-g)), in fp32 with one rounding. Elementwise, 16-byte accesses when I
// allows, so every value depends only on its own inputs (batch invariant by construction).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "rl_engine/cuda/types.cuh"

namespace rl_engine::cuda {

// Two grid-stride items per trip, both loaded before either is computed, for more bytes in flight.
constexpr int kSwigluItems = 2;

// gate_up [T, 2I], out [T, I]; V divides I.
template <typename T, int V>
__global__ void __launch_bounds__(256)
    rlk_swiglu_kernel(const T* __restrict__ gate_up, T* __restrict__ out, int64_t tokens, int inter) {
  const int per_token = inter / V;
  const int64_t total = tokens * per_token, stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; base < total;
       base += kSwigluItems * stride) {
    Raw<T, V> g[kSwigluItems], u[kSwigluItems];
#pragma unroll
    for (int k = 0; k < kSwigluItems; ++k) {
      const int64_t idx = base + k * stride;
      if (idx < total) {
        const T* gate = gate_up + (idx / per_token) * 2 * inter + (idx % per_token) * V;
        g[k].load(gate);
        u[k].load(gate + inter);
      }
    }
#pragma unroll
    for (int k = 0; k < kSwigluItems; ++k) {
      const int64_t idx = base + k * stride;
      if (idx < total) {
        float o[V];
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const float gj = g[k].get(j);
          o[j] = (gj / (1.f + __expf(-gj))) * u[k].get(j);
        }
        store_f32<T, V>(out + (idx / per_token) * inter + (idx % per_token) * V, o);
      }
    }
  }
}

// d gate = ((dy * up) * sig) * (1 + g (1 - sig)), d up = dy * (g / e), e = 1 + exp(-g), sig = 1 / e:
// the factors and order of the CPU kernel. grad [T, 2I].
template <typename T, int V>
__global__ void __launch_bounds__(256)
    rlk_swiglu_bwd_kernel(const T* __restrict__ grad_out, const T* __restrict__ gate_up,
                      T* __restrict__ grad, int64_t tokens, int inter) {
  const int per_token = inter / V;
  const int64_t total = tokens * per_token, stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; base < total;
       base += kSwigluItems * stride) {
    Raw<T, V> g[kSwigluItems], u[kSwigluItems], dy[kSwigluItems];
#pragma unroll
    for (int k = 0; k < kSwigluItems; ++k) {
      const int64_t idx = base + k * stride;
      if (idx < total) {
        const int64_t t = idx / per_token, i0 = (idx % per_token) * V;
        g[k].load(gate_up + t * 2 * inter + i0);
        u[k].load(gate_up + t * 2 * inter + inter + i0);
        dy[k].load(grad_out + t * inter + i0);
      }
    }
#pragma unroll
    for (int k = 0; k < kSwigluItems; ++k) {
      const int64_t idx = base + k * stride;
      if (idx < total) {
        const int64_t row = (idx / per_token) * 2 * inter + (idx % per_token) * V;
        float dg[V], du[V];
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const float gj = g[k].get(j), dyj = dy[k].get(j);
          const float e = 1.f + __expf(-gj);
          const float sig = 1.f / e;
          dg[j] = ((dyj * u[k].get(j)) * sig) * __fadd_rn(1.f, gj * (1.f - sig));
          du[j] = dyj * (gj / e);
        }
        store_f32<T, V>(grad + row, dg);
        store_f32<T, V>(grad + row + inter, du);
      }
    }
  }
}

}  // namespace rl_engine::cuda
