// Arguments of the Hopper attention kernels and their host entry points (defined in
// csrc/cuda/attention*.cu). Plain C++: the torch glue, compiled by the host compiler, includes
// this header only, so no exception is ever thrown from a translation unit built by nvcc.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace rl_engine::cuda::attn {

enum class AttnDType : int { kBF16 = 0, kF16 = 1 };

// Query rows per CTA of the prefill forward and of the backward's dq, key rows per CTA of the
// backward's dk/dv, and query heads per kv head the decode takes: the launchers size grids with them.
constexpr int kFwdRows = 128;
constexpr int kDqRows = 128;
constexpr int kDkvKeys = 128;
constexpr int kDecodeMaxGroup = 64;

struct FwdParams {
  const void* q;   // [Tq, Hq, D]
  const void* k;   // [Tk, Hkv, D]
  const void* v;
  void* out;       // [Tq, Hq, D]
  float* lse;      // [Tq, Hq]
  const int32_t* cu_q;
  const int32_t* cu_k;
  const int64_t* pos;
  int batch, hq, hkv;
  float scale, scale_log2;
};

struct DecodeParams {
  const void* q;        // [B, Hq, D]
  const void* k_cache;  // [num_pages, page_size, Hkv, D]
  const void* v_cache;
  const int32_t* block_table;  // [B, max_pages]
  const int32_t* seq_lens;     // [B]
  void* out;                   // [B, Hq, D]
  float* lse;                  // [B, Hq]
  int hq, hkv, page_size, max_pages, num_pages;
  float scale, scale_log2;
};

struct BwdParams {
  const void* dout;  // [Tq, Hq, D]
  const void* q;
  const void* k;     // [Tk, Hkv, D]
  const void* v;
  const float* lse;    // [Tq, Hq]
  const float* delta;  // [Tq, Hq]
  void* dq;            // [Tq, Hq, D]
  float* dk;           // [Tk, Hkv, D]
  float* dv;
  const int32_t* cu_q;
  const int32_t* cu_k;
  const int64_t* pos;
  int32_t* chunk_end;  // [Tq] scratch: the row after each row's query chunk
  int batch, hq, hkv, q_chunk;
  float scale, scale_log2;
};

// Each returns the launch status; dtype, head_dim (64 or 128) and kv_block_size (16, 32, 64, 128)
// must be checked by the caller, and for the decode that kv_block_size is a multiple of page_size
// (a block is whole pages: the decode finds a row's page from its place in the block). grid_tiles
// bounds the tiles from above: ceil(rows / tile) + batch. tq, tk: rows of q and of k / v.
cudaError_t launch_fwd(const FwdParams& p, AttnDType dtype, int head_dim, int kv_block_size,
                       int64_t tq, int64_t tk, int grid_tiles, cudaStream_t stream);
cudaError_t launch_decode(const DecodeParams& p, AttnDType dtype, int head_dim, int kv_block_size,
                          int batch, cudaStream_t stream);
// delta (fp32 [Tq, Hq]) is scratch for dO . O; out is the forward output [Tq, Hq, D].
cudaError_t launch_bwd(const BwdParams& p, const void* out, float* delta, AttnDType dtype,
                       int head_dim, int64_t tq, int64_t tk, int q_tiles, int k_tiles, cudaStream_t stream);

}  // namespace rl_engine::cuda::attn
