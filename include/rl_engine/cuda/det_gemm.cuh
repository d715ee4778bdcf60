// Batch-invariant GEMM C[m, n] = sum_k A[m, k] B[n, k] for Hopper (sm_90a), operands K-major, or
// MN-major (stored transposed) where the backward products pass them so (gemm_reads_mn_major).
//
// The reduction order depends only on N and K (choose_gemm_split): K is cut into `splits` ranges of
// whole 256-wide units; each range is walked in 64-wide blocks from its start, each block four wgmma
// k16 steps into an fp32 accumulator that starts at zero (zero-filled past K), and the ranges' sums
// are added in range order, ((p0 + p1) + p2) ..., before the epilogue (measured at e25236c: 4B's
// down projection at M = 1-32 from 0.64-0.67 of cuBLAS unsplit to 0.93-0.99 in 3 ranges, 8B's KV
// projection from 0.75-0.82 to 1.00-1.04 in 6, for 0.80-0.85 at M >= 4096 where it was 0.91-0.94).
// No stream-K, no atomic. What changes with M is only the output tile (choose_gemm_tile), whether
// the tile is swapped (B's rows as its rows), how many K blocks one shared-memory stage holds, and
// where the range sums meet: in the CTA that computed them all (one range after the other, the
// running sum in a second set of registers), or, where the tiles are too few to fill the SMs, in
// separate CTAs that write them to a workspace that one more kernel adds up (plan_det_gemm). So a
// row's bits depend only on that row and B, not on M, on the row's position, on the tile or on the
// grid. A swapped tile gives an element the same k16 steps with the operands' roles exchanged, and
// the products are exact in fp32, so it gives the same bits (the row tests hold it to that).
//
// The grid is persistent (work items, tiles or (tile, range) pairs, strided over CTAs); warpgroup 0
// is the producer (one thread issues
// bulk tensor copies into a ring of shared-memory stages guarded by mbarriers), each consumer
// warpgroup owns 64 rows of the tile. At decode sizes the GEMM streams B: swapped tiles give every
// SM its own slab of B's rows, M is the narrow side of the instruction, and a launch with fewer
// tiles than SMs can hold gives each CTA the deeper ring.
//
// Launches use programmatic stream serialization: a CTA sets up its barriers and fetches its tensor
// maps while the kernel before it in the stream drains, then waits for that kernel before any
// global access. Measured on an H200 at M <= 32, where a launch lasts 7-50 us: 4.5% faster at the
// median over benchmarks/hopper_ops.py's shapes, up to 15%.
//
// The epilogue is a functor called by each consumer warpgroup with its 64 x BN fp32 fragment, so
// the same main loop serves det_gemm's store and the fused log-sum-exp tiles of linear_logp.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <type_traits>

#include "rl_engine/cuda/gemm_wgmma.cuh"
#include "rl_engine/cuda/ptx.cuh"
#include "rl_engine/cuda/types.cuh"

