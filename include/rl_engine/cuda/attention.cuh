// Deterministic causal attention on Hopper (bf16/fp16 in, fp32 accumulate): the mma.sync prefill
// for 16- and 32-key blocks and the paged decode; the wgmma prefill is attention_wgmma.cuh, the
// backward attention_bwd.cuh. Framework-free: raw pointers, cudaError_t.
//
// Batch invariance rests on two facts. (1) Every output row is computed from its own query row
// with a fixed sequence of operations on its accumulators: the m16n8k16 products give each
// element from its row of A and column of B only, so the other rows sharing a tile (other
// queries, other heads, zero padding) never change a row's bits. (2) Keys are walked in blocks of
// BN anchored at position 0, and the per-block update is the same three steps (attention_block.cuh)
// in the prefill and decode kernels, with every rounding spelled out (__fmul_rn, ex2.approx) so
// that the compiler cannot contract it differently in the two kernels. A block that is fully
// masked for a row leaves that row's state unchanged bit for bit (alpha = 1, p = 0), so a warp
// that visits extra blocks for its other rows does not move this row's result.
#pragma once

#include "rl_engine/cuda/attention_params.h"
#include "rl_engine/cuda/attention_block.cuh"

namespace rl_engine::cuda::attn {

// Finds tile `idx` of `rows_per_tile`-row tiles cut per sequence from cu[0..batch]; returns false
// when idx is past the last tile.
__device__ __forceinline__ bool find_tile(const int32_t* cu, int batch, int rows_per_tile, int idx,
                                          int& seq, int& tile) {
  for (int b = 0; b < batch; ++b) {
    const int n = (cu[b + 1] - cu[b] + rows_per_tile - 1) / rows_per_tile;
    if (idx < n) {
      seq = b;
      tile = idx;
      return true;
    }
    idx -= n;
  }
  return false;
}

__device__ __forceinline__ int count_tiles(const int32_t* cu, int batch, int rows_per_tile) {
  int total = 0;
  for (int b = 0; b < batch; ++b) total += (cu[b + 1] - cu[b] + rows_per_tile - 1) / rows_per_tile;
  return total;
}


// Prefill on mma.sync, for blocks of 16 and 32 keys (64 and 128 run on wgmma, attention_wgmma.cuh):
// each of the four warps carries two 16-row tiles of the 128-row query tile (rows 16w.. and
// 64 + 16w..), so every K and V fragment read from shared memory feeds two products; Q stays in
// shared memory and is read per k-step. Two CTAs per SM.
constexpr int kFwdStages = 2, kFwdTiles = 2, kFwdWarps = kFwdRows / 16 / kFwdTiles;

template <int D, int BN>
constexpr int fwd_smem_bytes() {
  return kFwdRows * kStride<D> * 2 + kFwdStages * 2 * BN * kStride<D> * 2;
}

// One CTA per (128-row query tile of a sequence, q head); tiles run last-first so the longest
// causal walks start early. grid.x = tiles_upper_bound * hq.
template <typename T, int D, int BN>
__global__ void __launch_bounds__(kFwdWarps * 32, 2) rlk_attention_fwd_kernel(FwdParams p) {
  static_assert(BN <= 32, "larger blocks run on wgmma");
  extern __shared__ __align__(128) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int h = blockIdx.x % p.hq, rev = blockIdx.x / p.hq;
  const int total = count_tiles(p.cu_q, p.batch, kFwdRows);
  int b, tile;
  if (rev >= total || !find_tile(p.cu_q, p.batch, kFwdRows, total - 1 - rev, b, tile)) return;
  const int row0 = p.cu_q[b] + tile * kFwdRows, nrows = min(kFwdRows, p.cu_q[b + 1] - row0);
  const int kbase = p.cu_k[b], klen = p.cu_k[b + 1] - kbase, g = h / (p.hq / p.hkv);
  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  auto tile_row = [&](int mt, int r) { return (mt * kFwdWarps + warp) * 16 + (lane >> 2) + 8 * r; };

  int pos[kFwdTiles][2];
  int mine = -1;
#pragma unroll
  for (int mt = 0; mt < kFwdTiles; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = tile_row(mt, r);
      pos[mt][r] = row < nrows ? static_cast<int>(p.pos[row0 + row]) : 0;
      mine = max(mine, pos[mt][r]);
    }
  }
  __shared__ int warp_last[kFwdWarps];
  const int wl = min(__reduce_max_sync(0xffffffffu, mine), klen - 1);
  if (lane == 0) warp_last[warp] = wl;

