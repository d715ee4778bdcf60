// Prefill forward on wgmma and bulk tensor copies (sm_90a) for head_dim 64 / 128 and kv blocks of
// 64 / 128 keys; the mma.sync kernel in attention.cuh serves the other block sizes.
//
// Same arithmetic as the mma.sync kernels, row by row: the scores of a row are D / 16 products
// of 16 terms accumulated from zero in k order, the block update is attention_block.cuh's
// block_softmax, and o accumulates P . V 16 keys at a time in key order, so the rows equal the
// decode's rows bit for bit (the tests check it). A warpgroup's m64nNk16 product gives each
// accumulator the same operations as an m16n8k16 product of its warp: the m64 tile is four m16
// tiles side by side, and the fragment layouts match (accumulators and the register A operand).
//
// One CTA per (128-row query tile, q head): warpgroup 0 is the producer (one thread issues the
// copies of Q once and of each (K, V) block into a ring guarded by mbarriers), warpgroups 1 and 2
// each own 64 query rows and walk the blocks in order. Tiles are [rows][64] panels with 128-byte
// swizzle; K is read K-major, V N-major (the transposed wgmma form), so nothing is transposed.
#pragma once

#include <cuda.h>

#include "rl_engine/cuda/attention.cuh"
#include "rl_engine/cuda/det_gemm.cuh"  // tma_encode_fn
#include "rl_engine/cuda/wgmma.cuh"

