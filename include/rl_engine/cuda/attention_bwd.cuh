// Backward of the Hopper attention (see attention.cuh): four kernels, no atomics among threads.
//   delta[r, h] = dO . O in fp32 (one warp per row and head, a fixed butterfly);
//   chunk_end[r] = the row after r's query chunk (one thread per row);
//   dq (attention_dq.cuh): each dq element is one chain of k16 products over keys in order from
//       key 0, so it depends neither on the tile size nor on the rows that share the CTA;
//   dk/dv (attention_dkdv.cuh): per-chunk fp32 partials added in chunk order by the one thread
//       that owns each element.
#pragma once

#include "rl_engine/cuda/attention_dq.cuh"

namespace rl_engine::cuda::attn {

template <typename T, int D>
__global__ void __launch_bounds__(256) rlk_attention_bwd_delta_kernel(const T* dout, const T* out,
                                                                      float* delta, int64_t n) {
  constexpr int kPer = D / 32;
  const int64_t idx = (int64_t)blockIdx.x * 8 + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (idx >= n) return;
  const T* a = dout + idx * D + lane * kPer;
  const T* o = out + idx * D + lane * kPer;
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < kPer; ++i) s = __fmaf_rn(to_f32(a[i]), to_f32(o[i]), s);
#pragma unroll
  for (int m = 16; m >= 1; m /= 2) s = __fadd_rn(s, shfl_xor(s, m));
  if (lane == 0) delta[idx] = s;
}

// chunk_end[r] = the row after row r's query chunk (a chunk is the rows of r's sequence with
// position // q_chunk == pos[r] // q_chunk; positions increase within a sequence).
__global__ void __launch_bounds__(256) rlk_attention_bwd_chunks_kernel(BwdParams p, int tq) {
  const int r = blockIdx.x * 256 + threadIdx.x;
  if (r >= tq) return;
  int lo = 0, hi = p.batch;  // the sequence b with cu_q[b] <= r < cu_q[b + 1]
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (p.cu_q[mid] <= r) lo = mid;
    else hi = mid;
  }
  p.chunk_end[r] = lower_bound_pos(p.pos, r, p.cu_q[lo + 1], (p.pos[r] / p.q_chunk + 1) * p.q_chunk);
}

template <typename T, int D>
cudaError_t launch_attention_bwd(const BwdParams& p, const T* out, float* delta, int64_t tq, int64_t tk,
                                 int q_tiles, int k_tiles, cudaStream_t stream) {
  const int64_t rows = tq * p.hq;
  if (rows > 0) {
    rlk_attention_bwd_delta_kernel<T, D><<<(rows + 7) / 8, 256, 0, stream>>>(
        static_cast<const T*>(p.dout), out, delta, rows);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
    rlk_attention_bwd_chunks_kernel<<<(tq + 255) / 256, 256, 0, stream>>>(p, static_cast<int>(tq));
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  // dk/dv first, then dq with programmatic stream serialization: the two read only what the
  // kernels above wrote, so dq's CTAs may fill the SMs that dk/dv's last wave leaves idle.
  if (k_tiles > 0) {
    if (cudaError_t e = launch_attention_dkdv<T, D>(p, tq, tk, k_tiles, stream); e != cudaSuccess) return e;
  }
  return q_tiles > 0 ? launch_attention_dq<T, D>(p, tq, tk, q_tiles, stream, k_tiles > 0) : cudaSuccess;
}

}  // namespace rl_engine::cuda::attn