  const uint32_t qs = smem_u32(smem), ring = qs + kFwdRows * kStride<D> * 2;
  load_tile<D>(qs, kFwdRows, [&](int r) { return r < nrows ? q + ((int64_t)(row0 + r) * p.hq + h) * D : nullptr; },
               q, tid, kFwdWarps * 32);
  cp_async_commit();  // lands before block 0 is computed (kv_walk waits for it)
  __syncthreads();
  int last = -1;
#pragma unroll
  for (int w = 0; w < kFwdWarps; ++w) last = max(last, warp_last[w]);

  RowState<D / 8> st[kFwdTiles];
#pragma unroll
  for (int mt = 0; mt < kFwdTiles; ++mt) st[mt].init();
  const int nblocks = last < 0 ? 0 : last / BN + 1;
  auto load = [&](int j, uint32_t kt, uint32_t vt) {
    auto row = [&](const T* base_ptr) {
      return [=](int r) {
        const int key = j * BN + r;
        return key < klen ? base_ptr + ((int64_t)(kbase + key) * p.hkv + g) * D : nullptr;
      };
    };
    load_tile<D>(kt, BN, row(k), k, tid, kFwdWarps * 32);
    load_tile<D>(vt, BN, row(v), v, tid, kFwdWarps * 32);
  };
  auto qfrag = [&](int mt, int kk, uint32_t (&a)[4]) {
    load_a<D>(a, qs, (mt * kFwdWarps + warp) * 16, kk * 16, lane);
  };
  kv_walk<kFwdStages>(ring, BN * kStride<D> * 2, nblocks, load, [&](int j, uint32_t kt, uint32_t vt) {
    if (j * BN <= wl)
      attention_block<T, D, BN, kFwdTiles>(st, qfrag, kt, vt, j * BN, pos, klen, p.scale_log2, lane);
  });

  T* out = static_cast<T*>(p.out);
#pragma unroll
  for (int mt = 0; mt < kFwdTiles; ++mt) {
    const bool valid[2] = {tile_row(mt, 0) < nrows, tile_row(mt, 1) < nrows};
    store_rows<T, D / 8>(
        st[mt], p.scale, valid,
        [&](int r) { return out + ((int64_t)(row0 + tile_row(mt, r)) * p.hq + h) * D; },
        [&](int r) { return p.lse + (int64_t)(row0 + tile_row(mt, r)) * p.hq + h; }, 0, true, lane);
  }
}

constexpr int kDecWarps = 4;
static_assert(kDecodeMaxGroup == 16 * kDecWarps, "one warp per 16 query heads");

template <int BN>
constexpr int decode_stages() {
  return BN <= 32 ? 4 : BN == 64 ? 3 : 2;
}
template <int D, int BN>
constexpr int decode_smem_bytes() {
  const int q = 16 * kDecWarps * kStride<D> * 2, kv = decode_stages<BN>() * 2 * BN * kStride<D> * 2;
  return q > kv ? q : kv;
}

// The sequence b and kv head g a decode CTA serves (blockIdx.x = b * hkv + g): its query heads are
// rows head0 .. head0 + group - 1 of q, out and lse, its keys the first len of its pages.
struct DecodeCta {
  int b, g, group, len;
  const int32_t* pages;
  __device__ __forceinline__ explicit DecodeCta(const DecodeParams& p)
      : b(blockIdx.x / p.hkv),
        g(blockIdx.x % p.hkv),
        group(p.hq / p.hkv),
        len(min(p.seq_lens[b], p.max_pages * p.page_size)),
        pages(p.block_table + (int64_t)b * p.max_pages) {}
  __device__ __forceinline__ int64_t head0(const DecodeParams& p) const {
    return (int64_t)b * p.hq + g * group;
  }
};

