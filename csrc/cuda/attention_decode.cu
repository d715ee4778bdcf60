// Host entry point of the paged decode: picks the kernel instance for dtype, head_dim and
// kv_block_size (checked by the torch glue in attention_ops.cpp). Its own translation unit so it
// compiles in parallel with the prefill. No torch headers here.
#include "rl_engine/cuda/attention.cuh"

namespace rl_engine::cuda::attn {

template <typename T, int D>
static cudaError_t decode_for_block(const DecodeParams& p, int block, int batch, cudaStream_t stream) {
  switch (block) {
    case 16: return launch_attention_decode<T, D, 16>(p, batch, stream);
    case 32: return launch_attention_decode<T, D, 32>(p, batch, stream);
    case 64: return launch_attention_decode<T, D, 64>(p, batch, stream);
    case 128: return launch_attention_decode<T, D, 128>(p, batch, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t launch_decode(const DecodeParams& p, AttnDType dtype, int head_dim, int kv_block_size,
                          int batch, cudaStream_t stream) {
  const bool bf16 = dtype == AttnDType::kBF16;
  if (head_dim == 64) {
    return bf16 ? decode_for_block<__nv_bfloat16, 64>(p, kv_block_size, batch, stream)
                : decode_for_block<__half, 64>(p, kv_block_size, batch, stream);
  }
  if (head_dim == 128) {
    return bf16 ? decode_for_block<__nv_bfloat16, 128>(p, kv_block_size, batch, stream)
                : decode_for_block<__half, 128>(p, kv_block_size, batch, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace rl_engine::cuda::attn
