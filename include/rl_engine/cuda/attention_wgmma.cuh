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

// The 128-row query tile of one q head a CTA serves: blockIdx.x = (tiles counted from the last) *
// hq + h, so the longest causal walks start first. Shared by the forward and the backward's dq.
struct QueryTile {
  int h, g, row0, nrows, kbase, klen;
  // Finds the CTA's tile; false past the last one (the whole CTA returns).
  template <typename Params>
  __device__ __forceinline__ bool find(const Params& p) {
    h = blockIdx.x % p.hq;
    const int rev = blockIdx.x / p.hq, total = count_tiles(p.cu_q, p.batch, kFwdRows);
    int b, tile;
    if (rev >= total || !find_tile(p.cu_q, p.batch, kFwdRows, total - 1 - rev, b, tile)) return false;
    row0 = p.cu_q[b] + tile * kFwdRows;
    nrows = min(kFwdRows, p.cu_q[b + 1] - row0);
    kbase = p.cu_k[b];
    klen = p.cu_k[b + 1] - kbase;
    g = h / (p.hq / p.hkv);
    return true;
  }
  // Threads below kFwdRows store their row's position in row_pos (0 past the tile).
  __device__ __forceinline__ void load_positions(const int64_t* pos, int* row_pos) const {
    if (threadIdx.x < kFwdRows)
      row_pos[threadIdx.x] = threadIdx.x < nrows ? static_cast<int>(pos[row0 + threadIdx.x]) : 0;
  }
  // The last key any of `rows` rows from `first` sees (-1: none).
  __device__ __forceinline__ int last_key(const int* row_pos, int first, int rows) const {
    int m = -1;
    for (int r = 0; r < rows; ++r) m = max(m, row_pos[first + r]);
    return min(m, klen - 1);
  }
};

template <int NT>
__device__ __forceinline__ void zero_tiles(float (&x)[NT][4]) {
#pragma unroll
  for (int n = 0; n < NT; ++n) x[n][0] = x[n][1] = x[n][2] = x[n][3] = 0.f;
}

// Keeps the compiler from moving accesses of wgmma accumulators across its fences and waits.
template <int NT>
__device__ __forceinline__ void fence_tiles(float (&x)[NT][4]) {
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) ptx::reg_fence(x[n][i]);
}

// The same for register A fragments of a wgmma in flight.
template <int KT>
__device__ __forceinline__ void fence_a(uint32_t (&a)[KT][4]) {
#pragma unroll
  for (int k = 0; k < KT; ++k)
#pragma unroll
    for (int i = 0; i < 4; ++i) ptx::reg_fence(a[k][i]);
}

// The A operand of a warpgroup's K-major products: its 64 rows of a tile of 64-column panels with
// 128-byte swizzle (`panel` bytes apart) in shared memory, D columns. Where kRegs, each warp loads its
// 16 rows once as m16n8k16 A fragments and the products read only B from shared memory: an
// m64n64k16 product with both operands there reads 4 KB in the 32 clocks it takes, the SM's whole
// shared-memory bandwidth. The same products in the same order either way.
template <int D, bool kRegs>
struct OperandA {
  uint32_t tile, panel;
  uint32_t frag[kRegs ? D / 16 : 1][4];
  // rows: the warpgroup's first row in a 1024-byte aligned tile (the swizzle repeats every 8 rows).
  __device__ __forceinline__ OperandA(uint32_t rows, uint32_t panel_bytes, int warp, int lane)
      : tile(rows), panel(panel_bytes) {
    if constexpr (kRegs) {
      // ldmatrix x4: lanes 0-15 give rows 0-15 at k 0-7 of the step, lanes 16-31 the same rows at
      // k 8-15, so the four matrices land as A fragment registers 0-3.
      const int r = warp * 16 + (lane & 15);
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        const int chunk = (kk % 4) * 2 + (lane >> 4);  // 16-byte chunk within the 128-byte row
        ldsm_x4(frag[kk], rows + (kk / 4) * panel_bytes + r * 128 + ((chunk ^ (r & 7)) << 4));
      }
    }
  }
  // Issues k16 step kk of acc[64 x N] += A . B^T, B a K-major tile of 64-column panels (b_panel
  // bytes apart) in shared memory.
  template <int N, bool kHalf>
  __device__ __forceinline__ void step(float (&acc)[N / 8][4], uint32_t b, uint32_t b_panel, int kk) const {
    const int pn = kk / 4, off = (kk % 4) * 32;  // 64-column panel, 32 bytes per k16 step
    auto& d = reinterpret_cast<float(&)[N / 2]>(acc);
    if constexpr (kRegs)
      ptx::wgmma_rs<N, kHalf, false>(d, frag[kk], ptx::smem_desc_sw128(b + pn * b_panel + off));
    else
      ptx::wgmma_ss<N, kHalf>(d, ptx::smem_desc_sw128(tile + pn * panel + off),
                              ptx::smem_desc_sw128(b + pn * b_panel + off));
  }
};

