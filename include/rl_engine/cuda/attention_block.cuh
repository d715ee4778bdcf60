// One KV block of the Hopper attention forward, shared by the prefill and decode kernels: the
// running softmax state of a warp's rows, the three steps that fold a block into it (scores,
// softmax update, P . V), the final store, and the cp.async walk over the blocks.
//
// A row's bits depend only on the sequence of operations on its own accumulators. Every step
// below gives each accumulator the same operations in the same order whatever the number of
// m16 row tiles a warp carries (MT) and whichever warp computes which key or output tiles, so
// the kernels may arrange the work differently and still agree bit for bit.
#pragma once

#include "rl_engine/cuda/attention_tiles.cuh"

namespace rl_engine::cuda::attn {

// Running state of 16 query rows over NO output n8 tiles: this thread holds rows lane/4 (index 0)
// and lane/4 + 8 (index 1), columns 8 * tile + 2 * (lane % 4) + {0, 1}.
template <int NO>
struct RowState {
  float o[NO][4];
  float m[2];  // running max of raw scores
  float l[2];  // this thread's partial of the softmax denominator
  __device__ __forceinline__ void init() {
#pragma unroll
    for (int i = 0; i < NO; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    m[0] = m[1] = -kInf;
    l[0] = l[1] = 0.f;
  }
};

// The A fragments of one 16-row query tile held in registers for the whole walk (the decode's
// query heads); called as a block_scores qfrag.
template <int D>
struct QInRegisters {
  uint32_t f[D / 16][4];
  __device__ __forceinline__ void load(uint32_t tile, int row0, int lane) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) load_a<D>(f[kk], tile, row0, kk * 16, lane);
  }
  __device__ __forceinline__ void operator()(int, int kk, uint32_t (&a)[4]) const {
#pragma unroll
    for (int i = 0; i < 4; ++i) a[i] = f[kk][i];
  }
};

// s = Q . K^T for MT row tiles and the NS n8 key tiles from tile n0 of the block in `ks`.
// qfrag(mt, kk, a) gives row tile mt's A fragment of k-step kk (from registers or shared memory).
template <typename T, int D, int NS, int MT, typename QFrag>
__device__ __forceinline__ void block_scores(float (&s)[MT][NS][4], QFrag&& qfrag, uint32_t ks,
                                             int n0, int lane) {
  static_assert(NS % 2 == 0, "key tiles are loaded in pairs");
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int n = 0; n < NS; ++n) s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.f;
  }
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    uint32_t a[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) qfrag(mt, kk, a[mt]);
#pragma unroll
    for (int n = 0; n < NS; n += 2) {
      uint32_t b[4];
      load_b<D>(b, ks, (n0 + n) * 8, kk * 16, lane);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        mma<T>(s[mt][n], a[mt], b[0], b[1]);
        mma<T>(s[mt][n + 1], a[mt], b[2], b[3]);
      }
    }
  }
}

// The softmax update of a block, in steps that the kernels compose (block_softmax below, or the
// decode spreading one block over several warps). Each step spells out its roundings.

// Masks NT n8 key tiles of scores, from key kstart (a key is visible to a row at position pos when
// key <= pos and key < klen), and folds them into this thread's row maxima mx. Tiles visible to
// both rows whole are left as they are (the select would keep every value).
template <int NT>
__device__ __forceinline__ void mask_scores(float (&s)[NT][4], int kstart, const int (&pos)[2], int klen,
                                            int lane, float (&mx)[2]) {
  if (kstart + NT * 8 - 1 > min(pos[0], pos[1]) || kstart + NT * 8 > klen) {
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int key = kstart + n * 8 + 2 * (lane & 3) + (i & 1);
        s[n][i] = key <= pos[i >> 1] && key < klen ? s[n][i] : -kInf;
      }
    }
  }
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) mx[i >> 1] = fmaxf(mx[i >> 1], s[n][i]);
}

// The row maxima of the four lanes that share each row (exact: max is order free).
__device__ __forceinline__ void quad_max(float (&mx)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    mx[r] = fmaxf(mx[r], shfl_xor(mx[r], 1));
    mx[r] = fmaxf(mx[r], shfl_xor(mx[r], 2));
  }
}

// Moves the running max to include the block's max mx and rescales l; alpha receives the factor
// the output tiles take (rescale_output) and ms the new max times scale_log2 (0 while the row has
// seen no visible key). Split from the output's rescale so that a kernel may apply that one once
// the output's previous products have landed.
template <int NO>
__device__ __forceinline__ void move_max(RowState<NO>& st, const float (&mx)[2], float scale_log2,
                                         float (&ms)[2], float (&alpha)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float m_new = fmaxf(st.m[r], mx[r]);
    alpha[r] = m_new == st.m[r] ? 1.f : ex2(__fmul_rn(__fsub_rn(st.m[r], m_new), scale_log2));
    ms[r] = m_new == -kInf ? 0.f : __fmul_rn(m_new, scale_log2);
    st.m[r] = m_new;
    st.l[r] = __fmul_rn(st.l[r], alpha[r]);
  }
}