namespace rl_engine::cuda {

namespace gemm_cfg {
constexpr int kBK = 64;  // one K block: 64 16-bit values, one 128-byte swizzled row per tile row
constexpr int kRowBytes = kBK * 2;
constexpr int kMaxStages = 32;
constexpr int kMaxSplits = 8;  // K ranges at most (choose_gemm_split)
// 64 rows of a K block, K-major (64 rows of 128 bytes), or one 64-wide panel of an MN-major
// operand (64 K rows of 64 values): the two layouts take the same bytes.
constexpr int kPanelBytes = 64 * kRowBytes;
constexpr int kSmPerSmem = 233472;  // shared memory of one SM, 1 KB of it reserved per resident CTA
// wgmma reads 64 rows of A per consumer; where A's box is shorter (M < 64), the rows past it come
// from whatever follows in shared memory and only reach output rows that are never stored.
constexpr int kSlackBytes = 64 * kRowBytes;
constexpr int kOverhead = kSlackBytes + 2 * kMaxStages * 8 + 1024;  // + barriers, alignment
// Resident CTAs per SM of a one-warpgroup tile (registers allow 4 below 64 columns): at small M a
// row's K chain is a sequence of dependent wgmma, so an SM runs several tiles' chains at once. A
// 32-column tile that keeps a running sum beside its accumulator (two) takes 3: at 4 its 64
// registers a thread spilled 104-112 bytes (ptxas -v).
__host__ __device__ constexpr int gemm_max_occupancy(int consumers, int bn, bool two = false) {
  return consumers == 2 ? 1 : bn >= 64 ? 2 : two ? 3 : 4;
}
constexpr int kGroupM = 16;  // tile order: 16 row blocks per band, for L2 reuse of B
}  // namespace gemm_cfg

// The tile whose launches may pair their CTAs (see gemm_may_pair): 128 x 128 running all of its K
// ranges.
__host__ __device__ constexpr bool gemm_pair_tile(int bm, int bn, bool two) { return two && bm == 128 && bn == 128; }

// Shared-memory ring of one launch: each stage holds gemm_subs(bn) K blocks of A (a_rows rows each)
// then as many of B (bn rows each), every block 1024-byte aligned as the 128-byte swizzle needs.
struct GemmRing {
  int a_rows, stages, occupancy;  // occupancy: resident CTAs per SM the ring is sized for
  uint32_t a_bytes, b_bytes, stage_bytes;  // one K block of A, of B; one stage
};

// K blocks per ring stage for a tile width: narrow tiles take several, so each barrier round trip
// moves at least 8 KB of B. The last stage of a tile may reach past K: its blocks are zero-filled,
// and a k16 step of zero products leaves the accumulator's bits as they were (it starts at +0 and
// a round-to-nearest sum is never -0 unless both terms are), so the stage size never shows in a row.
__host__ __device__ constexpr int gemm_subs(int bn) {
  return 8192 / (bn * gemm_cfg::kRowBytes) < 1 ? 1 : 8192 / (bn * gemm_cfg::kRowBytes) > 4 ? 4 : 8192 / (bn * gemm_cfg::kRowBytes);
}

// Position of one output tile in the persistent order (bands of kGroupM row blocks, column-major
// inside a band). Only the schedule depends on it, never the arithmetic.
__device__ __forceinline__ void gemm_tile_coords(int tile, int m_blocks, int n_blocks, int& mb, int& nb) {
  const int per_band = gemm_cfg::kGroupM * n_blocks;
  const int band = tile / per_band;
  const int first = band * gemm_cfg::kGroupM;
  const int rows = min(m_blocks - first, gemm_cfg::kGroupM);
  const int local = tile - band * per_band;
  mb = first + local % rows;
  nb = local / rows;
}

// How K is reduced: `splits` ranges of `blocks` K blocks each (the last one shorter), see
// choose_gemm_split. across: each CTA computes one range of a tile and the epilogue (given the range
// through its for_split) writes that range's sum to the workspace `scratch`; otherwise a CTA
// computes every range of its tile in order, its running sum in a second accumulator (kTwo).
struct GemmSplit {
  int splits, blocks;
  bool across;
  float* scratch;  // the workspace, which the kernel reaches only through the epilogue's for_split
  int items;  // set by the launch: tiles, or tiles x splits when across (read from the parameter
              // space, it costs the producer's few registers nothing)
};

// The epilogue of range s of a split reduced across CTAs (the workspace slice of that range).
template <typename Epi, typename = void>
struct HasForSplit : std::false_type {};
template <typename Epi>
struct HasForSplit<Epi, std::void_t<decltype(std::declval<const Epi&>().for_split(0))>> : std::true_type {};
template <typename Epi>
__device__ __forceinline__ Epi epilogue_for_split(const Epi& epi, int s) {
  if constexpr (HasForSplit<Epi>::value) {
    return epi.for_split(s);
  } else {
    return epi;
  }
}

// Fragment layout of one consumer (m64nBN fp32): thread t of the warpgroup holds, for each 8-column
// block j, acc[4j + 2h + e] = C[row0 + 16 (t / 32) + (t % 32) / 4 + 8h, col0 + 8j + 2 (t % 4) + e].
// A tile of kBM < 64 rows (16 or 32) still runs m64 wgmma: its rows past kBM read whatever follows
// in shared memory and only reach fragment rows that belong to no output (the epilogue is told the
// tile's last row).
template <int kBM, int kBN, int kSubs, bool kHalf, bool kTA, bool kTB, bool kTwo, typename Epi>
__global__ void __launch_bounds__(128 * (1 + (kBM > 64 ? 2 : 1)),
                                  gemm_cfg::gemm_max_occupancy(kBM > 64 ? 2 : 1, kBN, kTwo))
    rlk_det_gemm_sm90_kernel(const __grid_constant__ CUtensorMap map_a,
                             const __grid_constant__ CUtensorMap map_b, int m, int n, int k,
                             const GemmRing ring, const Epi epi, bool stream_dependents,
                             const GemmSplit split, bool pair) {
  using namespace gemm_cfg;
  constexpr int kConsumers = kBM > 64 ? 2 : 1;
  // Only the tiles gemm_pair_tile names carry the paired code; the others compile as unpaired but
  // for the check that skips the empty half of a pair past N.
  const bool paired = gemm_pair_tile(kBM, kBN, kTwo) && pair;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const uint32_t base = (ptx::smem_u32(smem_raw) + 1023u) & ~1023u;
  const uint32_t bars = base + ring.stages * ring.stage_bytes + kSlackBytes;
  auto full = [&](uint32_t s) { return bars + 8u * s; };
  auto empty = [&](uint32_t s) { return bars + 8u * (kMaxStages + s); };

  if (threadIdx.x == 0) {
    ptx::prefetch_tensormap(&map_a);
    ptx::prefetch_tensormap(&map_b);
    for (int s = 0; s < ring.stages; ++s) {
      ptx::mbar_init(full(s), 1);
      ptx::mbar_init(empty(s), paired ? 2 * kConsumers : kConsumers);  // paired: both CTAs' consumers
    }
    ptx::fence_barrier_init();
  }
  __syncthreads();
  // A peer's copies and arrivals may reach these barriers only once they are initialized.
  if (paired) ptx::cluster_sync();
  // Everything above overlaps the previous kernel's tail; the operands may be its outputs.
  ptx::grid_dependency_wait();

  const int m_blocks = (m + kBM - 1) / kBM, n_blocks = (n + kBN - 1) / kBN;
  const int k_iters = (k + kBK - 1) / kBK;
  // Paired (a cluster of two CTAs, see gemm_may_pair): a work item is two tiles side by side
  // in one row block, one for each CTA of the pair, and each CTA loads half of their common A
  // block into both; the second tile of a pair past N computes zeros and stores nothing.
  const uint32_t rank = paired ? ptx::cluster_ctarank() : 0u;
  const int n_units = paired ? (n_blocks + 1) / 2 : n_blocks;
  const int first_item = paired ? static_cast<int>(blockIdx.x / 2) : static_cast<int>(blockIdx.x);
  const int item_stride = paired ? static_cast<int>(gridDim.x / 2) : static_cast<int>(gridDim.x);
  auto coords = [&](int tile, int& mb, int& nb) {
    gemm_tile_coords(tile, m_blocks, n_units, mb, nb);
    if (paired) nb = 2 * nb + static_cast<int>(rank);
  };
  // A work item is a tile (or pair), or a (tile, range) pair where the ranges go to separate CTAs.
  auto ranges = [&](int item, int& tile, int& first, int& end) {
    tile = split.across ? item / split.splits : item;
    first = split.across ? item % split.splits : 0;
    end = split.across ? first + 1 : split.splits;
  };
  const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;
  const uint32_t b_off = kSubs * ring.a_bytes;

  if (wg == 0) {
    if constexpr (kConsumers == 2) ptx::setmaxnreg_dec<24>();
    if (tid != 0) return;
    int s = 0;
    uint32_t phase = 0;
    const int half_rows = ring.a_rows / 2;
    for (int item = first_item; item < split.items; item += item_stride) {
      const int tile = split.across ? item / split.splits : item;
      int mb, nb;
      coords(tile, mb, nb);
      // One range, or all of K (ranges hold whole multiples of 4 K blocks, so a stage never
      // straddles two of them). Beside two consumers this thread has 24 registers: little state.
      for (int kb = split.across ? (item - tile * split.splits) * split.blocks : 0; kb < k_iters;) {
        ptx::mbar_wait(empty(s), phase ^ 1u);  // first pass: the slot starts free
        ptx::mbar_arrive_expect_tx(full(s), ring.stage_bytes);
        const uint32_t st = base + s * ring.stage_bytes;
        for (int j = 0; j < kSubs; ++j) {
          const int k0 = (kb + j) * kBK;
          const uint32_t a = st + j * ring.a_bytes, b = st + b_off + j * ring.b_bytes;
          if constexpr (kTA) {  // MN-major: one 64 x 64 box a 64-row panel, K as the box's rows
            for (int p = 0; p < kBM / 64; ++p) ptx::tma_load_2d(a + p * kPanelBytes, &map_a, full(s), mb * kBM + 64 * p, k0);
          } else if (paired) {  // this CTA's half of the pair's A rows, into both CTAs
            ptx::tma_load_2d_multicast(a + rank * half_rows * kRowBytes, &map_a, full(s), k0,
                                       mb * kBM + static_cast<int>(rank) * half_rows, 0x3);
          } else {
            ptx::tma_load_2d(a, &map_a, full(s), k0, mb * kBM);
          }
          if constexpr (kTB) {
            for (int p = 0; p < kBN / 64; ++p) ptx::tma_load_2d(b + p * kPanelBytes, &map_b, full(s), nb * kBN + 64 * p, k0);
          } else {
            ptx::tma_load_2d(b, &map_b, full(s), k0, nb * kBN);
          }
        }
        if (++s == ring.stages) s = 0, phase ^= 1u;
        kb += kSubs;
        if (split.across && kb % split.blocks == 0) break;  // the end of this item's range
      }
    }
    // A weight stream's CTAs all end at about the same time: once its last copy is issued, the
    // next kernel may place its CTAs and run its prologue. Other launches leave that to their exit
    // (measured: dependents placed early on the SMs a part wave leaves idle slowed the next GEMM at
    // M = 128-256 by up to 15%).
    if (stream_dependents) ptx::launch_dependents();
    // Paired: the peer's consumers arrive on this CTA's empty barriers, and its producer copies into
    // this CTA's stages, until the last round; the CTA stays until every slot's last round is
    // released by all four consumers (one wait a slot covers it: no copy into a slot is issued
    // before that slot's previous round is released).
    if (paired) {
      for (int i = 0; i < ring.stages; ++i) {
        ptx::mbar_wait(empty(s), phase ^ 1u);
        if (++s == ring.stages) s = 0, phase ^= 1u;
      }
    }
    return;
  }

  if constexpr (kConsumers == 2) ptx::setmaxnreg_inc<240>();  // one warpgroup fits as compiled
  const int c = wg - 1;
  float acc[kBN / 2];
  // kTwo: a CTA that runs all of a tile's K ranges keeps their running sum here.
  float sum[kTwo ? kBN / 2 : 1];
  int s = 0;
  uint32_t phase = 0;
  // A consumed stage is free once both consumers (of both CTAs, paired) have released it.
  auto release = [&](int stage) {
    if (tid != 0) return;
    ptx::mbar_arrive(empty(stage));
    if (paired) ptx::mbar_arrive_cluster(empty(stage), rank ^ 1u);
  };
  for (int item = first_item; item < split.items; item += item_stride) {
    int tile, first, end, mb, nb;
    ranges(item, tile, first, end);
    coords(tile, mb, nb);
#pragma unroll
    for (int i = 0; i < kBN / 2; ++i) acc[i] = 0.f;
    int held = -1;  // the stage whose products may still be in flight
    const int kb_end = min(k_iters, end * split.blocks);
    int join = (first + 1) * split.blocks;  // where the next range starts (kTwo)
    for (int kb = first * split.blocks; kb < kb_end;) {
      ptx::mbar_wait(full(s), phase);
      const uint32_t st = base + s * ring.stage_bytes;
      ptx::wgmma_fence();
#pragma unroll
      for (int j = 0; j < kSubs; ++j) {
        const uint32_t a = st + j * ring.a_bytes + c * kPanelBytes;
        const uint32_t b = st + b_off + j * ring.b_bytes;
#pragma unroll
        for (int kk = 0; kk < kBK / 16; ++kk) {
          // A k16 step is 32 bytes along a K-major row, 16 rows (2 KB) down an MN-major panel.
          const uint64_t da = kTA ? ptx::smem_desc_sw128_mn(a + 16 * kRowBytes * kk, kPanelBytes)
                                  : ptx::smem_desc_sw128(a + 32 * kk);
          const uint64_t db = kTB ? ptx::smem_desc_sw128_mn(b + 16 * kRowBytes * kk, kPanelBytes)
                                  : ptx::smem_desc_sw128(b + 32 * kk);
          ptx::wgmma_gemm<kBN, kHalf, kTA, kTB>(acc, da, db);
        }
      }
      ptx::wgmma_commit();
      ptx::wgmma_wait<1>();  // the previous stage's products are done: free its slot
      if (held >= 0) release(held);
      held = s;
      if (++s == ring.stages) s = 0, phase ^= 1u;
      kb += kSubs;
      if constexpr (kTwo) {
        // A range ends before the tile does: its sum joins the running sum (the first one is it),
        // and the accumulator starts again from zero. The last range joins after the loop.
        if (kb == join && kb < kb_end) {
          ptx::wgmma_wait<0>();
          release(held);
          held = -1;
#pragma unroll
          for (int i = 0; i < kBN / 2; ++i) {
            ptx::reg_fence(acc[i]);
            sum[i] = join == split.blocks ? acc[i] : __fadd_rn(sum[i], acc[i]);
            acc[i] = 0.f;
          }
          join += split.blocks;
        }
      }
    }
    ptx::wgmma_wait<0>();
    if (held >= 0) release(held);
#pragma unroll
    for (int i = 0; i < kBN / 2; ++i) ptx::reg_fence(acc[i]);
    if constexpr (kTwo) {
      if (kb_end > split.blocks) {
#pragma unroll
        for (int i = 0; i < kBN / 2; ++i) acc[i] = __fadd_rn(sum[i], acc[i]);
      }
    }
    const int row_end = (mb + 1) * kBM < m ? (mb + 1) * kBM : m;
    if (nb >= n_blocks) continue;  // the empty half of a pair
    if (split.across) {
      epilogue_for_split(epi, first)(acc, mb * kBM + c * 64, nb * kBN, row_end, n);
    } else {
      epi(acc, mb * kBM + c * 64, nb * kBN, row_end, n);
    }
  }
}

// Plain fp32 path (fp32 or mixed-dtype operands): 64 x 64 tiles, each output one fmaf chain over
// k = 0, 1, ..., K-1 (zero terms past K), so it is batch invariant too.
template <typename Epi>
__global__ void __launch_bounds__(256)
    rlk_det_gemm_f32_kernel(const float* a, int64_t lda, const float* b, int64_t ldb, int m, int n, int k,
                        const Epi epi) {
  __shared__ float as[16][64 + 4];
  __shared__ float bs[16][64 + 4];
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int row0 = blockIdx.y * 64, col0 = blockIdx.x * 64;
  const int lr = threadIdx.x / 4, lk = (threadIdx.x % 4) * 4;
  float acc[4][4] = {};
  for (int k0 = 0; k0 < k; k0 += 16) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int gk = k0 + lk + e;
      as[lk + e][lr] = (row0 + lr < m && gk < k) ? a[(row0 + lr) * lda + gk] : 0.f;
      bs[lk + e][lr] = (col0 + lr < n && gk < k) ? b[(col0 + lr) * ldb + gk] : 0.f;
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < 16; ++kk) {
      float av[4], bv[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        av[i] = as[kk][ty * 4 + i];
        bv[i] = bs[kk][tx * 4 + i];
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int row = row0 + ty * 4 + i;
    epi.store_pair(row, col0 + tx * 4, acc[i][0], acc[i][1], m, n);
    epi.store_pair(row, col0 + tx * 4 + 2, acc[i][2], acc[i][3], m, n);
  }
}

// out[r, c] = acc (+ bias[c]) or out[r, c] + acc (accumulate, fp32 outputs), rounded once to Out.
template <typename Out>
struct StoreEpilogue {
  static constexpr bool kAnyWidth = true;  // takes a fragment of any tile width
  Out* out;
  int64_t ldo;
  const float* bias;  // fp32 [n] or null
  bool accumulate;
  bool pairs;  // ldo even and out aligned: adjacent columns go out in one store
  bool rows16;  // 16-bit Out, ldo a multiple of 8 and out 16-byte aligned: 8 columns in one store
  int64_t split_stride = 0;  // a workspace of range sums: elements from one range's slice to the next

