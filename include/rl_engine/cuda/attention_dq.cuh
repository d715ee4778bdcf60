// dq of the Hopper attention backward on wgmma and bulk tensor copies (sm_90a), no atomics.
//
// One CTA per 128 query rows of one head: warpgroups 0 and 1 each own 64 rows, and the first warp
// also copies the key blocks a few ahead into a ring (Q and dO once, up front). Per 128-key block:
// S = Q K^T and dP = dO V^T, dS = P (dP - delta), then dQ += dS K 16 keys at a time. Every dq
// element is one chain of k16 products over keys in order from key 0, so it depends neither on
// the block size nor on the rows that share the CTA.
#pragma once

#include "rl_engine/cuda/attention_dkdv.cuh"

namespace rl_engine::cuda::attn {

template <int D>
struct WgDq {
  static constexpr int kKeys = 128;  // keys per block
  static constexpr int kPanels = D / 64;
  static constexpr uint32_t kRowTile = kDqRows * D * 2;  // Q or dO of the CTA's rows
  static constexpr uint32_t kKeyTile = kKeys * D * 2;    // K or V of one block
  static constexpr int kStages = 2 * kRowTile + 3 * 2 * kKeyTile <= 200 * 1024 ? 3 : 2;
  static constexpr int kSmemBytes = 1024 + 2 * kRowTile + kStages * 2 * kKeyTile + RingBarriers<kStages>::kBytes;
  static constexpr int kThreads = 2 * 128;
  // Whether each warp holds its Q and dO rows in registers for S and dP (OperandA): 32 registers at
  // head_dim 64; at 128 the kernel already holds 230.
  static constexpr bool kRowsInRegs = D == 64;
  static_assert(kDqRows == 128 && kDqRows == kFwdRows, "two warpgroups of 64 rows, a QueryTile");
};

template <typename T, int D>
__global__ void __launch_bounds__(WgDq<D>::kThreads, 1)
    rlk_attention_bwd_dq_kernel(const __grid_constant__ CUtensorMap map_q,
                                const __grid_constant__ CUtensorMap map_do,
                                const __grid_constant__ CUtensorMap map_k,
                                const __grid_constant__ CUtensorMap map_v, BwdParams p) {
  using C = WgDq<D>;
  constexpr int BN = C::kKeys;
  constexpr bool kHalf = std::is_same_v<T, __half>;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  __shared__ int row_pos[kDqRows];
  const uint32_t qs = (smem_u32(smem_raw) + 1023u) & ~1023u, ds = qs + C::kRowTile;
  const uint32_t ring = ds + C::kRowTile, bars = ring + C::kStages * 2 * C::kKeyTile;
  auto k_tile = [&](int s) { return ring + 2 * s * C::kKeyTile; };
  const RingBarriers<C::kStages> rb{bars};
  const uint32_t q_bar = rb.once();

  QueryTile qt;
  if (!qt.find(p)) {
    ptx::grid_dependency_wait();
    return;
  }
  const int h = qt.h, g = qt.g, row0 = qt.row0, nrows = qt.nrows, kbase = qt.kbase, klen = qt.klen;
  qt.load_positions(p.pos, row_pos);
  rb.init(1, 2);
  __syncthreads();
  const int c = threadIdx.x / 128, tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  const int last = qt.last_key(row_pos, 0, nrows), nblocks = last < 0 ? 0 : last / BN + 1;

  const bool producer = threadIdx.x == 0;
  int pj = 0;
  auto produce = [&] {  // copies block pj once both warpgroups released its slot's previous block
    if (pj >= nblocks) return;
    const int s = pj % C::kStages;
    ptx::mbar_wait(rb.empty(s), ((pj / C::kStages) & 1) ^ 1);  // first pass: the slot starts free
    ptx::mbar_arrive_expect_tx(rb.full(s), 2 * C::kKeyTile);
    for (int pn = 0; pn < C::kPanels; ++pn) {
      ptx::tma_load_3d(k_tile(s) + pn * BN * 128, &map_k, rb.full(s), 64 * pn, g, kbase + pj * BN);
      ptx::tma_load_3d(k_tile(s) + C::kKeyTile + pn * BN * 128, &map_v, rb.full(s), 64 * pn, g, kbase + pj * BN);
    }
    ++pj;
  };
  if (producer) {
    ptx::mbar_arrive_expect_tx(q_bar, 2 * C::kRowTile);
    for (int pn = 0; pn < C::kPanels; ++pn) {
      ptx::tma_load_3d(qs + pn * kDqRows * 128, &map_q, q_bar, 64 * pn, h, row0);
      ptx::tma_load_3d(ds + pn * kDqRows * 128, &map_do, q_bar, 64 * pn, h, row0);
    }
    for (int i = 0; i < C::kStages - 1; ++i) produce();
  }

  const int wg_last = qt.last_key(row_pos, c * 64, max(0, min(64, nrows - c * 64)));
  const int first_row = c * 64 + warp * 16 + (lane >> 2);
  int last_seen[2];  // the last key each of the thread's two rows sees
  bool valid[2];
  float lse2[2], delta[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = first_row + 8 * r;
    valid[r] = row < nrows;
    const int64_t i = (int64_t)(row0 + row) * p.hq + h;
    last_seen[r] = min(row_pos[row], klen - 1);
    lse2[r] = valid[r] ? __fmul_rn(p.lse[i], kLog2e) : 0.f;
    delta[r] = valid[r] ? p.delta[i] : 0.f;
  }
  float acc[D / 8][4];
#pragma unroll
  for (int d = 0; d < D / 8; ++d) acc[d][0] = acc[d][1] = acc[d][2] = acc[d][3] = 0.f;
  ptx::mbar_wait(q_bar, 0);
  const OperandA<D, C::kRowsInRegs> qa(qs + c * 64 * 128, kDqRows * 128, warp, lane),
      da(ds + c * 64 * 128, kDqRows * 128, warp, lane);

  // Block j's S arrives in sc: then dP alone, whose run hides the exponentials of P, and
  // dS = P (dP - delta) into a.
  float sc[BN / 8][4], dp[BN / 8][4];
  uint32_t a[BN / 16][4];  // dS of the block before, for its dQ += dS K
  auto finish_block = [&](int j) {
    const int s = j % C::kStages;
    zero_tiles(dp);
    fence_tiles(dp);
    ptx::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) da.template step<BN, kHalf>(dp, k_tile(s) + C::kKeyTile, BN * 128, kk);
    ptx::wgmma_commit();
#pragma unroll
    for (int n = 0; n < BN / 8; ++n) {
#pragma unroll
      for (int i = 0; i < 4; ++i) sc[n][i] = ex2(__fmaf_rn(sc[n][i], p.scale_log2, -lse2[i >> 1]));
    }
    ptx::wgmma_wait<0>();
    fence_tiles(dp);
#pragma unroll
    for (int n = 0; n < BN / 8; ++n) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int key = j * BN + n * 8 + 2 * (lane & 3) + (i & 1), r = i >> 1;
        sc[n][i] = key <= last_seen[r] ? __fmul_rn(sc[n][i], __fsub_rn(dp[n][i], delta[r])) : 0.f;
      }
    }
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) c_to_a<T>(a[kk], sc, kk);
  };
  // Waits for block j; keys past the sequence get dS = 0, but the copy read whatever follows it:
  // zero those K rows so that 0 * K adds exactly zero even for inf or NaN there.
  auto arrived = [&](int j) {
    const int s = j % C::kStages;
    ptx::mbar_wait(rb.full(s), (j / C::kStages) & 1);
    if ((j + 1) * BN > klen) {
      zero_rows<D, BN>(k_tile(s), klen - j * BN, tid);
      ptx::fence_proxy_async_smem();
      ptx::named_bar_sync(1 + c, 128);
    }
  };
  auto zero_scores = [&] {
    zero_tiles(sc);
    fence_tiles(sc);  // before the wgmma fence: see two_kmajor_products
  };
  // Issues the k16 steps of S = Q K^T for block j.
  auto scores = [&](int j) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) qa.template step<BN, kHalf>(sc, k_tile(j % C::kStages), BN * 128, kk);
  };
  auto dq_steps = [&](int j) {
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) nmajor_step<D, kHalf>(acc, a[kk], k_tile(j % C::kStages), BN * 128, kk);
  };
  auto release = [&](int j) {
    if (tid == 0) ptx::mbar_arrive(rb.empty(j % C::kStages));
  };

  // The warpgroup computes blocks [0, mine): block j - 1's dQ += dS K goes with block j's S, then
  // block j's dP alone, as in dk/dv (attention_dkdv.cuh); each accumulator sees the same products
  // in the same order. No product is in flight across the loop's back edge, none on a branch. The
  // copy of block j + kStages - 1 waits for block j - 1's release.
  const int mine = wg_last < 0 ? 0 : min(nblocks, wg_last / BN + 1);
  if (mine > 0) {
    if (producer) produce();  // block kStages - 1, into a slot not yet used
    arrived(0);
    zero_scores();
    ptx::wgmma_fence();
    scores(0);
    ptx::wgmma_commit();
    ptx::wgmma_wait<0>();
    fence_tiles(sc);
    finish_block(0);
    for (int j = 1; j < mine; ++j) {
      arrived(j);
      zero_scores();
      ptx::wgmma_fence();
      dq_steps(j - 1);
      scores(j);
      ptx::wgmma_commit();
      ptx::wgmma_wait<0>();
      fence_tiles(acc);
      fence_tiles(sc);
      fence_a(a);
      release(j - 1);
      if (producer) produce();  // block j + kStages - 1
      finish_block(j);
    }
    ptx::wgmma_fence();
    dq_steps(mine - 1);
    ptx::wgmma_commit();
    ptx::wgmma_wait<0>();
    fence_tiles(acc);
    fence_a(a);
    release(mine - 1);
  }
  // Blocks past this warpgroup's rows are given back as they arrive (the copy thread keeps
  // copying for the other warpgroup).
  for (int j = mine; j < nblocks; ++j) {
    if (producer) produce();  // block j + kStages - 1
    ptx::mbar_wait(rb.full(j % C::kStages), (j / C::kStages) & 1);
    release(j);
  }

  T* dq = static_cast<T*>(p.dq);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (!valid[r]) continue;
    T* o = dq + ((int64_t)(row0 + first_row + 8 * r) * p.hq + h) * D;
