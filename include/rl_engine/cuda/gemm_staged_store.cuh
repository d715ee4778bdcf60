// det_gemm's store of a 16-bit output through shared memory and bulk tensor stores, so that the
// consumers go back to the main loop while the copy engine writes the tile.
//
// The epilogue that stores from registers (StoreEpilogue::store_blocks) keeps both consumer
// warpgroups busy until every 16-byte store of the tile has issued, and every CTA of a wave ends
// its tile at about the same time: at 8192 x 4096 x 4096 the tensor pipe sat idle for 3.5-4% of the
// kernel on hashed operands, after the quad transpose was made cheap
// (benchmarks/results/h100/epilogue_probe/). Here each warp writes its 16 rows of a 32-column
// chunk into shared memory with stmatrix (the fragment's layout is stmatrix's, so nothing moves
// between lanes), and one lane issues a bulk tensor store of that 16 x 32 box; a warp's two
// buffers alternate, so the next chunk is written while the last one is read out. The values are
// rounded as StoreEpilogue rounds them, once, in the same place.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "rl_engine/cuda/ptx.cuh"
#include "rl_engine/cuda/types.cuh"

namespace rl_engine::cuda {

// Shared memory an epilogue needs per consumer warpgroup (0: none, it stores from registers).
template <typename Epi, typename = void>
struct StagingBytes : std::integral_constant<int, 0> {};
template <typename Epi>
struct StagingBytes<Epi, std::void_t<decltype(Epi::kStagingBytes)>> : std::integral_constant<int, Epi::kStagingBytes> {};

// out[r, c] = acc (+ bias[c]) rounded once to Out (16-bit), through the tensor map `map` of out
// ([m, n], box 32 columns x 16 rows, 64-byte swizzle: see make_staged_store_map).
template <typename Out>
struct StagedStoreEpilogue {
  static_assert(sizeof(Out) == 2, "bulk stores of a 16-bit output");
  static constexpr bool kAnyWidth = true;
  static constexpr int kChunkCols = 32, kWarpRows = 16;
  static constexpr int kBufBytes = kChunkCols * kWarpRows * 2;  // one warp's box, rows of 64 bytes
  static constexpr int kStagingBytes = 4 * 2 * kBufBytes;  // four warps, two buffers each
  CUtensorMap map;
  const float* bias;  // fp32 [n] or null

  // The fragment of one consumer warpgroup (rows row0.., columns col0..) into `staging` (its
  // kStagingBytes, 512-byte aligned); `count` is the thread's running count of chunks, which picks
  // the buffer, kept across tiles.
  template <int kA>
  __device__ __forceinline__ void store_staged(const float (&acc)[kA], int row0, int col0, int row_end, int n,
                                               uint32_t staging, uint32_t& count) const {
    static_assert(kA % 16 == 0, "whole 32-column chunks");
    const int lane = threadIdx.x % 32, warp = threadIdx.x % 128 / 32, c = lane % 4;
    const int row = row0 + kWarpRows * warp;
    // stmatrix: lane l addresses row l % 8 of matrix l / 8; matrix i of a call is block 2 p + i / 2
    // (p the call), rows 8 (i % 2) on. Row r of a buffer is 64 bytes; its 16-byte piece b sits at
    // b ^ (r / 2 % 4), the 64-byte swizzle the tensor map reads back.
    const int r = 8 * (lane / 8 % 2) + lane % 8, half_block = lane / 16;
    const uint32_t row_off = static_cast<uint32_t>(r * 64), swz = static_cast<uint32_t>(r / 2 % 4);
#pragma unroll
    for (int q = 0; q < kA / 16; ++q) {
      const uint32_t buf = staging + warp * 2 * kBufBytes + (count & 1u) * kBufBytes;
      if (lane == 0) ptx::bulk_wait_group_read<1>();  // this buffer's store two chunks ago has read it
      __syncwarp();
      uint32_t p[8];  // p[2 i + h]: block 4 q + i, rows 8 h on
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int j = 4 * q + i, col = col0 + 8 * j + 2 * c;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float v0 = acc[4 * j + 2 * h], v1 = acc[4 * j + 2 * h + 1];
          if (bias != nullptr) {
            if (col < n) v0 = v0 + bias[col];
            if (col + 1 < n) v1 = v1 + bias[col + 1];
          }
          rl_engine::cuda::store_pair(reinterpret_cast<Out*>(&p[2 * i + h]), v0, v1);
        }
      }
#pragma unroll
      for (int call = 0; call < 2; ++call) {
        const uint32_t piece = static_cast<uint32_t>(2 * call + half_block);
        ptx::stmatrix_x4(buf + row_off + ((piece ^ swz) << 4), p[4 * call], p[4 * call + 1], p[4 * call + 2],
                         p[4 * call + 3]);
      }
      ptx::fence_proxy_async_smem();  // the writes above before the copy engine reads them
      __syncwarp();
      const int col = col0 + kChunkCols * q;
      if (lane == 0) {
        if (row < row_end && col < n) ptx::tma_store_2d(&map, buf, col, row);
        ptx::bulk_commit_group();  // empty where nothing was stored: one group a chunk, one a buffer
      }
      ++count;
    }
  }

  // Before the CTA exits: its shared memory must outlive the stores that read it.
  __device__ __forceinline__ void drain() const {
    if (threadIdx.x % 32 == 0) ptx::bulk_wait_group_read<0>();
  }
};

}  // namespace rl_engine::cuda