// Copies block j of one sequence's keys and values from the paged cache into a (K, V) tile pair.
// Blocks are copied in order 0, 1, 2, ...: the pages of block j + 1 are looked up (plain loads, one
// per copied row) when block j's copies are issued, so that their latency passes while earlier
// blocks are computed instead of stalling every copy behind a dependent lookup. A block is whole
// pages (the op checks that the block size is a multiple of page_size), so a copied row keeps its
// page within the block and its row within the page from block to block. Those come from the
// thread's first row, divided once here, and a fixed step per pass (rows_of): the divisions by a
// runtime page_size were a quarter of the instructions, and two arrays of them held for the whole
// walk pushed the plain kernel at head_dim 128 / block 128 into spills.
template <typename T, int D, int BN, int kThreads>
struct PagedLoad {
  static constexpr int kChunks = D / 8, kRowsPerPass = kThreads / kChunks;
  static_assert(kThreads % kChunks == 0 && BN % kRowsPerPass == 0, "copy layout");
  static constexpr int kPasses = BN / kRowsPerPass;
  const DecodeParams& p;
  const int32_t* pages;
  int g, len, c, r0, per_block;
  int page0, off0, page_step, off_step;  // the first row's page in the block and row in the page
  int next[kPasses];  // page of each row this thread copies in the next block (-1: none)

  __device__ __forceinline__ PagedLoad(const DecodeParams& params, const DecodeCta& cta, int tid)
      : p(params), pages(cta.pages), g(cta.g), len(cta.len), c(tid % kChunks), r0(tid / kChunks),
        per_block(BN / params.page_size) {
    page0 = r0 / p.page_size;
    off0 = r0 - page0 * p.page_size;
    page_step = kRowsPerPass / p.page_size;
    off_step = kRowsPerPass - page_step * p.page_size;
    lookup(0);
  }
  // f(m, page, off) for each pass m: row r0 + m kRowsPerPass is row off of page `page` of the block.
  template <typename F>
  __device__ __forceinline__ void rows_of(F&& f) const {
    int page = page0, off = off0;
    // Opaque to the compiler, so that it steps the rows here each block instead of holding every
    // pass's page and row in registers across the walk (which spilled the plain kernel at head_dim
    // 128 / block 128).
    asm volatile("" : "+r"(page), "+r"(off));
#pragma unroll
    for (int m = 0; m < kPasses; ++m) {
      f(m, page, off);
      page += page_step;
      off += off_step;
      if (off >= p.page_size) off -= p.page_size, ++page;
    }
  }
  __device__ __forceinline__ void lookup(int j) {
    rows_of([&](int m, int page, int) {
      const int key = j * BN + r0 + m * kRowsPerPass;
      next[m] = key < len ? pages[j * per_block + page] : -1;
    });
  }
  // Copies this thread's rows of the block whose pages are `pages` (one lookup's): keys into kt
  // where kKeys, values into vt where kValues.
  template <bool kKeys, bool kValues>
  __device__ __forceinline__ void copy(const int (&pages)[kPasses], uint32_t kt, uint32_t vt) const {
    const T* kc = static_cast<const T*>(p.k_cache);
    const T* vc = static_cast<const T*>(p.v_cache);
    rows_of([&](int m, int, int row) {
      const int page = pages[m];
      const bool ok = page >= 0 && page < p.num_pages;
      const int64_t off = ok ? (((int64_t)page * p.page_size + row) * p.hkv + g) * D + c * 8 : 0;
      const uint32_t dst = ((r0 + m * kRowsPerPass) * kStride<D> + c * 8) * 2;
      if (kKeys) cp_async16(kt + dst, kc + off, ok);
      if (kValues) cp_async16(vt + dst, vc + off, ok);
    });
  }
  __device__ __forceinline__ void operator()(int j, uint32_t kt, uint32_t vt) {
    copy<true, true>(next, kt, vt);
    lookup(j + 1);
  }
};