#pragma unroll
    for (int d = 0; d < D / 8; ++d) {
      *reinterpret_cast<uint32_t*>(o + d * 8 + 2 * (lane & 3)) =
          pack2<T>(__fmul_rn(acc[d][2 * r], p.scale), __fmul_rn(acc[d][2 * r + 1], p.scale));
    }
  }
  // Launched behind dk/dv (launch_attention_bwd), which this kernel neither reads nor writes, it may
  // start in dk/dv's last wave; it ends only once dk/dv has, so that work after it in the stream
  // sees dk and dv.
  ptx::grid_dependency_wait();
}

template <typename T, int D>
cudaError_t launch_attention_dq(const BwdParams& p, int64_t tq, int64_t tk, int q_tiles, cudaStream_t stream,
                                bool behind_dkdv = false) {
  using C = WgDq<D>;
  constexpr bool kHalf = std::is_same_v<T, __half>;
  CUtensorMap mq, mdo, mk, mv;
  cudaError_t e = encode_rows_map(&mq, p.q, kHalf, tq, p.hq, D, kDqRows);
  if (e == cudaSuccess) e = encode_rows_map(&mdo, p.dout, kHalf, tq, p.hq, D, kDqRows);
  if (e == cudaSuccess) e = encode_rows_map(&mk, p.k, kHalf, tk, p.hkv, D, C::kKeys);
  if (e == cudaSuccess) e = encode_rows_map(&mv, p.v, kHalf, tk, p.hkv, D, C::kKeys);
  if (e != cudaSuccess) return e;
  auto kernel = rlk_attention_bwd_dq_kernel<T, D>;
  if ((e = set_smem(kernel, C::kSmemBytes)) != cudaSuccess) return e;
  PdlLaunch launch(q_tiles * p.hq, C::kThreads, C::kSmemBytes, stream, behind_dkdv);
  return cudaLaunchKernelEx(&launch.cfg, kernel, mq, mdo, mk, mv, p);
}

}  // namespace rl_engine::cuda::attn
