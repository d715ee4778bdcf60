// out[c, r] = in[r, c] for 16-bit matrices, through 64 x 64 tiles in shared memory with 16-byte
// global accesses where the rows allow. It feeds the K-major GEMM the transposed (MN-major)
// operands of the backward products; a copy moves bits unchanged, so it has no numerics.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "rl_engine/cuda/types.cuh"

namespace rl_engine::cuda {

// A block moves a 64 x 64 tile. Thread (warp w, lane l) loads 8 columns (16 bytes, chunk l % 8) of
// input rows 2p and 2p + 1 (p = 4 w + l / 8), so 8 lanes read one row's 128 bytes; it pairs the two
// rows' elements of each column into 32-bit words (output row c, columns 2p, 2p + 1) and stores them
// to a word tile [64 output rows][32 row pairs], whose 16-byte chunks are swizzled (chunk ^ c / 8)
// so that both these stores and the 16-byte reads of whole output rows hit every bank once.
template <typename T>
__global__ void __launch_bounds__(256)
    rlk_det_gemm_transpose_kernel(const T* __restrict__ in, int64_t ld_in, int rows, int cols, T* __restrict__ out,
                     int64_t ld_out, bool vec_in, bool vec_out) {
  __shared__ __align__(16) uint32_t tile[64][32];
  const int r0 = blockIdx.y * 64, c0 = blockIdx.x * 64;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int q = lane % 8, p = 4 * warp + lane / 8;
  uint4 raw[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = r0 + 2 * p + h, c = c0 + 8 * q;
    T* e = reinterpret_cast<T*>(&raw[h]);
    if (r < rows && vec_in && c + 8 <= cols) {
      raw[h] = *reinterpret_cast<const uint4*>(in + r * ld_in + c);
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) e[j] = (r < rows && c + j < cols) ? in[r * ld_in + c + j] : from_float<T>(0.f);
    }
  }
  const uint32_t* lo = reinterpret_cast<const uint32_t*>(&raw[0]);
  const uint32_t* hi = reinterpret_cast<const uint32_t*>(&raw[1]);
#pragma unroll
  for (int j = 0; j < 4; ++j) {  // columns 2j, 2j + 1 of the chunk: (row 2p, row 2p + 1) word pairs
    const int c = 8 * q + 2 * j, slot = (((p / 4) ^ (c / 8)) * 4) + p % 4;
    tile[c][slot] = __byte_perm(lo[j], hi[j], 0x5410);
    tile[c + 1][slot] = __byte_perm(lo[j], hi[j], 0x7632);
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int idx = threadIdx.x + 256 * i, c = idx / 8, k = idx % 8;  // output row c, its chunk k
    const int orow = c0 + c, oc = r0 + 8 * k;  // input column orow, input rows oc .. oc + 7
    if (orow >= cols) continue;
    const uint4 v = *reinterpret_cast<const uint4*>(&tile[c][(k ^ (c / 8)) * 4]);
    if (vec_out && oc + 8 <= rows) {
      *reinterpret_cast<uint4*>(out + orow * ld_out + oc) = v;
    } else {
      const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        if (oc + j < rows) out[orow * ld_out + oc + j] = e[j];
      }
    }
  }
}

// in [rows, cols] (row pitch ld_in) -> out [cols, rows] (row pitch ld_out); rows <= 65535 * 64 (a
// grid has at most 65535 blocks in y).
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