// The copies of kv_walk_three, which copies a block's keys one block before its values: keys(j)
// copies K_j from the pages looked up last and keeps them for values() to copy V_j from, then
// looks up block j + 1's. One lookup a block, as PagedLoad makes.
template <typename T, int D, int BN, int kThreads>
struct PagedLoadApart {
  using Load = PagedLoad<T, D, BN, kThreads>;
  Load load;
  int held[Load::kPasses];  // the pages of the block whose values come next
  __device__ __forceinline__ PagedLoadApart(const DecodeParams& params, const DecodeCta& cta, int tid)
      : load(params, cta, tid) {}
  __device__ __forceinline__ void keys(int j, uint32_t kt) {
    load.template copy<true, false>(load.next, kt, 0);
#pragma unroll
    for (int m = 0; m < Load::kPasses; ++m) held[m] = load.next[m];
    load.lookup(j + 1);
  }
  __device__ __forceinline__ void values(uint32_t vt) const { load.template copy<false, true>(held, 0, vt); }
};

// Decode: one CTA per (sequence, kv head); the rows of the tile are the kv head's query heads,
// all at position seq_lens[b] - 1. Same block walk and block update as the prefill.
template <typename T, int D, int BN>
__global__ void __launch_bounds__(kDecWarps * 32) rlk_attention_decode_kernel(DecodeParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const DecodeCta cta(p);
  const int group = cta.group, len = cta.len;
  const T* q = static_cast<const T*>(p.q);

  const uint32_t base = smem_u32(smem);
  const int rows = ((group + 15) / 16) * 16;
  load_tile<D>(base, rows, [&](int r) { return r < group ? q + (cta.head0(p) + r) * D : nullptr; },
               q, tid, kDecWarps * 32);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  const bool active = warp * 16 < group;
  QInRegisters<D> qf;
  if (active) qf.load(base, warp * 16, lane);
  __syncthreads();

  const int t = len - 1;
  const int pos[1][2] = {{t, t}};
  RowState<D / 8> st[1];
  st[0].init();
  const int nblocks = t < 0 ? 0 : t / BN + 1;
  kv_walk<decode_stages<BN>()>(
      base, BN * kStride<D> * 2, nblocks, PagedLoad<T, D, BN, kDecWarps * 32>(p, cta, tid),
      [&](int j, uint32_t kt, uint32_t vt) {
        if (active) attention_block<T, D, BN, 1>(st, qf, kt, vt, j * BN, pos, len, p.scale_log2, lane);
      });
  if (!active) return;
  bool valid[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) valid[r] = warp * 16 + (lane >> 2) + 8 * r < group;
  T* out = static_cast<T*>(p.out);
  store_rows<T, D / 8>(
      st[0], p.scale, valid,
      [&](int r) { return out + (cta.head0(p) + warp * 16 + (lane >> 2) + 8 * r) * D; },
      [&](int r) { return p.lse + cta.head0(p) + warp * 16 + (lane >> 2) + 8 * r; },
      0, true, lane);
}