  __host__ __device__ StoreEpilogue for_split(int s) const {
    StoreEpilogue e = *this;
    e.out += s * split_stride;
    return e;
  }

  __device__ __forceinline__ void store_pair(int row, int col, float v0, float v1, int m, int n) const {
    if (row >= m || col >= n) return;
    Out* p = out + static_cast<int64_t>(row) * ldo + col;
    const bool two = col + 1 < n;
    if (bias != nullptr) {
      v0 = v0 + bias[col];
      if (two) v1 = v1 + bias[col + 1];
    }
    if (accumulate) {
      v0 = to_float(p[0]) + v0;
      if (two) v1 = to_float(p[1]) + v1;
    }
    write_pair(row, col, v0, v1, n);
  }

  // The final values of (row, col) and (row, col + 1), the second only where it exists.
  __device__ __forceinline__ void write_pair(int row, int col, float v0, float v1, int n) const {
    Out* p = out + static_cast<int64_t>(row) * ldo + col;
    const bool two = col + 1 < n;
    if (two && pairs) {
      rl_engine::cuda::store_pair(p, v0, v1);
    } else {
      p[0] = from_float<Out>(v0);
      if (two) p[1] = from_float<Out>(v1);
    }
  }

  __device__ __forceinline__ void store_one(int row, int col, float v, int m, int n) const {
    if (row >= m || col >= n) return;
    Out* p = out + static_cast<int64_t>(row) * ldo + col;
    if (bias != nullptr) v = v + bias[col];
    if (accumulate) v = to_float(p[0]) + v;
    p[0] = from_float<Out>(v);
  }

  // A fragment whose columns all exist, written 16 bytes a thread: the four lanes of a quad hold one
  // row's pairs of four 8-column blocks and swap them (a 4 x 4 transpose in two butterfly rounds of
  // shuffles: the 2 x 2 blocks of pairs with lane ^ 1, then the blocks of them with lane ^ 2) so that
  // each lane holds one block's 8 columns, and a row's 64 bytes go out in whole 16-byte pieces (two
  // whole sectors where rows start on 32 bytes), where pair stores would write 16 bytes of a sector
  // at a time. A round costs two shuffles and six selects on a lane bit (each lane sends the pairs
  // its partner keeps and takes theirs in their place); one shuffle per block with the selects on a
  // computed index took 74 instructions a store (benchmarks/results/h100/epilogue_probe/). The
  // values and their one rounding are the same.
  template <int kA>
  __device__ __forceinline__ void store_blocks(const float (&acc)[kA], int r, int col0, int m) const {
    const int c = threadIdx.x % 4;
    const bool odd = c & 1, high = c & 2;
#pragma unroll
    for (int q = 0; q < kA / 16; ++q) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        uint32_t p[4];  // p[i]: this lane's pair of block 4q + i
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int j = 4 * q + i, col = col0 + 8 * j + 2 * c;
          float v0 = acc[4 * j + 2 * h], v1 = acc[4 * j + 2 * h + 1];
          if (bias != nullptr) v0 = v0 + bias[col], v1 = v1 + bias[col + 1];
          rl_engine::cuda::store_pair(reinterpret_cast<Out*>(&p[i]), v0, v1);
        }
        // Lane c keeps the blocks whose bit agrees with its own and trades the others: after both
        // rounds p[i] is lane i's pair of block 4q + c.
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const uint32_t got = __shfl_xor_sync(0xffffffffu, odd ? p[2 * e] : p[2 * e + 1], 1);
          p[2 * e] = odd ? got : p[2 * e];
          p[2 * e + 1] = odd ? p[2 * e + 1] : got;
        }
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const uint32_t got = __shfl_xor_sync(0xffffffffu, high ? p[e] : p[e + 2], 2);
          p[e] = high ? got : p[e];
          p[e + 2] = high ? p[e + 2] : got;
        }
        const int row = r + 8 * h;
        if (row < m) {
          *reinterpret_cast<uint4*>(out + static_cast<int64_t>(row) * ldo + col0 + 8 * (4 * q + c)) =
              make_uint4(p[0], p[1], p[2], p[3]);
        }
      }
    }
  }

  // out + acc, as store_pair adds them, with the old values of eight column blocks loaded before
  // any of them is written: loads and stores to the same array stay in program order, so one pair at
  // a time would wait out a memory round trip per pair (linear_logp's backward adds each vocab
  // chunk's grad_hidden this way: 128 round trips a tile).
  template <int kA>
  __device__ __forceinline__ void add_blocks(const float (&acc)[kA], int r, int cq, int m, int n) const {
    constexpr int kJ = kA / 4, kGroup = 8;
#pragma unroll
    for (int j0 = 0; j0 < kJ; j0 += kGroup) {
      float old[4 * kGroup];
#pragma unroll
      for (int u = 0; u < kGroup && j0 + u < kJ; ++u) {
        const int col = cq + 8 * (j0 + u);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = r + 8 * h;
          const Out* p = out + static_cast<int64_t>(row) * ldo + col;
          const bool in = row < m && col < n;
          old[4 * u + 2 * h] = in ? to_float(p[0]) : 0.f;
          old[4 * u + 2 * h + 1] = in && col + 1 < n ? to_float(p[1]) : 0.f;
        }
      }
#pragma unroll
      for (int u = 0; u < kGroup && j0 + u < kJ; ++u) {
        const int j = j0 + u, col = cq + 8 * j;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = r + 8 * h;
          if (row >= m || col >= n) continue;
          float v0 = acc[4 * j + 2 * h], v1 = acc[4 * j + 2 * h + 1];
          if (bias != nullptr) {
            v0 = v0 + bias[col];
            if (col + 1 < n) v1 = v1 + bias[col + 1];
          }
          write_pair(row, col, old[4 * u + 2 * h] + v0, old[4 * u + 2 * h + 1] + v1, n);
        }
      }
    }
  }

  template <int kA>
  __device__ __forceinline__ void operator()(const float (&acc)[kA], int row0, int col0, int m,
                                             int n) const {
    const int t = threadIdx.x % 128;
    const int r = row0 + (t / 32) * 16 + (t % 32) / 4, cq = col0 + (t % 4) * 2;
    if constexpr (sizeof(Out) == 2 && kA % 16 == 0) {
      if (rows16 && !accumulate && col0 + 2 * kA <= n) return store_blocks(acc, r, col0, m);
    }
    if (accumulate) return add_blocks(acc, r, cq, m, n);
#pragma unroll
    for (int j = 0; j < kA / 4; ++j) {
      store_pair(r, cq + 8 * j, acc[4 * j], acc[4 * j + 1], m, n);
      store_pair(r + 8, cq + 8 * j, acc[4 * j + 2], acc[4 * j + 3], m, n);
    }
  }
};

// The epilogue of a swapped launch (B's rows as the tile's rows, A's as its columns): the fragment
// holds C transposed, so element (i, j) goes to the inner epilogue as C[j, i], one value at a time.
template <typename Epi>
struct SwapEpilogue {
  static constexpr bool kAnyWidth = true;
  Epi inner;

  __device__ __forceinline__ SwapEpilogue for_split(int s) const { return {epilogue_for_split(inner, s)}; }

  template <int kA>
  __device__ __forceinline__ void operator()(const float (&acc)[kA], int row0, int col0, int m,
                                             int n) const {
    const int t = threadIdx.x % 128;
    const int r = row0 + (t / 32) * 16 + (t % 32) / 4, cq = col0 + (t % 4) * 2;
#pragma unroll
    for (int j = 0; j < kA / 4; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        inner.store_one(cq + 8 * j, r + 8 * h, acc[4 * j + 2 * h], n, m);
        inner.store_one(cq + 8 * j + 1, r + 8 * h, acc[4 * j + 2 * h + 1], n, m);
      }
    }
  }
};