// Issues the D / 16 k16 steps of x += XA . XB^T and y += YA . YB^T, interleaved (the B tiles b_panel
// bytes between panels); the caller fences, commits and waits.
template <int N, int D, bool kHalf, bool kRegs>
__device__ __forceinline__ void two_kmajor_steps(float (&x)[N / 8][4], const OperandA<D, kRegs>& xa, uint32_t xb,
                                                 float (&y)[N / 8][4], const OperandA<D, kRegs>& ya, uint32_t yb,
                                                 uint32_t b_panel) {
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    xa.template step<N, kHalf>(x, xb, b_panel, kk);
    ya.template step<N, kHalf>(y, yb, b_panel, kk);
  }
}

// x = XA . XB^T and y = YA . YB^T from zero, issued together and waited for once.
template <int N, int D, bool kHalf, bool kRegs>
__device__ __forceinline__ void two_kmajor_products(float (&x)[N / 8][4], const OperandA<D, kRegs>& xa, uint32_t xb,
                                                    float (&y)[N / 8][4], const OperandA<D, kRegs>& ya, uint32_t yb,
                                                    uint32_t b_panel) {
  zero_tiles(x);
  zero_tiles(y);
  // The zeros are written before the fence: left to itself the compiler may sink them past it,
  // and ptxas then serializes the products (C7519 / C7520).
  fence_tiles(x);
  fence_tiles(y);
  ptx::wgmma_fence();
  two_kmajor_steps<N, D, kHalf>(x, xa, xb, y, ya, yb, b_panel);
  ptx::wgmma_commit();
  ptx::wgmma_wait<0>();
  fence_tiles(x);
  fence_tiles(y);
}

// The mbarriers of a ring of kStages stages: full(s) (the copy's arrival and bytes), empty(s)
// (one arrival per consumer warpgroup), and `once` for a copy made one time (Q, or K and V).
template <int kStages>
struct RingBarriers {
  uint32_t bars;
  __device__ __forceinline__ uint32_t full(int s) const { return bars + 8u * s; }
  __device__ __forceinline__ uint32_t empty(int s) const { return bars + 8u * (kStages + s); }
  __device__ __forceinline__ uint32_t once() const { return bars + 8u * 2 * kStages; }
  static constexpr int kBytes = (2 * kStages + 1) * 8;
  // Thread 0 initialises them; the CTA syncs before any thread uses them.
  __device__ __forceinline__ void init(uint32_t full_count, uint32_t empty_count) const {
    if (threadIdx.x != 0) return;
    for (int s = 0; s < kStages; ++s) {
      ptx::mbar_init(full(s), full_count);
      ptx::mbar_init(empty(s), empty_count);
    }
    ptx::mbar_init(once(), 1);
    ptx::fence_barrier_init();
  }
};