// Decode of up to 16 query heads per kv head (one m16 row tile): D / 16 warps share each block,
// and each step of the block update is done once, by the warps that own its data:
//   1. scorer warps compute the scores of KS k16 key steps each (16 * KS keys), mask them and
//      publish their row maxima;
//   2. with the block's max (the same in every warp: max is exact) they turn their scores into
//      probabilities and publish them, as the bf16 A fragments of P . V and as fp32 values;
//   3. every warp rescales its NO output tiles and adds P . V over the block's keys in order;
//      warp 0 adds the fp32 probabilities to the denominator in the prefill's order.
// So every accumulator sees exactly the operations of the prefill's attention_block, and the rows
// stay equal to prefill rows; the decode is bound by instruction issue, which this keeps low.
template <int D>
constexpr int split_warps() {
  return D / 16;
}
template <int D, int BN>
constexpr int split_key_steps() {  // k16 key steps per scorer warp
  return (BN / 16 + split_warps<D>() - 1) / split_warps<D>();
}
// A block's probabilities are published in its own K tile: the scorers are done reading it at the
// barrier before they write, and the walk refills that slot only once the next block is past a
// barrier at which every warp is done with them.
// Keeping them out of the CTA's own bytes is what fits four head_dim 64 CTAs on an SM (512 CTAs in
// one wave at batch 64 x 8 kv heads, where three left a second wave of 116).
// Head_dim 64 at blocks of 128 keys walks a ring of three tiles (kv_walk_three) instead of two
// (K, V) stages: 55 KB instead of 74, so four CTAs fit on an SM as at blocks of 64, and batch 64 x 8
// kv heads decodes in one wave instead of two.
template <int D, int BN>
constexpr bool split_three_tiles() {
  return D == 64 && BN == 128;
}
template <int D, int BN>
struct SplitSmem {
  static constexpr int kTile = BN * kStride<D> * 2;
  static constexpr int kRing = (split_three_tiles<D, BN>() ? 3 : decode_stages<BN>() * 2) * kTile;
  static constexpr int kMax = kRing;             // float [warps][16]: row maxima
  static constexpr int kL = kMax + 16 * 16 * 4;  // float [16]: whole denominators
  static constexpr int kBytes = kL + 16 * 4;
  static constexpr int kPa = 0;                        // in the K tile: uint4 [BN / 16][32], P fragments
  static constexpr int kPf = (BN / 16) * 32 * 16;      // then float4 [BN / 8][32], P values
  static_assert(kPf + (BN / 8) * 32 * 16 <= kTile, "the probabilities fit in the K tile");
  static_assert(kRing >= 16 * kStride<D> * 2, "the query tile is staged in the ring");
};
// The occupancy the paragraph above is for: an SM's 228 KiB hold four head_dim 64 CTAs at BN 64
// (each with its 1 KiB the hardware reserves), so batch 64 x 8 kv heads decodes in one wave.
static_assert(4 * (SplitSmem<64, 64>::kBytes + 1024) <= 228 * 1024, "four head_dim 64 decode CTAs an SM");
static_assert(4 * (SplitSmem<64, 128>::kBytes + 1024) <= 228 * 1024, "four, at blocks of 128 keys too");

