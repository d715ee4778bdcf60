// Element types of the CUDA kernels and their fp32 conversions: every kernel loads bf16/fp16/fp32,
// computes in fp32 and rounds once when it stores (round to nearest even).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

namespace rl_engine::cuda {

enum class DType : int { kBF16 = 0, kF16 = 1, kF32 = 2 };

constexpr float kNegInf = -__builtin_huge_valf();

template <typename T>
__device__ __forceinline__ float to_float(T v);
template <>
__device__ __forceinline__ float to_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <>
__device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }

// Two adjacent outputs in one store (the pair is 4- or 8-byte aligned by the caller's check).
template <typename T>
__device__ __forceinline__ void store_pair(T* p, float v0, float v1) {
  if constexpr (sizeof(T) == 4) {
    *reinterpret_cast<float2*>(p) = make_float2(v0, v1);
  } else if constexpr (std::is_same_v<T, __half>) {
    *reinterpret_cast<__half2*>(p) = __floats2half2_rn(v0, v1);
  } else {
    *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(v0, v1);
  }
}

// Elements per 16-byte access.
template <typename T>
constexpr int kVec16 = 16 / static_cast<int>(sizeof(T));

// Loads V consecutive elements as fp32: one 16-byte access when V fills 16 bytes, else scalars.
// The values (and hence every later bit) do not depend on which form was used.
template <typename T, int V>
__device__ __forceinline__ void load_f32(const T* p, float (&v)[V]) {
  if constexpr (V * sizeof(T) == 16) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < V; ++i) v[i] = to_float(e[i]);
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) v[i] = to_float(p[i]);
  }
}

template <typename T, int V>
__device__ __forceinline__ void store_f32(T* p, const float (&v)[V]) {
  if constexpr (V * sizeof(T) == 16) {
    uint4 raw;
    T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int i = 0; i < V; ++i) e[i] = from_float<T>(v[i]);
    *reinterpret_cast<uint4*>(p) = raw;
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) p[i] = from_float<T>(v[i]);
  }
}

// V consecutive elements kept as loaded (one 16-byte register quad when V fills 16 bytes), so a
// row cached between two passes costs half the registers of its fp32 values.
template <typename T, int V, bool kWide = V * sizeof(T) == 16>
struct Raw;

template <typename T, int V>
struct Raw<T, V, true> {
  uint4 v;
  __device__ __forceinline__ void load(const T* p) { v = *reinterpret_cast<const uint4*>(p); }
  __device__ __forceinline__ float get(int i) const { return to_float(reinterpret_cast<const T*>(&v)[i]); }
};

template <typename T, int V>
struct Raw<T, V, false> {
  T v[V];
  __device__ __forceinline__ void load(const T* p) {
#pragma unroll
    for (int i = 0; i < V; ++i) v[i] = p[i];
  }
  __device__ __forceinline__ float get(int i) const { return to_float(v[i]); }
};

// Sum over aligned groups of W lanes (W a power of two <= 32) by an xor butterfly. Float addition
// is commutative, so every lane of a group ends with the same bits, and the tree depends only on
// lane indices.
template <int W>
__device__ __forceinline__ float lane_sum(float v) {
#pragma unroll
  for (int o = W / 2; o >= 1; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum over a group of G threads (G a power of two, groups aligned in the block): lane butterflies,
// then (G > 32) the warp totals added in warp order. Every thread of the block must call it (it
// holds __syncthreads when G > 32); red needs blockDim.x / 32 floats.
template <int G>
__device__ __forceinline__ float group_sum(float v, float* red) {
  if constexpr (G <= 32) {
    return lane_sum<G>(v);
  } else {
    v = lane_sum<32>(v);
    const int warp = threadIdx.x / 32;
    const int first = (threadIdx.x / G) * (G / 32);
    __syncthreads();  // earlier readers of red are done
    if (threadIdx.x % 32 == 0) red[warp] = v;
    __syncthreads();
    float s = red[first];
#pragma unroll
    for (int w = 1; w < G / 32; ++w) s += red[first + w];
    return s;
  }
}

}  // namespace rl_engine::cuda
