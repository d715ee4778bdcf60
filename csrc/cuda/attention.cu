// Host entry point of the prefill forward: picks the kernel instance for dtype, head_dim and
// kv_block_size (the torch glue in attention_ops.cpp has checked them). No torch headers here.
#include "rl_engine/cuda/attention_wgmma.cuh"

namespace rl_engine::cuda::attn {

// Blocks of 64 and 128 keys run on wgmma, the smaller ones on mma.sync: the choice depends on the
// model's attention shape alone, and both kernels give a row the same bits (the glue passes 16-byte
// aligned tensors, as the bulk tensor copies need).
template <typename T, int D>
static cudaError_t fwd_for_block(const FwdParams& p, int block, int64_t tq, int64_t tk, int tiles,
                                 cudaStream_t stream) {
  switch (block) {
    case 16: return launch_attention_fwd<T, D, 16>(p, tiles, stream);
    case 32: return launch_attention_fwd<T, D, 32>(p, tiles, stream);
    case 64: return launch_attention_fwd_wgmma<T, D, 64>(p, tq, tk, tiles, stream);
    case 128: return launch_attention_fwd_wgmma<T, D, 128>(p, tq, tk, tiles, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t launch_fwd(const FwdParams& p, AttnDType dtype, int head_dim, int kv_block_size,
                       int64_t tq, int64_t tk, int grid_tiles, cudaStream_t stream) {
  const bool bf16 = dtype == AttnDType::kBF16;
  if (head_dim == 64) {
    return bf16 ? fwd_for_block<__nv_bfloat16, 64>(p, kv_block_size, tq, tk, grid_tiles, stream)
                : fwd_for_block<__half, 64>(p, kv_block_size, tq, tk, grid_tiles, stream);
  }
  if (head_dim == 128) {
    return bf16 ? fwd_for_block<__nv_bfloat16, 128>(p, kv_block_size, tq, tk, grid_tiles, stream)
                : fwd_for_block<__half, 128>(p, kv_block_size, tq, tk, grid_tiles, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace rl_engine::cuda::attn