// The range sums of a split reduced across CTAs (workspace [splits][m][n] fp32), added in range
// order, through the det_gemm epilogue: the same additions as a CTA that computes every range.
// Where N is a multiple of 4 a thread takes four columns and loads every range's four sums (16
// bytes each) before its first addition, so that its loads are in flight together: the sums were
// just written and sit in L2, where a pair a thread, loaded range after range, left the kernel
// stalled on memory (Nsight Compute at 2709630, 4B's o projection at M = 128: 5.0 us beside the
// GEMM's 14.4, 14 cycles of memory stall per instruction issued). Measured against that kernel in
// one command on an H100 (benchmarks/results/h100/412aae5/ab/): the split shapes' det_gemm 1.2-7.5%
// faster at M = 16-64 (the KV projections 2.6-7.5%), 0.1-2.7% at M = 96-192, and at M = 256 two
// of the four 1.5% slower.
// Whether the range sums are added four columns a thread (the kernel's path and its launch's grid).
__host__ __device__ constexpr bool combine_by_quads(int n, int splits) {
  return n % 4 == 0 && splits <= gemm_cfg::kMaxSplits;
}
template <typename Epi>
__global__ void __launch_bounds__(256)
    rlk_det_gemm_combine_kernel(const float* __restrict__ ws, int splits, int m, int n, const Epi epi) {
  ptx::grid_dependency_wait();  // the range sums come from the kernel just before
  const int64_t mn = static_cast<int64_t>(m) * n, stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (combine_by_quads(n, splits)) {
    const float4* quads = reinterpret_cast<const float4*>(ws);
    const int64_t slice = mn / 4;
    for (int64_t i = first; i < slice; i += stride) {
      float4 part[gemm_cfg::kMaxSplits];
#pragma unroll
      for (int s = 0; s < gemm_cfg::kMaxSplits; ++s) {
        if (s < splits) part[s] = quads[s * slice + i];
      }
      float4 v = part[0];
#pragma unroll
      for (int s = 1; s < gemm_cfg::kMaxSplits; ++s) {
        if (s < splits) {
          v = make_float4(__fadd_rn(v.x, part[s].x), __fadd_rn(v.y, part[s].y), __fadd_rn(v.z, part[s].z),
                          __fadd_rn(v.w, part[s].w));
        }
      }
      const int row = static_cast<int>(4 * i / n), col = static_cast<int>(4 * i % n);
      epi.store_pair(row, col, v.x, v.y, m, n);
      epi.store_pair(row, col + 2, v.z, v.w, m, n);
    }
    return;
  }
  const int64_t half = (n + 1) / 2;
  for (int64_t i = first; i < m * half; i += stride) {
    const int row = static_cast<int>(i / half), col = static_cast<int>(i % half) * 2;
    const float* p = ws + static_cast<int64_t>(row) * n + col;
    const bool two = col + 1 < n;
    float v0 = p[0], v1 = two ? p[1] : 0.f;
    for (int s = 1; s < splits; ++s) {
      v0 = __fadd_rn(v0, p[s * mn]);
      if (two) v1 = __fadd_rn(v1, p[s * mn + 1]);
    }
    epi.store_pair(row, col, v0, v1, m, n);
  }
}

// Host side. Operands: A [m, k] and B [n, k] with leading dimensions lda, ldb (elements). An
// operand marked MN-major is stored as its transpose (A as [k, m], B as [k, n], ld between K rows):
// the backward products read their operands that way in place (see gemm_reads_mn_major).
struct GemmOperands {
  const void* a;
  int64_t lda;
  const void* b;
  int64_t ldb;
  int m, n, k;
  DType dtype;  // kBF16 or kF16 for the wgmma path, kF32 for the plain path
  bool a_mn = false, b_mn = false;
};

using TmaEncodeFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                 const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                 const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                 CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// The driver's tensor-map encoder, found through the runtime so no link against libcuda is needed.
inline TmaEncodeFn tma_encode_fn() {
  static const TmaEncodeFn fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    const cudaError_t e =
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q);
    return (e == cudaSuccess && q == cudaDriverEntryPointSuccess) ? reinterpret_cast<TmaEncodeFn>(p)
                                                                    : nullptr;
  }();
  return fn;
}

