// Host entry point of the Hopper rank-order sum (kernel in rank_order_sum.cuh, entry defined in
// csrc/cuda/rank_order_sum.cu). Plain C++: the torch glue, built by the host compiler, includes
// only this header, so no exception is ever thrown from a translation unit built by nvcc.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace rl_engine::cuda {

enum class SumDType : int { kBF16 = 0, kF16 = 1, kF32 = 2 };

// out[i] = sum over r of parts[r][i] in rank order, fp32; parts is [ranks, numel] contiguous.
// wide: 16-byte accesses, allowed when parts is 16-byte aligned and numel a multiple of the
// elements per 16 bytes (the sums are the same bits either way).
cudaError_t rank_order_sum_launch(const void* parts, SumDType dtype, int64_t ranks, int64_t numel,
                                  bool wide, float* out, int max_blocks, cudaStream_t stream);

}  // namespace rl_engine::cuda
