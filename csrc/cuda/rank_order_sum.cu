// The Hopper rank-order sum's host entry point: picks the kernel for the element type and access
// width and launches it. No torch here (the glue is csrc/cuda/rank_order_sum_op.cpp).
#include "rl_engine/cuda/rank_order_sum.cuh"
#include "rl_engine/cuda/rank_order_sum.h"

namespace rl_engine::cuda {

namespace {

template <typename T>
cudaError_t launch_for(const void* parts, int64_t ranks, int64_t numel, bool wide, float* out,
                       int max_blocks, cudaStream_t stream) {
  const T* p = static_cast<const T*>(parts);
  if (wide) return launch_rank_order_sum<T, kVec16<T>>(p, ranks, numel, out, max_blocks, stream);
  return launch_rank_order_sum<T, 1>(p, ranks, numel, out, max_blocks, stream);
}

}  // namespace

cudaError_t rank_order_sum_launch(const void* parts, SumDType dtype, int64_t ranks, int64_t numel,
                                  bool wide, float* out, int max_blocks, cudaStream_t stream) {
  if (ranks < 1 || numel < 0 || max_blocks < 1) return cudaErrorInvalidValue;
  switch (dtype) {
    case SumDType::kBF16:
      return launch_for<__nv_bfloat16>(parts, ranks, numel, wide, out, max_blocks, stream);
    case SumDType::kF16:
      return launch_for<__half>(parts, ranks, numel, wide, out, max_blocks, stream);
    case SumDType::kF32:
      return launch_for<float>(parts, ranks, numel, wide, out, max_blocks, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace rl_engine::cuda