// Tensor map of a row-major [rows, cols] 16-bit matrix, box 64 columns x box_rows rows (8 to 256),
// 128-byte swizzle; reads past the edges return zeros. Needs a 16-byte aligned base and row pitch.
inline cudaError_t encode_tma_2d(CUtensorMap* map, const void* ptr, DType dtype, int64_t rows,
                                 int64_t cols, int64_t ld, uint32_t box_rows) {
  const TmaEncodeFn encode = tma_encode_fn();
  if (encode == nullptr) return cudaErrorSymbolNotFound;
  if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0 || (ld * 2) % 16 != 0) return cudaErrorInvalidValue;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(ld * 2)};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(gemm_cfg::kBK), box_rows};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r = encode(
      map, dtype == DType::kF16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
      2, const_cast<void*>(ptr), dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
      CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

// Output tile of the sm_90a kernel: bm rows (16, 32 or 64 on one consumer warpgroup, 128 on two) by
// bn columns (8 to 256). A swapped tile runs the product as C^T = B A^T: its rows are B's (the
// weight's, N of them) and its columns A's, so at decode sizes M is the narrow side of the wgmma and
// every CTA streams a slab of bm weight rows. Each output element is still the same chain of k16
// steps over the same K blocks; only which operand the instruction calls A changes.
struct GemmTile {
  int bm, bn;
  bool swap;
};

// K blocks per stage of a tile: at least 8 KB of the streamed operand (B's bn rows, or a swapped
// tile's bm rows) per barrier round trip.
__host__ __device__ constexpr int gemm_tile_subs(int bm, int bn, bool swap) {
  return gemm_subs(swap ? bm : bn);
}

// Shared memory for the stages of one CTA when `occupancy` CTAs share an SM.
inline int gemm_ring_bytes(int occupancy) {
  return gemm_cfg::kSmPerSmem / occupancy - 1024 - gemm_cfg::kOverhead;
}

// The ring of a launch whose A has m rows and which has `tiles` tiles: A's box holds only the rows
// that exist (m rounded up to 8) when m is below the tile height; `subs` K blocks a stage; as many
// stages as fit. A launch with fewer tiles than resident slots runs fewer CTAs an SM, each with a
// deeper ring: a weight stream is paced by the bytes in flight per SM.
inline GemmRing gemm_ring(int bm, int bn, int subs, int m, int64_t tiles, int num_sms, bool two = false) {
  using namespace gemm_cfg;
  GemmRing r{};
  r.a_rows = m >= bm ? bm : (m + 7) / 8 * 8;
  r.a_bytes = static_cast<uint32_t>(r.a_rows * kRowBytes);
  r.b_bytes = static_cast<uint32_t>(bn * kRowBytes);
  r.stage_bytes = subs * (r.a_bytes + r.b_bytes);
  const int64_t per_sm = (tiles + num_sms - 1) / num_sms;
  const int most = gemm_max_occupancy(bm > 64 ? 2 : 1, bn, two);
  // The most resident CTAs useful (and allowed) that still leave each a ring of 4 stages (one where
  // nothing else fits).
  for (r.occupancy = per_sm < most ? static_cast<int>(per_sm) : most;; r.occupancy /= 2) {
    const int fit = static_cast<int>(gemm_ring_bytes(r.occupancy) / r.stage_bytes);
    r.stages = fit < kMaxStages ? fit : kMaxStages;
    if (r.stages >= 4 || r.occupancy == 1) break;
  }
  return r;
}

// Whether `items` CTAs of a 64-row tile bn wide (`two`: with a running sum) busy at least
// `busy_pct` percent of the SMs and are all resident at once.
inline bool gemm_one_resident_pass(int64_t items, int bn, int num_sms, bool two = false, int busy_pct = 100) {
  return 100 * items >= static_cast<int64_t>(busy_pct) * num_sms &&
         items <= static_cast<int64_t>(num_sms) * gemm_cfg::gemm_max_occupancy(1, bn, two);
}

// Whether, where a 128-row tile leaves its last row block at most half used (M = 129-192, 257-320,
// ...), 64 x 128 tiles over `cols` columns (N, or N times the K ranges met across CTAs) busy every
// SM and all fit at once, two CTAs an SM.
inline bool gemm_half_block_fits_64x128(int m, int64_t cols, int num_sms) {
  const int64_t rows64 = (m + 63) / 64;
  return m > 128 && rows64 % 2 == 1 && gemm_one_resident_pass(rows64 * ((cols + 127) / 128), 128, num_sms);
}

// K in about `want` ranges (at most kMaxSplits, at most one a unit of 4 K blocks) of whole units:
// choose_gemm_split's count, or another one a probe times (benchmarks/det_gemm_split_probe.cu).
inline GemmSplit gemm_split_in(int k, int want) {
  const int units = (k + 4 * gemm_cfg::kBK - 1) / (4 * gemm_cfg::kBK);
  want = want < gemm_cfg::kMaxSplits ? want : gemm_cfg::kMaxSplits;
  want = want < units ? want : units;
  const int per = (units + want - 1) / want;
  return {(units + per - 1) / per, 4 * per, false, nullptr, 0};
}

// The one tile choice of det_gemm (forward and both backward products). It may look at M, N and the
// SM count because the tile never changes a row's bits (see the top of this file); K is not looked
// at. Above M = 64 it first weighs the 128-row tiles of 256, 192, 160 and 128 columns: the share of
// the SMs' time over whole waves that computes output elements that exist (a half-empty wave or
// tile counts as lost), times the tile's own efficiency (narrower tiles move more shared memory
// per product); the best is taken where that exceeds 70% (60% at M <= 128). Otherwise (and from
// M = 33) it takes the first tile of kTileOrder (largest first, one of 64 rows before the narrow
// ones of 128; at M = 65-128 kOneBlockOrder, where 128 x 64 comes before 64 x 128) whose grid
// either fills one wave to between 55% (50% for 128 x 128 above M = 256) and 100% of the SMs or
// keeps at least 80% of them busy in every wave; tiles of 128 rows only above M = 64, where
// 64 x 32 is taken when none fits. Up to M = 32 (decode), and up to 64 where none fits (narrow N),
// the product is a stream of the weight: swapped tiles with M rounded up to 8, 16, 32 or 64 as the
// narrow side, and slabs of 32 weight rows; 64 rows where that still leaves two slabs an SM
// (reached only up to M = 32: at such N a 64-row unswapped tile fits), 16 where 32-row slabs would
// leave most SMs idle, or, at M <= 16 with K in one range (`ranges`, the K ranges whose CTAs N
// counts), where 16-row slabs give each SM fewer weight rows. Measured on an H200 over every tile
// at M = 64 to 1024 and the shapes of benchmarks/hopper_ops.py: a part wave of large tiles beats
// full waves of narrow ones (each CTA re-reads A and B per tile from L2), and a 64-row tile (two
// CTAs an SM) beats a 128-row one whose last row block is half empty (but see the 128 x 128 part
// wave below).
// From M = 33 to 64 a 64-row tile of 128, then 64, then 32 columns whose tiles busy every SM and
// all fit at once comes first: there the weight streams through every SM in one pass
// (benchmarks/hopper_ops.py at da6f8da, M = 64: gate-up 33.4 -> 30.3 us (4B) and 57.7 -> 54.0
// (8B) on 64 x 128 instead of 64 x 32 / 64, the wide shape 32.0 -> 29.8 on 64 x 64 instead of
// 64 x 128).
// Retuned from two sweeps of every plan (benchmarks/det_gemm_plans.py, one H100, at c68bd6f and
// 369419d; benchmarks/det_gemm_replay.py replays a sweep through this function), each change
// faster in both and in a third sweep at 2709630 (benchmarks/results/h100/2709630/): 64 x 32 at
// M = 33-64 for the fused QKV projections (N = 6144: 0.86-0.93 of cuBLAS on 64 x 64, 1.01-1.02 on
// 64 x 32 at M = 48, 0.94-0.95 at 64); where the tiles make a single row block (M = 65-128),
// 128 x 64 before 64 x 128, one CTA sharing each weight block between its two consumers instead of
// two CTAs reading it twice (QKV, KV, o and down projections at M = 96 / 128: 1.6% to 10% faster);
// the 70% bar (75% before) takes 128 x 192 at M = 192 on the widest weights (8B's gate-up 0.68 ->
// 0.91, N = 12288 0.85 -> 0.92). The bar also moves picks just past whole 128-row blocks, where
// a 128-row tile of 160 or 192 columns fills the SMs' waves that a wider one left part empty, or a
// 64-row one left a part wave (at 132 SMs, over the shapes of benchmarks/hopper_ops.py: M = 96-109
// on the gate-up projections, then ranges of 1 to 162 values of M from 191-204 up to 4737-4898).
// A sweep of 16 such M at f8d484b (benchmarks/results/h100/f8d484b/) timed 40 rows where the 70%
// and 75% bars pick differently: 36 faster on the 70% pick (1.38x geometric mean), 4 slower (the
// wide and deep shapes at M = 517, the fused QKV projections at M = 1030: 0.75 where 128 x 256
// gives 0.86-0.88).
inline GemmTile choose_gemm_tile(int m, int n, int num_sms, int ranges = 1) {
  static constexpr GemmTile kTileOrder[] = {{128, 256, false}, {128, 128, false}, {64, 128, false},
                                            {128, 64, false},  {128, 32, false},  {64, 64, false},
                                            {64, 32, false}};
  static constexpr GemmTile kOneBlockOrder[] = {{128, 256, false}, {128, 128, false}, {128, 64, false},
                                                {64, 128, false},  {128, 32, false},  {64, 64, false},
                                                {64, 32, false}};
  if (m > 32 && m <= 64) {
    for (const int bn : {128, 64, 32}) {
      if (gemm_one_resident_pass((n + bn - 1) / bn, bn, num_sms)) return {64, bn, false};
    }
  }
  if (m > 64) {
    // Own efficiency of a 128 x bn tile, per 1/100: products per byte it stages, 128 bn / (128 +
    // bn), relative to the 256-wide tile's, flattened since wgmma also reuses B across the two
    // consumers.
    static constexpr int kWide[][2] = {{256, 100}, {192, 97}, {160, 95}, {128, 92}};
    // In one row block (M <= 128) every 128-row tile leaves the same rows empty, so their bar is
    // 60%: 4B's gate-up projection (N = 19456) at M = 96 takes 128 x 160 (122 tiles, 0.656) where
    // the first fit below took 128 x 256 (76 tiles, 58% of a wave): 2.6-6.7% faster in the 9 H100
    // sweeps in benchmarks/results/h100/ that time it (0.93-1.03 of cuBLAS -> 0.98-1.06), 6.0% at
    // M = 100 (f8d484b/). Among the benchmark's shapes no other row moves (det_gemm_replay.py).
    GemmTile best{0, 0, false};
    double best_score = m <= 128 ? 0.60 : 0.70;
    for (const auto& [bn, eff] : kWide) {
      const int64_t tiles = static_cast<int64_t>((m + 127) / 128) * ((n + bn - 1) / bn);
      const int64_t waves = (tiles + num_sms - 1) / num_sms;
      const double useful = static_cast<double>(m) * n / (static_cast<double>(waves) * num_sms * 128 * bn);
      if (useful * eff / 100 > best_score) best = {128, bn, false}, best_score = useful * eff / 100;
    }
    if (best.bm != 0) return best;
  }
  if (m > 32) {
    for (const GemmTile& t : m > 64 && m <= 128 ? kOneBlockOrder : kTileOrder) {
      if (t.bm > 64 && m <= 64) continue;
      const int64_t tiles = static_cast<int64_t>((m + t.bm - 1) / t.bm) * ((n + t.bn - 1) / t.bn);
      const int64_t waves = (tiles + num_sms - 1) / num_sms;
      // Above M = 256 a part wave of 128 x 128 from 50% of the SMs: at N = 1024 the next tile that
      // fits is 64 x 32 in five waves (the KV projections at M = 1030, 72 tiles or 54.5% of 132
      // SMs: 0.30-0.33 of cuBLAS there, 0.62 on 128 x 128, benchmarks/results/h100/f8d484b/); at
      // M = 1024, 48% on 128 x 128, 128 x 64's full wave stays (0.90 against 0.64). Over the shapes
      // of benchmarks/hopper_ops.py at 132 SMs this moves M = 1025-1152 of the KV projections
      // alone; at other N up to 3072 or other SM counts it moves picks no sweep has timed (N = 1536
      // at M = 641-768, N = 3072 at M = 257-384; at 114 SMs, N = 2560 at M = 257-384).
      const int part_pct = m > 256 && t.bm == 128 && t.bn == 128 ? 50 : 55;
      const bool part_wave = tiles <= num_sms && 100 * tiles >= part_pct * num_sms;
      const bool full_waves = tiles > num_sms && 10 * tiles >= 8 * waves * num_sms;
      if (part_wave || full_waves) return t;
    }
    if (m > 64) return kTileOrder[6];
  }
  const int bn = m <= 8 ? 8 : m <= 16 ? 16 : m <= 32 ? 32 : 64;
  const int64_t slabs64 = (n + 63) / 64, slabs32 = (n + 31) / 32;
  if (slabs64 >= 2 * num_sms) return {64, bn, true};
  if (m <= 16 && ranges == 1) {
    // 16-row slabs where they take the SMs fewer weight rows each than 32-row ones: the fused QKV
    // projections (N = 6144, 1.45 slabs of 32 an SM at 132 SMs) 0.6-5% faster at M = 4-16 over
    // the five sweeps in benchmarks/results/h100/, -3% to +3% at M = 1-2 (at M = 32, 12% slower,
    // so not there). Not where K is split across CTAs: there N counts each range, and the KV
    // projections (N = 1024 in 5-6 ranges) are 5-9% slower on 16 rows (median 7%).
    const int64_t rows16 = ((n + 15) / 16 + num_sms - 1) / num_sms * 16;
    const int64_t rows32 = (slabs32 + num_sms - 1) / num_sms * 32;
    if (rows16 < rows32) return {16, bn, true};
  }
  if (2 * slabs32 >= num_sms) return {32, bn, true};
  return {16, bn, true};
}

// Whether a launch on tile t reads MN-major operands in place: B on the unswapped tiles of 128, 192
// or 256 columns (whole 64-column panels), A too where B is. Elsewhere the caller passes a K-major copy. Each k16 step takes
// the same products into the same accumulator either way, so the layout never shows in the bits
// (tests/ops/test_cuda_ops.py holds the two to torch.equal on every tile).
inline bool gemm_reads_mn_major(const GemmTile& t) { return !t.swap && t.bn >= 128 && t.bn % 64 == 0; }

// The one split choice of det_gemm: how many ranges K is cut into, from N and K alone (never M), in
// whole units of 4 K blocks so that no shared-memory stage straddles two ranges. A row's K chain
// is a sequence of dependent wgmma k16 steps, about 80 cycles each on an H200 whatever the tile
// (measured at M <= 32 over benchmarks/hopper_ops.py's shapes: K / 16 steps set the time wherever
// N K 2 bytes of weight stream faster than that, which is below N of about 6000). Up to N = 3072
// the chain is cut in up to 8 ranges, about 6144 / N of them; wider weights are left in one range,
// since every range boundary drains a large-M tile's wgmma pipeline (measured at e25236c: 8B's KV
// projection in 6 ranges loses about 10% at M >= 4096; a floor on the range length is the next
// step, and it will change these shapes' bits).
inline GemmSplit choose_gemm_split(int n, int k) { return gemm_split_in(k, n > 3072 ? 1 : (6144 + n - 1) / n); }

// K in one range: the order of an epilogue that is not split (linear_logp's fused tiles).
inline GemmSplit gemm_no_split(int k) { return {1, (k + gemm_cfg::kBK - 1) / gemm_cfg::kBK, false, nullptr, 0}; }

// A tile whose accumulator fits twice in a thread's registers (the running sum of a split K
// beside the range's own): 128 rows by at most 160 columns (2 x 80 of 240 registers), 64 rows by
// at most 64 (two CTAs an SM, 128 registers). A wider pick becomes 160 or 128 columns, whichever
// leaves less of the last column block empty (160 on a tie: it stages fewer bytes per product);
// 64 x 128 becomes 128 x 64, as many tiles with half the shared-memory traffic per product of
// 64 x 64's twice as many (benchmarks/hopper_ops.py at da6f8da, the KV projections at M = 1024:
// 4B 16.5 -> 13.8 us, 8B 25.6 -> 20.0).
inline GemmTile gemm_two_sum_tile(GemmTile t, int n) {
  if (t.bm == 64 && t.bn > 64) t = {128, 64, false};
  if (t.bm == 128 && t.bn > 160) t.bn = (n + 159) / 160 * 160 - n <= (n + 127) / 128 * 128 - n ? 160 : 128;
  return t;
}

// The layout of one det_gemm launch: its tile, its split, and the fp32 scratch it needs.
struct GemmPlan {
  GemmTile tile;
  GemmSplit split;
  int64_t scratch_floats;
};

// A split K is reduced across CTAs for the weight stream of a swapped tile, and up to M = 256 where
// the unsplit tiles make at most one wave: there a CTA's time is its K chain (measured: Qwen3-4B's
// down projection takes the same 29 us at M = 1, 64 and 128). Each (tile, range) is a CTA, the tile
// chosen as for N times the ranges (narrower from M = 33 where that leaves SMs idle, see below),
// and a workspace of splits x M x N floats holds the range sums.
// Above M = 256, or where the tiles fill a wave, they are compute bound and that workspace's traffic
// (2 splits M N 4 bytes) would cost more than shorter chains win, so each CTA runs its tiles'
// ranges one after the other on the tile gemm_two_sum_tile makes of choose_gemm_tile's, a running
// sum beside the accumulator.
// plan_det_gemm_in lays out K in the ranges `split` gives; plan_det_gemm in choose_gemm_split's, or
// with split_k false in one range (gemm_no_split) for a product that must repeat the bits of an
// unsplit kernel.
inline GemmPlan plan_det_gemm_in(int m, int n, int num_sms, const GemmSplit& split) {
  GemmPlan p{choose_gemm_tile(m, n, num_sms), split, 0};
  const GemmTile& t = p.tile;
  if (p.split.splits == 1) {
    // From M = 33 to 64, where 64 x 32 tiles make one wave, swapped slabs of 32 weight rows by 64
    // tokens in their place (the same CTAs, each streaming the same weight rows) where K is at
    // most 64 blocks: N = 4096 at M = 48 and 64 in each of the 8 H100 sweeps in
    // benchmarks/results/h100/ that time both (paired/ and swing/ timed other kernels), 3.7-6.5%
    // faster at K = 2560 (Qwen3-4B's q projection) and 0.7-3.3% at 4096; at K = 12288 from 0.8%
    // faster to 2.1% slower, so it keeps 64 x 32. Among the benchmark's shapes this moves those
    // two alone (benchmarks/det_gemm_replay.py over every sweep); elsewhere, products of at most
    // one slab an SM whose K is one range (N > 3072, or K <= 256), none of them timed.
    if (m > 32 && m <= 64 && t.bm == 64 && t.bn == 32 && !t.swap && (n + 31) / 32 <= num_sms &&
        p.split.blocks <= 64)
      p.tile = {32, 64, true};
    // At M = 129-192, where a 128 x 128 tile's second row block is at most half used, 64 x 128
    // tiles (two CTAs an SM) where theirs busy every SM and all fit at once and K is at least 64
    // blocks: 8B's fused QKV projection (N = 6144, K = 4096) at M = 192 on 64 x 128 was 2.3-13.8%
    // faster in each of the 9 H100 sweeps in benchmarks/results/h100/ that time it (0.69-0.82 of
    // cuBLAS -> 0.77-0.84). 4B's (K = 2560, 40 blocks) was 2% slower to 4% faster there and keeps
    // 128 x 128. Among the benchmark's shapes this moves that one row alone (det_gemm_replay.py
    // over every sweep); N = 4096 already takes 64 x 128 at M = 192, and at 132 SMs it reaches
    // N = 5505-11264 only.
    if (m <= 192 && t.bm == 128 && t.bn == 128 && p.split.blocks >= 64 &&
        gemm_half_block_fits_64x128(m, n, num_sms))
      p.tile = {64, 128, false};
    // At M <= 2 where K is one range of at least 192 blocks (Qwen3-8B's down projection, K = 12288),
    // the weight in slabs of 16 rows instead of 32, two CTAs an SM over the same rows, each on its
    // own K chain: 8B's down projection at M = 1 / 2 was faster on 16 rows in 11 / 12 of the 13
    // H100 sweeps in benchmarks/results/h100/ that time both (median 0.7% / 1.7%, up to 3.6% /
    // 5.2%; the others within 2.5%), and by 3-5% in the three latest (deep-only sweeps). At M = 4
    // it was a coin toss (8 of 13), and at K = 2560-4096 (4B's q projection, the square and wide
    // shapes) 16 rows were 1-8% slower at M = 1-4 in every sweep, so those keep 32. Only where the
    // 16-row slabs stay within two an SM: among the benchmark's shapes det_gemm_replay.py moves
    // those two rows alone; elsewhere, untimed, N = 3073-4224 at K >= 12288 on 132 SMs.
    if (m <= 2 && t.swap && t.bm == 32 && p.split.blocks >= 192 && (n + 15) / 16 <= 2 * num_sms)
      p.tile = {16, t.bn, true};
    return p;
  }
  const int64_t tiles = static_cast<int64_t>((m + t.bm - 1) / t.bm) * ((n + t.bn - 1) / t.bn);
  if (t.swap || (m <= 256 && tiles <= num_sms)) {
    p.tile = choose_gemm_tile(m, n * p.split.splits, num_sms, p.split.splits);
    // From M = 33 to 64 a (tile, range) is a short K chain: 64 x 32 tiles, four CTAs an SM, where
    // their items busy every SM and fit at once. benchmarks/hopper_ops.py at da6f8da, M = 64: 4B's
    // o projection 12.6 -> 11.4 us, its down projection 21.3 -> 20.4, the KV projections 7.7 ->
    // 7.0 (4B) and 8.7 -> 8.1 (8B); at M = 32, where the swapped weight-stream tiles let the next
    // launch in early, the same tiles were 0-7% slower, so M <= 32 keeps those.
    const int64_t narrow = static_cast<int64_t>((n + 31) / 32) * p.split.splits;
    if (m > 32 && m <= 64 && gemm_one_resident_pass(narrow, 32, num_sms)) p.tile = {64, 32, false};
    // From M = 65, where the pick's (tile, range) items leave a third of the SMs idle, swapped
    // 64 x 64 tiles (slabs of 64 weight rows by 64 tokens) where theirs busy every SM and fit at
    // once: 4B's KV projection (N = 1024 in 5 ranges: 80 items of 128 x 64 or 128 x 128) in every
    // H100 sweep in benchmarks/results/h100/, 6-12% faster at M = 128 and 15-20% at M = 192, -3%
    // to +6% at M = 96-100. 8B's (96 items) keeps its tile: swapped, it was 12-18% slower at
    // M = 96-100 and 0-8% faster at 128; the o and down projections (120 items) keep theirs.
    // Where those slabs no longer fit at once (4B's KV projection at M = 193-256: 320), 64 x 32
    // tiles that run every range in the CTA, three an SM, where they busy nine in ten SMs in one
    // pass (128 tiles at N = 1024): on one H100 0.79 of cuBLAS against 0.69 on 128 x 128 across
    // CTAs at M = 256, 0.78 against 0.74 at 193 (benchmarks/results/h100/4553bb4/), and faster at
    // M = 256 in 10 of the 11 earlier sweeps in benchmarks/results/h100/ (by 1.3-19%), where that
    // tile still spilled in all but split_probe/. At 114 or 78 SMs it moves other untimed picks
    // (N = 768-3072, M = 65-256).
    if (m > 64) {
      const GemmTile& c = p.tile;
      const int64_t items = static_cast<int64_t>((m + c.bm - 1) / c.bm) * ((n * p.split.splits + c.bn - 1) / c.bn);
      const int64_t rows64 = (m + 63) / 64;  // row blocks of the 64-row tiles below
      const int64_t slabs = rows64 * ((n + 63) / 64) * p.split.splits;
      const int64_t narrow_tiles = rows64 * ((n + 31) / 32);
      const bool short_ranges = p.split.blocks <= 24;
      if (3 * items < 2 * num_sms) {
        if (gemm_one_resident_pass(slabs, 64, num_sms)) {
          p.tile = {64, 64, true};
        } else if (gemm_one_resident_pass(narrow_tiles, 32, num_sms, true, 90)) {
          p.tile = {64, 32, false};
          return p;  // the ranges met within each CTA: no workspace
        }
      } else if (c.bm == 128 && (5 * items < 4 * num_sms || short_ranges) &&
                 gemm_half_block_fits_64x128(m, static_cast<int64_t>(n) * p.split.splits, num_sms)) {
        // At M = 129-192 a 128-row tile leaves its second row block at most half used: 64 x 128
        // tiles (two CTAs an SM) where the pick's items leave more than a fifth of the SMs idle (a
        // third or more went to the tiles above) and theirs busy every SM and all fit at once. 8B's
        // KV projection at M = 192 (96 items of 128 x 128, 144 of 64 x 128): 0.64-0.65 -> 0.75-0.78
        // of cuBLAS in the 11 earlier H100 sweeps in benchmarks/results/h100/ that time it, 0.66 ->
        // 0.77 at 8f167b9 (and 0.70 -> 0.87 at M = 129). At M = 256, where both tiles fill their
        // rows, 128 x 128 stays (0.84-0.88 against 0.81-0.82 in those 11 sweeps).
        // The same where the ranges are short (at most 24 K blocks) whatever the pick leaves idle:
        // there a CTA's prologue and epilogue weigh as much as its chain, and two CTAs an SM hide
        // one's behind the other's. 4B's o projection (N = 2560 in 3 ranges of 24 blocks: 120
        // items of 128 x 128, 180 of 64 x 128) at M = 192: 8-12% faster in 9 of those 11 sweeps
        // (0.3% and 2.4% in the other two), and 11% / 13% at M = 129 / 160, 2% / 6% at 192, in two
        // sweeps at 8f167b9 (benchmarks/results/h100/8f167b9/ and its o-down-sweep/). Its down
        // projection, the same tiles over ranges of 52 blocks, is 3-9% slower on 64 x 128 at
        // M = 192 (and 3% at 160) and keeps 128 x 128. At 132 SMs only the o projection moves among
        // the benchmark's shapes; at 114 or 78 SMs some untimed N <= 3072 products do.
        p.tile = {64, 128, false};
      }
    }
    p.split.across = true;
    p.scratch_floats = static_cast<int64_t>(p.split.splits) * m * n;
    return p;
  }
  p.tile = gemm_two_sum_tile(t, n);
  return p;
}

inline GemmPlan plan_det_gemm(int m, int n, int k, int num_sms, bool split_k) {
  return plan_det_gemm_in(m, n, num_sms, split_k ? choose_gemm_split(n, k) : gemm_no_split(k));
}

// The plans the tile choice could make for (m, n, k), plan_det_gemm's pick among them: K in
// choose_gemm_split's ranges (fixed by N and K) on each unswapped tile the launcher instantiates,
// the ranges meeting across CTAs; up to M = 256 the swapped tiles of 64, 32 and 16 weight rows by
// M rounded up to 8, 16 or 32 tokens, or by 64 (one to four column blocks of tokens from M = 33);
// and where K is split, gemm_two_sum_tile's tiles with the ranges met within each CTA. The tile
// choice is free only because no plan changes a row's bits: benchmarks/det_gemm_plans.py times
// every plan against cuBLAS and the CUDA tests hold each to the pick's bits. Returns how many plans
// it wrote to out (at most kGemmPlanOptions).
constexpr int kGemmPlanOptions = 24;
inline int det_gemm_plan_options(int m, int n, int k, GemmPlan* out) {
  static constexpr GemmTile kTiles[] = {{128, 256, false}, {128, 192, false}, {128, 160, false},
                                        {128, 128, false}, {128, 64, false},  {128, 32, false},
                                        {64, 128, false},  {64, 64, false},   {64, 32, false}};
  static constexpr GemmTile kTwoSum[] = {{128, 160, false}, {128, 128, false}, {128, 64, false},
                                         {128, 32, false},  {64, 64, false},   {64, 32, false}};
  static_assert(sizeof(kTiles) / sizeof(kTiles[0]) + 3 + sizeof(kTwoSum) / sizeof(kTwoSum[0]) <= kGemmPlanOptions,
                "every plan fits in out");
  const GemmSplit split = choose_gemm_split(n, k);
  const bool split_k = split.splits > 1;
  int count = 0;
  auto add = [&](GemmTile t, bool across) {
    GemmPlan p{t, split, 0};
    p.split.across = across;
    if (across) p.scratch_floats = static_cast<int64_t>(split.splits) * m * n;
    out[count++] = p;
  };
  for (const GemmTile& t : kTiles) add(t, split_k);
  if (m <= 256) {
    const int narrow = m <= 8 ? 8 : m <= 16 ? 16 : m <= 32 ? 32 : 64;
    for (const int bm : {64, 32, 16}) add({bm, narrow, true}, split_k);
  }
  if (split_k) {
    for (const GemmTile& t : kTwoSum) add(t, false);
  }
  return count;
}

// Whether two plans launch the same way (the workspace pointer and item count are set at launch).
inline bool same_gemm_plan(const GemmPlan& a, const GemmPlan& b) {
  return a.tile.bm == b.tile.bm && a.tile.bn == b.tile.bn && a.tile.swap == b.tile.swap &&
         a.split.splits == b.split.splits && a.split.blocks == b.split.blocks &&
         a.split.across == b.split.across && a.scratch_floats == b.scratch_floats;
}

// Whether plan is one of det_gemm_plan_options(m, n, k): the launcher maps a tile it does not
// instantiate to another, so a plan from elsewhere must be checked before it runs.
inline bool is_det_gemm_plan_option(int m, int n, int k, const GemmPlan& plan) {
  GemmPlan all[kGemmPlanOptions];
  const int count = det_gemm_plan_options(m, n, k, all);
  for (int i = 0; i < count; ++i) {
    if (same_gemm_plan(all[i], plan)) return true;
  }
  return false;
}

// The configuration of a launch with programmatic stream serialization (see the top of this file).
struct PdlLaunch {
  cudaLaunchAttribute attr[2];
  cudaLaunchConfig_t cfg{};
  // serialize false: a plain launch through the same configuration (no early start). cluster: CTAs
  // per cluster (1: no clusters).
  PdlLaunch(int grid, int block, int smem, cudaStream_t stream, bool serialize = true, int cluster = 1) {
    cfg.gridDim = dim3(grid);
    cfg.blockDim = dim3(block);
    cfg.dynamicSmemBytes = static_cast<size_t>(smem);
    cfg.stream = stream;
    cfg.attrs = attr;
    cfg.numAttrs = 0;
    if (serialize) {
      attr[cfg.numAttrs].id = cudaLaunchAttributeProgrammaticStreamSerialization;
      attr[cfg.numAttrs++].val.programmaticStreamSerializationAllowed = 1;
    }
    if (cluster > 1) {
      attr[cfg.numAttrs].id = cudaLaunchAttributeClusterDimension;
      attr[cfg.numAttrs++].val.clusterDim = {static_cast<unsigned>(cluster), 1, 1};
    }
  }
  PdlLaunch(const PdlLaunch&) = delete;  // cfg points into attr
};

// How many 2-CTA clusters of `kernel` with `smem` bytes can run at once on the current device (0
// where clusters cannot launch): SMs are paired within a GPC, so an odd GPC leaves one SM out.
// `cached` (device << 56 | smem << 32 | pairs) keeps the runtime's answer for the last device and
// size asked of this kernel (GPUs of one process may be cut down differently).
template <typename Kernel>
int gemm_active_pairs(Kernel kernel, int block, int smem, std::atomic<int64_t>& cached) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device > 126) {
    (void)cudaGetLastError();
    return 0;
  }
  const int64_t key = static_cast<int64_t>(device) << 24 | smem;  // smem < 2^24
  const int64_t c = cached.load(std::memory_order_relaxed);
  if (c >= 0 && (c >> 32) == key) return static_cast<int>(c & 0xffffffff);
  const PdlLaunch pair(2, block, smem, nullptr, false, 2);  // one cluster of two, no early start
  int pairs = 0;
  if (cudaOccupancyMaxActiveClusters(&pairs, kernel, &pair.cfg) != cudaSuccess) {
    (void)cudaGetLastError();
    pairs = 0;
  }
  cached.store(key << 32 | pairs, std::memory_order_relaxed);
  return pairs;
}