template <int NO>
__device__ __forceinline__ void rescale_output(float (&o)[NO][4], const float (&alpha)[2]) {
#pragma unroll
  for (int d = 0; d < NO; ++d) {
    o[d][0] = __fmul_rn(o[d][0], alpha[0]);
    o[d][1] = __fmul_rn(o[d][1], alpha[0]);
    o[d][2] = __fmul_rn(o[d][2], alpha[1]);
    o[d][3] = __fmul_rn(o[d][3], alpha[1]);
  }
}

// move_max, then the output's rescale.
template <int NO>
__device__ __forceinline__ void rescale_rows(RowState<NO>& st, const float (&mx)[2], float scale_log2,
                                             float (&ms)[2]) {
  float alpha[2];
  move_max(st, mx, scale_log2, ms, alpha);
  rescale_output(st.o, alpha);
}

// s -> exp2(s * scale_log2 - ms) for NT n8 key tiles.
template <int NT>
__device__ __forceinline__ void exponentiate(float (&s)[NT][4], const float (&ms)[2], float scale_log2) {
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) s[n][i] = ex2(__fmaf_rn(s[n][i], scale_log2, -ms[i >> 1]));
}

// l += the probabilities of NT n8 key tiles, tile by tile in key order.
template <int NT>
__device__ __forceinline__ void add_to_denominator(float (&l)[2], const float (&p)[NT][4]) {
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) l[i >> 1] = __fadd_rn(l[i >> 1], p[n][i]);
}

// The whole update of one row tile by a block: mask, max, rescale, then s becomes the block's
// probabilities. A block fully masked for a row leaves its state unchanged (alpha = 1, p = 0).
template <int BN, int NO>
__device__ __forceinline__ void block_softmax(RowState<NO>& st, float (&s)[BN / 8][4], int kstart,
                                              const int (&pos)[2], int klen, float scale_log2,
                                              int lane) {
  float mx[2] = {-kInf, -kInf}, ms[2];
  mask_scores<BN / 8>(s, kstart, pos, klen, lane, mx);
  quad_max(mx);
  rescale_rows(st, mx, scale_log2, ms);
  exponentiate<BN / 8>(s, ms, scale_log2);
  add_to_denominator<BN / 8>(st.l, s);
}

// o += P . V for MT row tiles over the states' NO output tiles, which start at column d0 of the
// V tile in `vs`.
template <typename T, int D, int BN, int NO, int MT>
__device__ __forceinline__ void block_pv(RowState<NO> (&st)[MT], const float (&s)[MT][BN / 8][4],
                                         uint32_t vs, int d0, int lane) {
  static_assert(NO % 2 == 0, "value tiles are loaded in pairs");
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk) {
    uint32_t a[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) c_to_a<T>(a[mt], s[mt], kk);
#pragma unroll
    for (int d = 0; d < NO; d += 2) {
      uint32_t b[4];
      load_b_t<D>(b, vs, kk * 16, d0 + d * 8, lane);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        mma<T>(st[mt].o[d], a[mt], b[0], b[1]);
        mma<T>(st[mt].o[d + 1], a[mt], b[2], b[3]);
      }
    }
  }
}

// Folds the KV block starting at key `kstart` (tiles ks, vs of BN rows) into MT whole-row states.
template <typename T, int D, int BN, int MT, typename QFrag>
__device__ __forceinline__ void attention_block(RowState<D / 8> (&st)[MT], QFrag&& qfrag, uint32_t ks,
                                                uint32_t vs, int kstart, const int (&pos)[MT][2],
                                                int klen, float scale_log2, int lane) {
  float s[MT][BN / 8][4];
  block_scores<T, D, BN / 8, MT>(s, qfrag, ks, 0, lane);
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
    block_softmax<BN, D / 8>(st[mt], s[mt], kstart, pos[mt], klen, scale_log2, lane);
  block_pv<T, D, BN, D / 8, MT>(st, s, vs, 0, lane);
}

// The softmax denominator of a row: the partials of the four lanes that share it.
__device__ __forceinline__ float row_total(float l) {
  l = __fadd_rn(l, shfl_xor(l, 1));
  return __fadd_rn(l, shfl_xor(l, 2));
}

// out = o / l (one rounding to T), lse = m * scale + ln(l), with l the rows' whole denominators.
// The state's tiles are output columns col0.. ; rows r with valid[r] false are not stored, nor the
// lse when write_lse is false. out_row(r) gives the T* of row r's D outputs; lse_at(r) its float*.
template <typename T, int NO, typename OutRow, typename LseAt>
__device__ __forceinline__ void store_rows_with(const RowState<NO>& st, const float (&l)[2], float scale,
                                                const bool (&valid)[2], OutRow&& out_row, LseAt&& lse_at,
                                                int col0, bool write_lse, int lane) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float inv = __frcp_rn(l[r]);
    if (!valid[r]) continue;
    T* out = out_row(r);
