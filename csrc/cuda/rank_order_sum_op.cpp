// Torch glue of the Hopper rank_order_sum: the payload sum of the fixed-order collectives on the
// GPU (the payload is all-gathered first, then added here in rank order). bf16/fp16/fp32 parts are
// read as they are (the upcast to fp32 is exact); the output is fp32, bit for bit the CPU kernel's.
// Built by the host compiler (only in builds with the sm_90a kernels), so every check throws from
// host-compiled code; csrc/cuda/rank_order_sum.cu only launches.
#ifdef RL_ENGINE_WITH_SM90

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdint>
#include <string>

#include "kernel_counters.h"
#include "rl_engine/cuda/rank_order_sum.h"

namespace rl_engine::cuda {
namespace {

at::Tensor rank_order_sum(const at::Tensor& parts) {
  constexpr const char* op = "rl_engine::rank_order_sum";
  const auto s = parts.scalar_type();
  TORCH_CHECK(s == at::kBFloat16 || s == at::kHalf || s == at::kFloat, op,
              ": parts must be bf16, fp16 or fp32, got ", c10::toString(s));
  // Numbers go into messages as std::to_string strings, as in the attention glue.
  TORCH_CHECK(parts.dim() >= 1 && parts.size(0) >= 1, op,
              ": parts must be [R, ...] with R >= 1, got a tensor of ", std::to_string(parts.dim()),
              " dims");
  c10::cuda::CUDAGuard guard(parts.device());
  count_launch(kRankOrderSum, kCuda);
  const auto p = parts.contiguous();
  const int64_t ranks = p.size(0), numel = p.numel() / ranks;
  auto out = at::empty(parts.sizes().slice(1), p.options().dtype(at::kFloat));
  if (numel == 0) return out;
  const SumDType dt = s == at::kBFloat16 ? SumDType::kBF16
                      : s == at::kHalf   ? SumDType::kF16
                                         : SumDType::kF32;
  const int64_t per16 = 16 / static_cast<int64_t>(p.element_size());
  const bool wide = numel % per16 == 0 && reinterpret_cast<uintptr_t>(p.data_ptr()) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0;
  const int max_blocks = at::cuda::getCurrentDeviceProperties()->multiProcessorCount * 8;
  const cudaError_t e = rank_order_sum_launch(p.data_ptr(), dt, ranks, numel, wide,
                                              out.data_ptr<float>(), max_blocks,
                                              at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(e == cudaSuccess, op, ": CUDA launch failed: ", cudaGetErrorString(e));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(rl_engine, CUDA, m) {
  m.impl("rank_order_sum", &rank_order_sum);
}

}  // namespace rl_engine::cuda

#endif  // RL_ENGINE_WITH_SM90