// Whether a launch pairs its CTAs (clusters of two, each loading half of the A block both tiles
// of a pair share, multicast into both), so that A's reads from L2 halve. Pairing never changes a
// value (each tile's products and their order are its own), only which CTA loads what; it costs a
// lockstep (no stage is refilled until both CTAs have released it). Measured on an H100: paired
// everywhere (benchmarks/results/h100/pairs_cta/), the one-wave launches at M = 64-256 were 0.91
// of their unpaired speed and only the many-wave launches of the 128 x 128 tile whose K ranges meet
// within the CTA gained (Qwen3-8B's KV projection at M >= 4096, 5-6%; 4B's, 1-3%). At N = 1024
// that is the two-sum tile picked (no column left empty); it reads a third more from L2 per
// product than the 128 x 256 tile of the unsplit shapes and keeps L2 78% busy. Paired there alone
// (benchmarks/results/h100/ddcfeb2/): those rows 2-4% faster, L2 78% -> 65%. Four conditions:
// - gemm_pair_tile: that tile;
// - gemm_may_pair: a K-major A whose block splits into halves of whole 8-row swizzle atoms, K not
//   split across CTAs, at least two column blocks;
// - gemm_pairs_fit: the launch takes more than one wave unpaired (one-wave launches of this tile
//   were never timed paired, and those of others lost), and the pairs that fit at once
//   (`active_pairs`, fewer than half the CTA slots where an odd GPC leaves an SM out) run it in no
//   more waves than that.
inline bool gemm_may_pair(bool a_mn_major, bool across, int a_rows, int n_blocks) {
  return !a_mn_major && !across && a_rows % 16 == 0 && n_blocks >= 2;
}
inline bool gemm_pairs_fit(int m_blocks, int n_blocks, int64_t slots, int active_pairs) {
  if (active_pairs <= 0) return false;
  const int64_t tiles = static_cast<int64_t>(m_blocks) * n_blocks;
  if (tiles <= slots) return false;
  const int64_t units = static_cast<int64_t>(m_blocks) * ((n_blocks + 1) / 2);
  return (units + active_pairs - 1) / active_pairs <= (tiles + slots - 1) / slots;
}

