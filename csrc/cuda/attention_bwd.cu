// Host entry point of the backward: delta, dq and dk/dv kernels for dtype and head_dim (checked by
// the torch glue in attention_ops.cpp). No torch headers here.
#include "rl_engine/cuda/attention_bwd.cuh"

namespace rl_engine::cuda::attn {

cudaError_t launch_bwd(const BwdParams& p, const void* out, float* delta, AttnDType dtype,
                       int head_dim, int64_t tq, int64_t tk, int q_tiles, int k_tiles, cudaStream_t stream) {
  const bool bf16 = dtype == AttnDType::kBF16;
  auto go = [&](auto tag, auto dim) {
    using T = decltype(tag);
    return launch_attention_bwd<T, decltype(dim)::value>(p, static_cast<const T*>(out), delta, tq,
                                                         tk, q_tiles, k_tiles, stream);
  };
  using D64 = std::integral_constant<int, 64>;
  using D128 = std::integral_constant<int, 128>;
  if (head_dim == 64) return bf16 ? go(__nv_bfloat16{}, D64{}) : go(__half{}, D64{});
  if (head_dim == 128) return bf16 ? go(__nv_bfloat16{}, D128{}) : go(__half{}, D128{});
  return cudaErrorInvalidValue;
}

}  // namespace rl_engine::cuda::attn