#pragma unroll
    for (int d = 0; d < NO; ++d) {
      const int c = col0 + d * 8 + 2 * (lane & 3);
      *reinterpret_cast<uint32_t*>(out + c) =
          pack2<T>(__fmul_rn(st.o[d][2 * r], inv), __fmul_rn(st.o[d][2 * r + 1], inv));
    }
    if (write_lse && (lane & 3) == 0) *lse_at(r) = __fadd_rn(__fmul_rn(st.m[r], scale), __logf(l[r]));
  }
}

// store_rows_with for a state that holds its own denominator partials.
template <typename T, int NO, typename OutRow, typename LseAt>
__device__ __forceinline__ void store_rows(const RowState<NO>& st, float scale, const bool (&valid)[2],
                                           OutRow&& out_row, LseAt&& lse_at, int col0,
                                           bool write_lse, int lane) {
  const float l[2] = {row_total(st.l[0]), row_total(st.l[1])};
  store_rows_with<T, NO>(st, l, scale, valid, out_row, lse_at, col0, write_lse, lane);
}

// Blocks 0..nblocks-1 through a `kStages`-deep cp.async ring of (K, V) tile pairs of tile_bytes
// each at `ring`: load(j, k_tile, v_tile) issues block j's copies, and compute(j, k_tile, v_tile,
// refill) folds block j in once it has landed (every copy committed before the walk has landed
// too). compute calls refill() exactly once: it issues block j + kStages - 1's copies into block
// j - 1's slot, so every thread must be done reading that slot by then (a barrier of compute's
// own, or the walk's at the top of block j when refill() comes first).
template <int kStages, typename Load, typename Compute>
__device__ __forceinline__ void kv_walk_refill(uint32_t ring, int tile_bytes, int nblocks, Load&& load,
                                               Compute&& compute) {
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < nblocks) load(s, ring + (2 * s) * tile_bytes, ring + (2 * s + 1) * tile_bytes);
    cp_async_commit();
  }
  for (int j = 0; j < nblocks; ++j) {
    cp_async_wait<kStages - 2>();
    __syncthreads();
    auto refill = [&] {
      const int nj = j + kStages - 1;
      if (nj < nblocks) {
        const int s = nj % kStages;
        load(nj, ring + (2 * s) * tile_bytes, ring + (2 * s + 1) * tile_bytes);
      }
      cp_async_commit();
    };
    const int s = j % kStages;
    compute(j, ring + (2 * s) * tile_bytes, ring + (2 * s + 1) * tile_bytes, refill);
  }
}

// Blocks 0..nblocks-1 through a ring of three tiles, a block's K and V never in the same slot
// twice running: K_j sits in tile 2j % 3 and V_j in tile (2j + 1) % 3, so the tiles block j - 1
// read take V_j and K_{j+1}. At the top of block j, once K_j has landed and every thread is past
// block j - 1 (the barrier), V_j and K_{j+1} are issued (load_v(j, tile), load_k(j + 1, tile)) and
// compute(j, k_tile, v_tile, wait_v) folds block j in; wait_v() waits for this thread's copies of
// V_j (K_{j+1}'s may still fly), and compute reaches a barrier after it before reading V. Three
// tiles where two stages of (K, V) pairs take four: the K copies of a block have a whole block to
// land, its V copies the time its scores and probabilities take.
template <typename LoadK, typename LoadV, typename Compute>
__device__ __forceinline__ void kv_walk_three(uint32_t ring, int tile_bytes, int nblocks, LoadK&& load_k,
                                              LoadV&& load_v, Compute&& compute) {
  auto tile = [&](int i) { return ring + (i % 3) * tile_bytes; };
  if (nblocks > 0) load_k(0, tile(0));
  cp_async_commit();
  for (int j = 0; j < nblocks; ++j) {
    cp_async_wait<0>();  // K_j, the newest group (and everything before it)
    __syncthreads();
    load_v(j, tile(2 * j + 1));
    cp_async_commit();
    if (j + 1 < nblocks) load_k(j + 1, tile(2 * j + 2));
    cp_async_commit();
    compute(j, tile(2 * j), tile(2 * j + 1), [] { cp_async_wait<1>(); });
  }
}

// kv_walk_refill with the refill first: compute(j, k_tile, v_tile) runs while the next copies fly.
template <int kStages, typename Load, typename Compute>
__device__ __forceinline__ void kv_walk(uint32_t ring, int tile_bytes, int nblocks, Load&& load,
                                        Compute&& compute) {
  kv_walk_refill<kStages>(ring, tile_bytes, nblocks, load, [&](int j, uint32_t kt, uint32_t vt, auto&& refill) {
    refill();
    compute(j, kt, vt);
  });
}

}  // namespace rl_engine::cuda::attn