template <int kBM, int kBN, int kSubs, bool kTA, bool kTB, bool kTwo, typename Epi>
cudaError_t launch_det_gemm_grid(const GemmOperands& op, const Epi& epi, const GemmSplit& split,
                                 int num_sms, bool stream_dependents, cudaStream_t stream) {
  using namespace gemm_cfg;
  if (op.m <= 0 || op.n <= 0) return cudaSuccess;
  const int m_blocks = (op.m + kBM - 1) / kBM, n_blocks = (op.n + kBN - 1) / kBN;
  const int64_t tiles = static_cast<int64_t>(m_blocks) * n_blocks;
  const int64_t items = split.across ? tiles * split.splits : tiles;
  // An MN-major A always takes whole 64-row panels (zero-filled past m).
  const GemmRing ring = gemm_ring(kBM, kBN, kSubs, kTA && op.m < kBM ? kBM : op.m, items, num_sms, kTwo);
  auto kernel = op.dtype == DType::kF16 ? rlk_det_gemm_sm90_kernel<kBM, kBN, kSubs, true, kTA, kTB, kTwo, Epi>
                                        : rlk_det_gemm_sm90_kernel<kBM, kBN, kSubs, false, kTA, kTB, kTwo, Epi>;
  const int smem = ring.stages * static_cast<int>(ring.stage_bytes) + kOverhead;
  const int block = kBM > 64 ? 384 : 256;
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e != cudaSuccess) return e;
  const int64_t slots = static_cast<int64_t>(ring.occupancy) * num_sms;
  static std::atomic<int64_t> pairs_cache{-1};  // one per tile and layout (both 16-bit types alike)
  const bool may_pair = gemm_pair_tile(kBM, kBN, kTwo) && gemm_may_pair(kTA, split.across, ring.a_rows, n_blocks);
  const int pairs = may_pair ? gemm_active_pairs(kernel, block, smem, pairs_cache) : 0;
  const bool paired = may_pair && gemm_pairs_fit(m_blocks, n_blocks, slots, pairs);
  CUtensorMap map_a, map_b;
  e = kTA ? encode_tma_2d(&map_a, op.a, op.dtype, op.k, op.m, op.lda, kBK)
          : encode_tma_2d(&map_a, op.a, op.dtype, op.m, op.k, op.lda, paired ? ring.a_rows / 2 : ring.a_rows);
  if (e == cudaSuccess) {
    e = kTB ? encode_tma_2d(&map_b, op.b, op.dtype, op.k, op.n, op.ldb, kBK)
            : encode_tma_2d(&map_b, op.b, op.dtype, op.n, op.k, op.ldb, kBN);
  }
  if (e != cudaSuccess) return e;
  GemmSplit work = split;
  int grid;
  if (paired) {
    const int64_t units = static_cast<int64_t>(m_blocks) * ((n_blocks + 1) / 2);
    work.items = static_cast<int>(units);
    grid = 2 * static_cast<int>(units < pairs ? units : pairs);
  } else {
    work.items = static_cast<int>(items);
    grid = items < slots ? static_cast<int>(items) : static_cast<int>(slots);
  }
  PdlLaunch launch(grid, block, smem, stream, true, paired ? 2 : 1);
  return cudaLaunchKernelEx(&launch.cfg, kernel, map_a, map_b, op.m, op.n, op.k, ring, epi,
                            stream_dependents, work, paired);
}