// Four CTAs an SM where the three-tile ring lets the shared memory hold them: 128 registers a
// thread (0 leaves the other instances to the compiler, as without the bound).
template <typename T, int D, int BN>
__global__ void __launch_bounds__(split_warps<D>() * 32, split_three_tiles<D, BN>() ? 4 : 0)
    rlk_attention_decode_split_kernel(DecodeParams p) {
  using S = SplitSmem<D, BN>;
  constexpr int kThreads = split_warps<D>() * 32, KS = split_key_steps<D, BN>();
  constexpr int kScorers = BN / 16 / KS, NO = D / 8 / split_warps<D>();
  extern __shared__ __align__(128) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const DecodeCta cta(p);
  const int group = cta.group, len = cta.len;
  const T* q = static_cast<const T*>(p.q);
  float* row_max = reinterpret_cast<float*>(smem + S::kMax);
  float* l_total = reinterpret_cast<float*>(smem + S::kL);

  const uint32_t base = smem_u32(smem);
  load_tile<D>(base, 16, [&](int r) { return r < group ? q + (cta.head0(p) + r) * D : nullptr; },
               q, tid, kThreads);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  QInRegisters<D> qf;
  qf.load(base, 0, lane);
  __syncthreads();

  const int t = len - 1;
  const int pos[2] = {t, t};
  RowState<NO> st;
  st.init();
  const int nblocks = t < 0 ? 0 : t / BN + 1;
  // One warp keeps the denominators: it adds a block's probabilities, in key order, to l after
  // l took that block's alpha and before it takes the next one's. Where some warps do not score
  // (head_dim 128), the last of them does it while the scorers compute the next block's scores,
  // off the path every warp waits on; the walk then refills block j - 1's slot only after the
  // first barrier of block j. Otherwise warp 0 does it after the probabilities are published.
  constexpr bool kIdleAdds = kScorers < split_warps<D>();
  constexpr int kLWarp = kIdleAdds ? split_warps<D>() - 1 : 0;
  auto add_block_to_l = [&](uint32_t kt) {
    const float4* pf = reinterpret_cast<const float4*>(smem + (kt - base) + S::kPf);
#pragma unroll
    for (int n = 0; n < BN / 8; ++n) {
      const float4 v = pf[n * 32 + lane];
      const float pn[1][4] = {{v.x, v.y, v.z, v.w}};
      add_to_denominator<1>(st.l, pn);
    }
  };
  uint32_t prev_kt = 0;  // the K tile of the block before, which holds its probabilities
  // One block: refill() issues the copies a two-stage walk makes during it, wait_v() waits for
  // V's where the three-tile walk copies it apart from K.
  auto block = [&](int j, uint32_t kt, uint32_t vt, auto&& refill, auto&& wait_v) {
    // The walk's barrier at the top of block j + 1 orders this block's reads of the shared
    // maxima and probabilities before block j + 1 overwrites the maxima; this K tile is
    // refilled after that barrier, or after block j + 1's first one where kIdleAdds.
    if constexpr (!kIdleAdds) refill();
    unsigned char* k_tile = smem + (kt - base);
    uint4* pa = reinterpret_cast<uint4*>(k_tile + S::kPa);
    float4* pf = reinterpret_cast<float4*>(k_tile + S::kPf);
    float s[2 * KS][4];
    if (warp < kScorers) {
      float part[1][2 * KS][4];
      block_scores<T, D, 2 * KS, 1>(part, qf, kt, warp * 2 * KS, lane);
#pragma unroll
      for (int n = 0; n < 2 * KS; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) s[n][i] = part[0][n][i];
      float mx[2] = {-kInf, -kInf};
      mask_scores<2 * KS>(s, j * BN + warp * 16 * KS, pos, len, lane, mx);
      quad_max(mx);
      if ((lane & 3) == 0) {
        row_max[warp * 16 + (lane >> 2)] = mx[0];
        row_max[warp * 16 + (lane >> 2) + 8] = mx[1];
      }
    } else if (kIdleAdds && warp == kLWarp && j > 0) {
      add_block_to_l(prev_kt);
    }
    __syncthreads();
    if constexpr (kIdleAdds) refill();
    float mx[2] = {-kInf, -kInf}, ms[2];
#pragma unroll
    for (int w = 0; w < kScorers; ++w) {
      mx[0] = fmaxf(mx[0], row_max[w * 16 + (lane >> 2)]);
      mx[1] = fmaxf(mx[1], row_max[w * 16 + (lane >> 2) + 8]);
    }
    rescale_rows(st, mx, p.scale_log2, ms);
    if (warp < kScorers) {
      exponentiate<2 * KS>(s, ms, p.scale_log2);
#pragma unroll
      for (int kk = 0; kk < KS; ++kk) {
        uint32_t a[4];
        c_to_a<T>(a, s, kk);
        pa[(warp * KS + kk) * 32 + lane] = make_uint4(a[0], a[1], a[2], a[3]);
      }
#pragma unroll
      for (int n = 0; n < 2 * KS; ++n)
        pf[(warp * 2 * KS + n) * 32 + lane] = make_float4(s[n][0], s[n][1], s[n][2], s[n][3]);
    }
    wait_v();
    __syncthreads();
    if (!kIdleAdds && warp == kLWarp) add_block_to_l(kt);
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      const uint4 f = pa[kk * 32 + lane];
      const uint32_t a[4] = {f.x, f.y, f.z, f.w};
#pragma unroll
      for (int d = 0; d < NO; d += 2) {
        uint32_t b[4];
        load_b_t<D>(b, vt, kk * 16, warp * NO * 8 + d * 8, lane);
        mma<T>(st.o[d], a, b[0], b[1]);
        mma<T>(st.o[d + 1], a, b[2], b[3]);
      }
    }
    prev_kt = kt;
  };
  if constexpr (split_three_tiles<D, BN>()) {
    static_assert(!kIdleAdds, "the three-tile walk has no refill to put off");
    PagedLoadApart<T, D, BN, kThreads> load(p, cta, tid);
    kv_walk_three(
        base, S::kTile, nblocks, [&](int j, uint32_t kt) { load.keys(j, kt); },
        [&](int, uint32_t vt) { load.values(vt); },
        [&](int j, uint32_t kt, uint32_t vt, auto&& wait_v) { block(j, kt, vt, [] {}, wait_v); });
  } else {
    kv_walk_refill<decode_stages<BN>()>(base, S::kTile, nblocks, PagedLoad<T, D, BN, kThreads>(p, cta, tid),
                                        [&](int j, uint32_t kt, uint32_t vt, auto&& refill) {
                                          block(j, kt, vt, refill, [] {});
                                        });
  }
  // The last block's probabilities: published before its second barrier, and never refilled.
  if (kIdleAdds && warp == kLWarp && nblocks > 0) add_block_to_l(prev_kt);
  if (warp == kLWarp) {
    const float l0 = row_total(st.l[0]), l1 = row_total(st.l[1]);
    if ((lane & 3) == 0) {
      l_total[lane >> 2] = l0;
      l_total[(lane >> 2) + 8] = l1;
    }
  }
  __syncthreads();
  const float l[2] = {l_total[lane >> 2], l_total[(lane >> 2) + 8]};
  bool valid[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) valid[r] = (lane >> 2) + 8 * r < group;
  T* out = static_cast<T*>(p.out);
  store_rows_with<T, NO>(
      st, l, p.scale, valid, [&](int r) { return out + (cta.head0(p) + (lane >> 2) + 8 * r) * D; },
      [&](int r) { return p.lse + cta.head0(p) + (lane >> 2) + 8 * r; }, warp * NO * 8, warp == 0, lane);
}