namespace rl_engine::cuda::attn {

template <int D, int BN>
struct WgFwd {
  static constexpr int kPanels = D / 64;
  static constexpr uint32_t kQBytes = kFwdRows * D * 2;
  static constexpr uint32_t kTileBytes = BN * D * 2;  // one K or V block
  static constexpr int kStages = 2 * kTileBytes * 3 + kQBytes <= 160 * 1024 ? 3 : 2;
  static constexpr uint32_t kRingBytes = kStages * 2 * kTileBytes;
  static constexpr int kSmemBytes = 1024 + kQBytes + kRingBytes + (2 * kStages + 1) * 8;
  static constexpr int kThreads = 3 * 128;
};

// True for the (D, BN) pairs this kernel serves.
constexpr bool wgmma_fwd_supported(int d, int bn) {
  return (d == 64 || d == 128) && (bn == 64 || bn == 128);
}

template <typename T, int D, int BN>
__global__ void __launch_bounds__(WgFwd<D, BN>::kThreads, 1)
    rlk_attention_fwd_wgmma_kernel(const __grid_constant__ CUtensorMap map_q,
                                   const __grid_constant__ CUtensorMap map_k,
                                   const __grid_constant__ CUtensorMap map_v, FwdParams p) {
  using C = WgFwd<D, BN>;
  constexpr bool kHalf = std::is_same_v<T, __half>;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  __shared__ int row_pos[kFwdRows];
  const uint32_t qs = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const uint32_t ring = qs + C::kQBytes, bars = ring + C::kRingBytes;
  auto k_tile = [&](int s) { return ring + 2 * s * C::kTileBytes; };
  auto full = [&](int s) { return bars + 8u * s; };
  auto empty = [&](int s) { return bars + 8u * (C::kStages + s); };
  const uint32_t q_bar = bars + 8u * 2 * C::kStages;

  const int h = blockIdx.x % p.hq, rev = blockIdx.x / p.hq;
  const int total = count_tiles(p.cu_q, p.batch, kFwdRows);
  int b, tile;
  if (rev >= total || !find_tile(p.cu_q, p.batch, kFwdRows, total - 1 - rev, b, tile)) return;
  const int row0 = p.cu_q[b] + tile * kFwdRows, nrows = min(kFwdRows, p.cu_q[b + 1] - row0);
  const int kbase = p.cu_k[b], klen = p.cu_k[b + 1] - kbase, g = h / (p.hq / p.hkv);
  if (threadIdx.x < kFwdRows)
    row_pos[threadIdx.x] = threadIdx.x < nrows ? static_cast<int>(p.pos[row0 + threadIdx.x]) : 0;
  if (threadIdx.x == 0) {
    for (int s = 0; s < C::kStages; ++s) {
      ptx::mbar_init(full(s), 1);
      ptx::mbar_init(empty(s), 2);
    }
    ptx::mbar_init(q_bar, 1);
    ptx::fence_barrier_init();
  }
  __syncthreads();
  // The last key any row of `rows` rows from `first` sees (-1: none).
  auto last_key = [&](int first, int rows) {
    int m = -1;
    for (int r = 0; r < rows; ++r) m = max(m, row_pos[first + r]);
    return min(m, klen - 1);
  };
  const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;

  if (wg == 0) {
    ptx::setmaxnreg_dec<24>();
    if (tid != 0) return;
    const int last = last_key(0, min(nrows, kFwdRows));
    const int nblocks = last < 0 ? 0 : last / BN + 1;
    ptx::mbar_arrive_expect_tx(q_bar, C::kQBytes);
    for (int pn = 0; pn < C::kPanels; ++pn)
      ptx::tma_load_3d(qs + pn * kFwdRows * 128, &map_q, q_bar, 64 * pn, h, row0);
    for (int j = 0; j < nblocks; ++j) {
      const int s = j % C::kStages;
      ptx::mbar_wait(empty(s), ((j / C::kStages) & 1) ^ 1);  // first pass: the slot starts free
      ptx::mbar_arrive_expect_tx(full(s), 2 * C::kTileBytes);
      for (int pn = 0; pn < C::kPanels; ++pn) {
        ptx::tma_load_3d(k_tile(s) + pn * BN * 128, &map_k, full(s), 64 * pn, g, kbase + j * BN);
        ptx::tma_load_3d(k_tile(s) + C::kTileBytes + pn * BN * 128, &map_v, full(s), 64 * pn, g,
                         kbase + j * BN);
      }
    }
    return;
  }

  ptx::setmaxnreg_inc<240>();
  const int c = wg - 1, warp = tid / 32, lane = tid % 32;
  const int last = last_key(0, min(nrows, kFwdRows));
  const int nblocks = last < 0 ? 0 : last / BN + 1;
  const int wg_last = last_key(c * 64, max(0, min(64, nrows - c * 64)));
  const int first_row = c * 64 + warp * 16 + (lane >> 2);
  const int pos[1][2] = {{row_pos[first_row], row_pos[first_row + 8]}};
  RowState<D / 8> st[1];
  st[0].init();
  ptx::mbar_wait(q_bar, 0);
  const uint32_t q_rows = qs + c * 64 * 128;

  for (int j = 0; j < nblocks; ++j) {
    const int s = j % C::kStages;
    ptx::mbar_wait(full(s), (j / C::kStages) & 1);
    if (j * BN <= wg_last) {
      const uint32_t kt = k_tile(s), vt = kt + C::kTileBytes;
      if ((j + 1) * BN > klen) {
        // Keys past the sequence are masked, but the copy read whatever follows it (the next
        // sequence); zero those V rows so that 0 * V adds exactly zero even for inf or NaN there.
        const int from = klen - j * BN;
        for (int i = tid; i < (BN - from) * C::kPanels * 8; i += 128) {
          const int r = from + i / (C::kPanels * 8), pn = (i / 8) % C::kPanels, ch = i % 8;
          asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(vt + pn * BN * 128 + r * 128 + ch * 16),
                       "r"(0) : "memory");
        }
        ptx::fence_proxy_async_smem();
        ptx::named_bar_sync(1 + c, 128);
      }
      float sc[BN / 8][4];
#pragma unroll
      for (int n = 0; n < BN / 8; ++n) sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.f;
      ptx::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        const int pn = kk / 4, off = (kk % 4) * 32;  // 64-column panel, 32 bytes per k16 step
        ptx::wgmma_ss<BN, kHalf>(reinterpret_cast<float(&)[BN / 2]>(sc),
                                 ptx::smem_desc_sw128(q_rows + pn * kFwdRows * 128 + off),
                                 ptx::smem_desc_sw128(kt + pn * BN * 128 + off));
      }
      ptx::wgmma_commit();
      ptx::wgmma_wait<0>();
#pragma unroll
      for (int n = 0; n < BN / 8; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) ptx::reg_fence(sc[n][i]);
      block_softmax<BN, D / 8>(st[0], sc, j * BN, pos[0], klen, p.scale_log2, lane);
      uint32_t pa[BN / 16][4];
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) c_to_a<T>(pa[kk], sc, kk);
      ptx::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk)
        ptx::wgmma_rs<D, kHalf>(reinterpret_cast<float(&)[D / 2]>(st[0].o), pa[kk],
                                ptx::smem_desc_sw128_mn(vt + kk * 16 * 128, BN * 128));
      ptx::wgmma_commit();
      ptx::wgmma_wait<0>();