// Issues k16 step kk of acc[64 x N] += A . B, A's fragment in registers, B an N-major [k][N]
// tile of 64-column panels (panel bytes apart) in shared memory.
template <int N, bool kHalf>
__device__ __forceinline__ void nmajor_step(float (&acc)[N / 8][4], const uint32_t (&a)[4], uint32_t b,
                                            uint32_t panel, int kk) {
  ptx::wgmma_rs<N, kHalf>(reinterpret_cast<float(&)[N / 2]>(acc), a, ptx::smem_desc_sw128_mn(b + kk * 16 * 128, panel));
}

// Zeroes rows [from, to) of a [ROWS][D] tile of 64-column panels in shared memory (tid of 128).
template <int D, int ROWS>
__device__ __forceinline__ void zero_rows(uint32_t tile, int from, int tid, int to = ROWS) {
  constexpr int kPanels = D / 64;
  for (int i = tid; i < (to - from) * kPanels * 8; i += 128) {
    const int r = from + i / (kPanels * 8), pn = (i / 8) % kPanels, ch = i % 8;
    asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(tile + pn * ROWS * 128 + r * 128 + ch * 16),
                 "r"(0)
                 : "memory");
  }
}

template <int D, int BN>
struct WgFwd {
  static constexpr int kPanels = D / 64;
  static constexpr uint32_t kQBytes = kFwdRows * D * 2;
  static constexpr uint32_t kTileBytes = BN * D * 2;  // one K or V block
  static constexpr int kStages = 2 * kTileBytes * 3 + kQBytes <= 160 * 1024 ? 3 : 2;
  static constexpr uint32_t kRingBytes = kStages * 2 * kTileBytes;
  static constexpr int kSmemBytes = 1024 + kQBytes + kRingBytes + RingBarriers<kStages>::kBytes;
  static constexpr int kThreads = 3 * 128;
  // Whether a block's P . V overlaps the next block's softmax (below). The P fragments it keeps in
  // flight cost BN / 4 registers more; beside the producer warpgroup every thread has 168, which
  // holds them for blocks of 64 keys or head_dim 64 but not for 128 x 128 (spills).
  static constexpr bool kOverlap = BN == 64 || D == 64;
};

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
  const RingBarriers<C::kStages> rb{bars};
  const uint32_t q_bar = rb.once();

  QueryTile qt;
  if (!qt.find(p)) return;
  const int h = qt.h, g = qt.g, row0 = qt.row0, nrows = qt.nrows, kbase = qt.kbase, klen = qt.klen;
  qt.load_positions(p.pos, row_pos);
  rb.init(1, 2);
  __syncthreads();
  const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;

  if (wg == 0) {
    ptx::setmaxnreg_dec<24>();
    if (tid != 0) return;
    const int last = qt.last_key(row_pos, 0, min(nrows, kFwdRows));
    const int nblocks = last < 0 ? 0 : last / BN + 1;
    ptx::mbar_arrive_expect_tx(q_bar, C::kQBytes);
    for (int pn = 0; pn < C::kPanels; ++pn)
      ptx::tma_load_3d(qs + pn * kFwdRows * 128, &map_q, q_bar, 64 * pn, h, row0);
    for (int j = 0; j < nblocks; ++j) {
      const int s = j % C::kStages;
      ptx::mbar_wait(rb.empty(s), ((j / C::kStages) & 1) ^ 1);  // first pass: the slot starts free
      ptx::mbar_arrive_expect_tx(rb.full(s), 2 * C::kTileBytes);
      for (int pn = 0; pn < C::kPanels; ++pn) {
        ptx::tma_load_3d(k_tile(s) + pn * BN * 128, &map_k, rb.full(s), 64 * pn, g, kbase + j * BN);
        ptx::tma_load_3d(k_tile(s) + C::kTileBytes + pn * BN * 128, &map_v, rb.full(s), 64 * pn, g,
                         kbase + j * BN);
      }
    }
    return;
  }

  ptx::setmaxnreg_inc<240>();
  const int c = wg - 1, warp = tid / 32, lane = tid % 32;
  const int last = qt.last_key(row_pos, 0, min(nrows, kFwdRows));
  const int nblocks = last < 0 ? 0 : last / BN + 1;
  const int wg_last = qt.last_key(row_pos, c * 64, max(0, min(64, nrows - c * 64)));
  const int first_row = c * 64 + warp * 16 + (lane >> 2);
  const int pos[1][2] = {{row_pos[first_row], row_pos[first_row + 8]}};
  RowState<D / 8> st[1];
  st[0].init();
  ptx::mbar_wait(q_bar, 0);
  // Q stays in shared memory: in registers (OperandA) the forward at head_dim 64, blocks of 64, got
  // 1.5% slower on an H100, and beside head_dim 128's output or a block of 128's P they spill.
  const OperandA<D, false> qa(qs + c * 64 * 128, kFwdRows * 128, warp, lane);

  // A block's P . V is issued together with the next block's scores, so it runs on the tensor
  // cores while this warpgroup exponentiates that next block (the output's rescale by the next
  // block's alpha waits for it). Each value still sees the same operations in the same order:
  // o *= alpha_j, then o += P_j . V_j. The first block is peeled off the loop and the last P . V
  // follows it, so that no wgmma sits on a branch (the compiler would serialize them all).
  uint32_t pa[BN / 16][4];  // P of the previous block, whose P . V is issued with this block's scores
  // Waits for block j in stage s.
  auto arrived = [&](int j, int s) {
    ptx::mbar_wait(rb.full(s), (j / C::kStages) & 1);
    if ((j + 1) * BN > klen) {
      // Keys past the sequence are masked, but the copy read whatever follows it (the next
      // sequence); zero those V rows so that 0 * V adds exactly zero even for inf or NaN there.
      zero_rows<D, BN>(k_tile(s) + C::kTileBytes, klen - j * BN, tid);
      ptx::fence_proxy_async_smem();
      ptx::named_bar_sync(1 + c, 128);
    }
  };
  // Issues the scores of the block in stage s, into sc.
  auto scores = [&](int s, float (&sc)[BN / 8][4]) {
    zero_tiles(sc);
    ptx::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) qa.template step<BN, kHalf>(sc, k_tile(s), BN * 128, kk);
    ptx::wgmma_commit();
  };
  // The two warpgroups take turns to issue their products (named barriers 3 and 4, warpgroup 0
  // first): one warpgroup's products run on the tensor cores while the other exponentiates, where
  // both would otherwise issue at once and then both wait. Each warpgroup takes nblocks + 1 turns,
  // the ones past its own rows empty, so that the turns pair up; warpgroup 1 hands none on after
  // its last. Only when each warpgroup issues changes, never what.
  int turns = 0;
  auto take_turn = [&] { ptx::named_bar_sync(3 + c, 256); };
  auto pass_turn = [&] {
    if (c == 0 || turns < nblocks) ptx::named_bar_arrive(3 + (c ^ 1), 256);
    ++turns;
  };
  auto issue_pv = [&](int s) {
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) nmajor_step<D, kHalf>(st[0].o, pa[kk], k_tile(s) + C::kTileBytes, BN * 128, kk);
    ptx::wgmma_commit();
  };
  // Once the wait covering P . V of stage s has passed: pa's registers stayed untouched until
  // here, and the stage goes back to the producer.
  auto land_pv = [&](int s) {
    fence_tiles(st[0].o);
    fence_a(pa);
    if (tid == 0) ptx::mbar_arrive(rb.empty(s));
  };
  // The softmax of block j up to the output's rescale (alpha).
  auto softmax = [&](int j, float (&sc)[BN / 8][4], float (&alpha)[2]) {
    fence_tiles(sc);
    float mx[2] = {-kInf, -kInf}, ms[2];
    mask_scores<BN / 8>(sc, j * BN, pos[0], klen, lane, mx);
    quad_max(mx);
    move_max(st[0], mx, p.scale_log2, ms, alpha);
    exponentiate<BN / 8>(sc, ms, p.scale_log2);
    add_to_denominator<BN / 8>(st[0].l, sc);
  };
  // The warpgroup computes blocks [0, mine); the rest of the walk is past its rows.
  auto overlapped_walk = [&] {
    const int mine = wg_last < 0 ? 0 : min(nblocks, wg_last / BN + 1);
    if (c == 1) ptx::named_bar_arrive(3, 256);  // warpgroup 0 takes the first turn
    if (mine > 0) {
      float sc[BN / 8][4], alpha[2];
      arrived(0, 0);
      take_turn();
      scores(0, sc);
      pass_turn();
      ptx::wgmma_wait<0>();
      softmax(0, sc, alpha);
      rescale_output(st[0].o, alpha);
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) c_to_a<T>(pa[kk], sc, kk);
      for (int j = 1; j < mine; ++j) {
        const int s = j % C::kStages, prev = (j - 1) % C::kStages;
        arrived(j, s);
        take_turn();
        scores(s, sc);
        issue_pv(prev);
        pass_turn();
        ptx::wgmma_wait<1>();  // the scores; P . V of the previous block may still run
        softmax(j, sc, alpha);
        ptx::wgmma_wait<0>();
        land_pv(prev);
        rescale_output(st[0].o, alpha);
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) c_to_a<T>(pa[kk], sc, kk);
      }
      take_turn();
      ptx::wgmma_fence();
      issue_pv((mine - 1) % C::kStages);
      pass_turn();
      ptx::wgmma_wait<0>();
      land_pv((mine - 1) % C::kStages);
    }
    // Blocks past this warpgroup's rows: each is given back as it arrives, with one empty turn, so
    // that the other warpgroup's turns never wait on a stage this one holds.
    for (int j = mine; j < nblocks; ++j) {
      const int s = j % C::kStages;
      ptx::mbar_wait(rb.full(s), (j / C::kStages) & 1);
      if (tid == 0) ptx::mbar_arrive(rb.empty(s));
      take_turn();
      pass_turn();
    }
    if (turns <= nblocks) {  // no block of its own: the turn of the last P . V
      take_turn();
      pass_turn();
    }
  };

  if constexpr (C::kOverlap) {
    overlapped_walk();
  } else {
    for (int j = 0; j < nblocks; ++j) {
      const int s = j % C::kStages;
      ptx::mbar_wait(rb.full(s), (j / C::kStages) & 1);
      if (j * BN <= wg_last) {
        const uint32_t kt = k_tile(s), vt = kt + C::kTileBytes;
        if ((j + 1) * BN > klen) {
          // Keys past the sequence are masked, but the copy read whatever follows it (the next
          // sequence); zero those V rows so that 0 * V adds exactly zero even for inf or NaN there.
          zero_rows<D, BN>(vt, klen - j * BN, tid);
          ptx::fence_proxy_async_smem();
          ptx::named_bar_sync(1 + c, 128);
        }
        float sc[BN / 8][4];
        zero_tiles(sc);
        ptx::wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) qa.template step<BN, kHalf>(sc, kt, BN * 128, kk);
        ptx::wgmma_commit();
        ptx::wgmma_wait<0>();
        fence_tiles(sc);
        block_softmax<BN, D / 8>(st[0], sc, j * BN, pos[0], klen, p.scale_log2, lane);
        uint32_t pa[BN / 16][4];
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) c_to_a<T>(pa[kk], sc, kk);
        ptx::wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) nmajor_step<D, kHalf>(st[0].o, pa[kk], vt, BN * 128, kk);
        ptx::wgmma_commit();
        ptx::wgmma_wait<0>();
        fence_tiles(st[0].o);
      }
      if (tid == 0) ptx::mbar_arrive(rb.empty(s));
    }
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