template <typename Kernel>
inline cudaError_t set_smem(Kernel kernel, int bytes) {
  return bytes > 48 * 1024
             ? cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes)
             : cudaSuccess;
}

// grid_tiles: an upper bound of the 128-row tiles (ceil(Tq / 128) + batch).
template <typename T, int D, int BN>
cudaError_t launch_attention_fwd(const FwdParams& p, int grid_tiles, cudaStream_t stream) {
  static_assert(D % 16 == 0 && BN % 16 == 0, "tile shapes");
  auto kernel = rlk_attention_fwd_kernel<T, D, BN>;
  constexpr int smem = fwd_smem_bytes<D, BN>();
  if (cudaError_t e = set_smem(kernel, smem); e != cudaSuccess) return e;
  kernel<<<grid_tiles * p.hq, kFwdWarps * 32, smem, stream>>>(p);
  return cudaGetLastError();
}

// The kernel is chosen by the model's heads alone (query heads per kv head), never by the batch.
template <typename T, int D, int BN>
cudaError_t launch_attention_decode(const DecodeParams& p, int batch, cudaStream_t stream) {
  if (p.hq / p.hkv <= 16) {
    auto kernel = rlk_attention_decode_split_kernel<T, D, BN>;
    constexpr int smem = SplitSmem<D, BN>::kBytes;
    if (cudaError_t e = set_smem(kernel, smem); e != cudaSuccess) return e;
    kernel<<<batch * p.hkv, split_warps<D>() * 32, smem, stream>>>(p);
    return cudaGetLastError();
  }
  auto kernel = rlk_attention_decode_kernel<T, D, BN>;
  constexpr int smem = decode_smem_bytes<D, BN>();
  if (cudaError_t e = set_smem(kernel, smem); e != cudaSuccess) return e;
  kernel<<<batch * p.hkv, kDecWarps * 32, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace rl_engine::cuda::attn