#pragma unroll
      for (int d = 0; d < D / 8; ++d)
#pragma unroll
        for (int i = 0; i < 4; ++i) ptx::reg_fence(st[0].o[d][i]);
    }
    if (tid == 0) ptx::mbar_arrive(empty(s));
  }

  const bool valid[2] = {first_row < nrows, first_row + 8 < nrows};
  T* out = static_cast<T*>(p.out);
  store_rows<T, D / 8>(
      st[0], p.scale, valid, [&](int r) { return out + ((int64_t)(row0 + first_row + 8 * r) * p.hq + h) * D; },
      [&](int r) { return p.lse + (int64_t)(row0 + first_row + 8 * r) * p.hq + h; }, 0, true, lane);
}

// Tensor map of a [T, H, D] 16-bit tensor: box of 64 columns x one head x `rows` rows, 128-byte
// swizzle, zero fill past T.
inline cudaError_t encode_rows_map(CUtensorMap* map, const void* ptr, bool half, int64_t t, int h, int d,
                                   int rows) {
  const cuda::TmaEncodeFn encode = cuda::tma_encode_fn();
  if (encode == nullptr) return cudaErrorSymbolNotFound;
  if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0) return cudaErrorInvalidValue;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(d), static_cast<cuuint64_t>(h),
                              static_cast<cuuint64_t>(t)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(d) * 2, static_cast<cuuint64_t>(h) * d * 2};
  const cuuint32_t box[3] = {64, 1, static_cast<cuuint32_t>(rows)};
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  const CUresult r = encode(map, half ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                            3, const_cast<void*>(ptr), dims, strides, box, elem_strides,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

// tq, tk: rows of q and k; grid_tiles as for launch_attention_fwd.
template <typename T, int D, int BN>
cudaError_t launch_attention_fwd_wgmma(const FwdParams& p, int64_t tq, int64_t tk, int grid_tiles,
                                       cudaStream_t stream) {
  using C = WgFwd<D, BN>;
  constexpr bool kHalf = std::is_same_v<T, __half>;
  CUtensorMap mq, mk, mv;
  cudaError_t e = encode_rows_map(&mq, p.q, kHalf, tq, p.hq, D, kFwdRows);
  if (e == cudaSuccess) e = encode_rows_map(&mk, p.k, kHalf, tk, p.hkv, D, BN);
  if (e == cudaSuccess) e = encode_rows_map(&mv, p.v, kHalf, tk, p.hkv, D, BN);
  if (e != cudaSuccess) return e;
  auto kernel = rlk_attention_fwd_wgmma_kernel<T, D, BN>;
  if ((e = set_smem(kernel, C::kSmemBytes)) != cudaSuccess) return e;
  kernel<<<grid_tiles * p.hq, C::kThreads, C::kSmemBytes, stream>>>(mq, mk, mv, p);
  return cudaGetLastError();
}

}  // namespace rl_engine::cuda::attn