template <typename Epi, typename = void>
struct AnyWidth : std::false_type {};
template <typename Epi>
struct AnyWidth<Epi, std::void_t<decltype(Epi::kAnyWidth)>> : std::bool_constant<Epi::kAnyWidth> {};

// One tile: a swapped one launches B as the rows and A as the columns. kTwo: the tile runs all of
// its K ranges (a split reduced within CTAs).
template <int kBM, int kBN, bool kSwap, typename Epi, bool kTwo = false>
cudaError_t launch_det_gemm_tile(const GemmOperands& op, const Epi& epi, const GemmSplit& split,
                                 int num_sms, cudaStream_t stream) {
  constexpr int kSubs = gemm_tile_subs(kBM, kBN, kSwap);
  if constexpr (kSwap) {
    if (op.a_mn || op.b_mn) return cudaErrorInvalidValue;  // see gemm_reads_mn_major
    const GemmOperands t{op.b, op.ldb, op.a, op.lda, op.n, op.m, op.k, op.dtype};
    return launch_det_gemm_grid<kBM, kBN, kSubs, false, false, kTwo>(t, SwapEpilogue<Epi>{epi}, split, num_sms,
                                                                     true, stream);
  } else if constexpr (kBN >= 128 && kBN % 64 == 0 && AnyWidth<Epi>::value) {
    if (op.a_mn && op.b_mn) {
      return launch_det_gemm_grid<kBM, kBN, kSubs, true, true, kTwo>(op, epi, split, num_sms, false, stream);
    }
    if (op.a_mn) return cudaErrorInvalidValue;
    if (op.b_mn) return launch_det_gemm_grid<kBM, kBN, kSubs, false, true, kTwo>(op, epi, split, num_sms, false, stream);
    return launch_det_gemm_grid<kBM, kBN, kSubs, false, false, kTwo>(op, epi, split, num_sms, false, stream);
  } else {
    if (op.a_mn || op.b_mn) return cudaErrorInvalidValue;
    return launch_det_gemm_grid<kBM, kBN, kSubs, false, false, kTwo>(op, epi, split, num_sms, false, stream);
  }
}

template <int kBM, typename Epi>
cudaError_t launch_det_gemm_swapped(int bn, const GemmOperands& op, const Epi& epi, const GemmSplit& split,
                                    int num_sms, cudaStream_t stream) {
  switch (bn) {
    case 8: return launch_det_gemm_tile<kBM, 8, true>(op, epi, split, num_sms, stream);
    case 16: return launch_det_gemm_tile<kBM, 16, true>(op, epi, split, num_sms, stream);
    case 32: return launch_det_gemm_tile<kBM, 32, true>(op, epi, split, num_sms, stream);
    default: return launch_det_gemm_tile<kBM, 64, true>(op, epi, split, num_sms, stream);
  }
}

// det_gemm on tile t (one choose_gemm_tile can return; a split within CTAs, one of
// gemm_two_sum_tile's).
template <typename Epi>
cudaError_t launch_det_gemm_on(const GemmTile& t, const GemmOperands& op, const Epi& epi,
                               const GemmSplit& split, int num_sms, cudaStream_t stream) {
  if (split.splits > 1 && !split.across) {  // the tiles of gemm_two_sum_tile
    if (t.swap) return cudaErrorInvalidValue;
    if (t.bm == 64) {
      return t.bn == 64 ? launch_det_gemm_tile<64, 64, false, Epi, true>(op, epi, split, num_sms, stream)
                        : launch_det_gemm_tile<64, 32, false, Epi, true>(op, epi, split, num_sms, stream);
    }
    switch (t.bn) {
      case 160: return launch_det_gemm_tile<128, 160, false, Epi, true>(op, epi, split, num_sms, stream);
      case 128: return launch_det_gemm_tile<128, 128, false, Epi, true>(op, epi, split, num_sms, stream);
      case 64: return launch_det_gemm_tile<128, 64, false, Epi, true>(op, epi, split, num_sms, stream);
      default: return launch_det_gemm_tile<128, 32, false, Epi, true>(op, epi, split, num_sms, stream);
    }
  }
  if (t.swap) {
    switch (t.bm) {
      case 64: return launch_det_gemm_swapped<64>(t.bn, op, epi, split, num_sms, stream);
      case 32: return launch_det_gemm_swapped<32>(t.bn, op, epi, split, num_sms, stream);
      default: return launch_det_gemm_swapped<16>(t.bn, op, epi, split, num_sms, stream);
    }
  }
  if (t.bm == 64) {
    switch (t.bn) {
      case 128: return launch_det_gemm_tile<64, 128, false>(op, epi, split, num_sms, stream);
      case 64: return launch_det_gemm_tile<64, 64, false>(op, epi, split, num_sms, stream);
      default: return launch_det_gemm_tile<64, 32, false>(op, epi, split, num_sms, stream);
    }
  }
  switch (t.bn) {
    case 256: return launch_det_gemm_tile<128, 256, false>(op, epi, split, num_sms, stream);
    case 192: return launch_det_gemm_tile<128, 192, false>(op, epi, split, num_sms, stream);
    case 160: return launch_det_gemm_tile<128, 160, false>(op, epi, split, num_sms, stream);
    case 128: return launch_det_gemm_tile<128, 128, false>(op, epi, split, num_sms, stream);
    case 64: return launch_det_gemm_tile<128, 64, false>(op, epi, split, num_sms, stream);
    default: return launch_det_gemm_tile<128, 32, false>(op, epi, split, num_sms, stream);
  }
}

// An epilogue written for the 64 x 256 fragment alone (linear_logp's) on the 128 x 256 tile, K
// unsplit.
template <typename Epi>
cudaError_t launch_det_gemm_sm90(const GemmOperands& op, const Epi& epi, int num_sms,
                                 cudaStream_t stream) {
  static_assert(!AnyWidth<Epi>::value, "det_gemm's own epilogue launches through its plan");
  return launch_det_gemm_tile<128, 256, false>(op, epi, gemm_no_split(op.k), num_sms, stream);
}

// det_gemm as plan_det_gemm(op.m, op.n, op.k, num_sms, ...) laid it out, into epi (a StoreEpilogue);
// scratch holds plan.scratch_floats floats (null only when that is 0: a split across CTAs without it
// is cudaErrorInvalidValue), 16-byte aligned, as every allocator gives it (the range sums are read
// 16 bytes at a time where N is a multiple of 4). Split across CTAs, the tiles write their range
// sums to scratch and rlk_det_gemm_combine_kernel adds them up into epi.
template <typename Out>
cudaError_t launch_det_gemm_planned(const GemmOperands& op, const StoreEpilogue<Out>& epi,
                                    const GemmPlan& plan, float* scratch, int num_sms, cudaStream_t stream) {
  GemmSplit split = plan.split;
  split.scratch = scratch;
  if (!split.across) return launch_det_gemm_on(plan.tile, op, epi, split, num_sms, stream);
  if (op.m <= 0 || op.n <= 0) return cudaSuccess;
  if (scratch == nullptr) return cudaErrorInvalidValue;
  const int64_t mn = static_cast<int64_t>(op.m) * op.n;
  const StoreEpilogue<float> sums{scratch, op.n, nullptr, false, op.n % 2 == 0, false, mn};
  cudaError_t e = launch_det_gemm_on(plan.tile, op, sums, split, num_sms, stream);
  if (e != cudaSuccess) return e;
  // Four columns a thread where N allows (see the kernel), else a pair.
  const int64_t per_row = combine_by_quads(op.n, split.splits) ? op.n / 4 : (op.n + 1) / 2;
  const int64_t blocks = (static_cast<int64_t>(op.m) * per_row + 255) / 256;
  PdlLaunch launch(static_cast<int>(blocks < 8 * num_sms ? blocks : 8 * num_sms), 256, 0, stream);
  return cudaLaunchKernelEx(&launch.cfg, rlk_det_gemm_combine_kernel<StoreEpilogue<Out>>,
                            static_cast<const float*>(scratch), split.splits, op.m, op.n, epi);
}

template <typename Epi>
cudaError_t launch_det_gemm_f32(const GemmOperands& op, const Epi& epi, cudaStream_t stream) {
  if (op.m <= 0 || op.n <= 0) return cudaSuccess;
  const dim3 grid((op.n + 63) / 64, (op.m + 63) / 64);
  rlk_det_gemm_f32_kernel<<<grid, 256, 0, stream>>>(static_cast<const float*>(op.a), op.lda,
                                                static_cast<const float*>(op.b), op.ldb, op.m, op.n,
                                                op.k, epi);
  return cudaGetLastError();
}

}  // namespace rl_engine::cuda
