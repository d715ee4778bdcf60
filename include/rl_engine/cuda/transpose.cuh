// out[c, r] = in[r, c] for 16-bit matrices, through 64 x 64 tiles in shared memory with 16-byte
// global accesses where the rows allow. It feeds the K-major GEMM the transposed (MN-major)
// operands of the backward products; a copy moves bits unchanged, so it has no numerics.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "rl_engine/cuda/types.cuh"

namespace rl_engine::cuda {

template <typename T>
__global__ void __launch_bounds__(256)
    rlk_det_gemm_transpose_kernel(const T* __restrict__ in, int64_t ld_in, int rows, int cols, T* __restrict__ out,
                     int64_t ld_out, bool vec_in, bool vec_out) {
  __shared__ T tile[64][64 + 2];  // 33-word rows: the column gather spreads over the banks
  const int r0 = blockIdx.y * 64, c0 = blockIdx.x * 64;
  const int tr = threadIdx.x / 4, tc = (threadIdx.x % 4) * 16;
  const int r = r0 + tr;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int c = c0 + tc + 8 * h;
    uint4 raw;
    T* e = reinterpret_cast<T*>(&raw);
    if (r < rows && vec_in && c + 8 <= cols) {
      raw = *reinterpret_cast<const uint4*>(in + r * ld_in + c);
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) e[j] = (r < rows && c + j < cols) ? in[r * ld_in + c + j] : from_float<T>(0.f);
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) tile[tr][tc + 8 * h + j] = e[j];
  }
  __syncthreads();
  const int orow = c0 + tr;  // an input column
  if (orow >= cols) return;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int oc = r0 + tc + 8 * h;  // input rows oc .. oc + 7
    uint4 raw;
    T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int j = 0; j < 8; ++j) e[j] = tile[tc + 8 * h + j][tr];
    if (vec_out && oc + 8 <= rows) {
      *reinterpret_cast<uint4*>(out + orow * ld_out + oc) = raw;
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        if (oc + j < rows) out[orow * ld_out + oc + j] = e[j];
      }
    }
  }
}

// in [rows, cols] (row pitch ld_in) -> out [cols, rows] (row pitch ld_out); rows < 2^22.
template <typename T>
cudaError_t launch_transpose(const T* in, int64_t ld_in, int rows, int cols, T* out, int64_t ld_out,
                             cudaStream_t stream) {
  static_assert(sizeof(T) == 2, "16-bit element types only");
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  const bool vec_in = reinterpret_cast<uintptr_t>(in) % 16 == 0 && (ld_in * 2) % 16 == 0;
  const bool vec_out = reinterpret_cast<uintptr_t>(out) % 16 == 0 && (ld_out * 2) % 16 == 0;
  const dim3 grid((cols + 63) / 64, (rows + 63) / 64);
  rlk_det_gemm_transpose_kernel<T><<<grid, 256, 0, stream>>>(in, ld_in, rows, cols, out, ld_out, vec_in, vec_out);
  return cudaGetLastError();
}

}  // namespace rl_engine::cuda
