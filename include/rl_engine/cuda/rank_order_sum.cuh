// Rank-order sum for Hopper, the payload sum of the fixed-order collectives:
// ``out[i] = (((parts[0][i] + parts[1][i]) + parts[2][i]) + ...) + parts[R-1][i]`` in fp32,
// elementwise, rows added in index order. Each add is IEEE round-to-nearest-even with subnormals
// kept and no contraction, so the bits equal the CPU kernel's for every input, whatever the build
// flags (--use_fast_math flushes subnormals of plain float adds to zero).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "rl_engine/cuda/types.cuh"

namespace rl_engine::cuda {

// a + b rounded to nearest even; no .ftz, so subnormal inputs and results are kept.
__device__ __forceinline__ float rank_order_add(float a, float b) {
  float c;
  asm("add.rn.f32 %0, %1, %2;" : "=f"(c) : "f"(a), "f"(b));
  return c;
}

// V fp32 values to p: 16-byte stores when V is a multiple of 4 (p then 16-byte aligned).
template <int V>
__device__ __forceinline__ void rank_order_store(float* p, const float (&v)[V]) {
  if constexpr (V % 4 == 0) {
#pragma unroll
    for (int j = 0; j < V; j += 4) {
      *reinterpret_cast<float4*>(p + j) = make_float4(v[j], v[j + 1], v[j + 2], v[j + 3]);
    }
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) p[j] = v[j];
  }
}

// parts [ranks, numel] (row-major, contiguous), out fp32 [numel]. Each thread owns V consecutive
// elements (V divides numel; rows 16-byte aligned when V fills 16 bytes) and walks the ranks in
// order, so an element's sum never depends on the grid, the block or the vector width.
template <typename T, int V>
__global__ void __launch_bounds__(256)
    rlk_rank_order_sum_kernel(const T* __restrict__ parts, int64_t ranks, int64_t numel,
                              float* __restrict__ out) {
  const int64_t vecs = numel / V, stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t i = first; i < vecs; i += stride) {
    float acc[V];
    load_f32<T, V>(parts + i * V, acc);
    for (int64_t r = 1; r < ranks; ++r) {
      float v[V];
      load_f32<T, V>(parts + r * numel + i * V, v);
#pragma unroll
      for (int j = 0; j < V; ++j) acc[j] = rank_order_add(acc[j], v[j]);
    }
    rank_order_store<V>(out + i * V, acc);
  }
}

// Launches the kernel on stream; grid-stride, so any numel fits a bounded grid.
template <typename T, int V>
cudaError_t launch_rank_order_sum(const T* parts, int64_t ranks, int64_t numel, float* out,
                                  int max_blocks, cudaStream_t stream) {
  const int64_t vecs = numel / V;
  if (vecs == 0) return cudaSuccess;
  const int64_t want = (vecs + 255) / 256;
  const int blocks = static_cast<int>(want < max_blocks ? want : max_blocks);
  rlk_rank_order_sum_kernel<T, V><<<blocks, 256, 0, stream>>>(parts, ranks, numel, out);
  return cudaGetLastError();
}

}  // namespace rl_engine::cuda
