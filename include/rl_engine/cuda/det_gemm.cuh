// Batch-invariant GEMM C[m, n] = sum_k A[m, k] B[n, k] for Hopper (sm_90a), both operands K-major.
//
// The reduction order is one for every shape: K walked in 64-wide blocks from 0 upwards, each block
// four wgmma k16 steps into one fp32 accumulator, zero-filled past K; no split-K, no stream-K, no
// atomic. What changes with the shape is only the output tile (64 or 128 rows, 8 to 256 columns,
// picked by choose_gemm_tile) and how many K blocks one shared-memory stage holds: a row's bits
// depend only on that row and B, not on M, on the row's position, on the tile or on the grid.
//
// The grid is persistent (one CTA per SM, tiles strided over CTAs); warpgroup 0 is the producer (one
// thread issues bulk tensor copies into a ring of shared-memory stages guarded by mbarriers), each
// consumer warpgroup owns 64 rows of the tile. At small M the GEMM streams B: narrow tiles give
// every SM a slice of B's rows, and A's box shrinks to the rows that exist, so the ring holds B.
//
// The epilogue is a functor called by each consumer warpgroup with its 64 x BN fp32 fragment, so
// the same main loop serves det_gemm's store and the fused log-sum-exp tiles of linear_logp.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "rl_engine/cuda/gemm_wgmma.cuh"
#include "rl_engine/cuda/ptx.cuh"
#include "rl_engine/cuda/types.cuh"

namespace rl_engine::cuda {

namespace gemm_cfg {
constexpr int kBK = 64;  // one K block: 64 16-bit values, one 128-byte swizzled row per tile row
constexpr int kRowBytes = kBK * 2;
constexpr int kMaxStages = 16;
constexpr int kSmPerSmem = 233472;  // shared memory of one SM, 1 KB of it reserved per resident CTA
// wgmma reads 64 rows of A per consumer; where A's box is shorter (M < 64), the rows past it come
// from whatever follows in shared memory and only reach output rows that are never stored.
constexpr int kSlackBytes = 64 * kRowBytes;
constexpr int kOverhead = kSlackBytes + 2 * kMaxStages * 8 + 1024;  // + barriers, alignment
// Resident CTAs per SM of a one-warpgroup tile (registers allow 4 below 64 columns): at small M a
// row's K chain is a sequence of dependent wgmma, so an SM runs several tiles' chains at once.
__host__ __device__ constexpr int gemm_max_occupancy(int consumers, int bn) {
  return consumers == 2 ? 1 : bn >= 64 ? 2 : 4;
}
constexpr int kGroupM = 16;  // tile order: 16 row blocks per band, for L2 reuse of B
}  // namespace gemm_cfg

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

// Fragment layout of one consumer (m64nBN fp32): thread t of the warpgroup holds, for each 8-column
// block j, acc[4j + 2h + e] = C[row0 + 16 (t / 32) + (t % 32) / 4 + 8h, col0 + 8j + 2 (t % 4) + e].
template <int kConsumers, int kBN, bool kHalf, typename Epi>
__global__ void __launch_bounds__(128 * (1 + kConsumers), gemm_cfg::gemm_max_occupancy(kConsumers, kBN))
    rlk_det_gemm_sm90_kernel(const __grid_constant__ CUtensorMap map_a,
                             const __grid_constant__ CUtensorMap map_b, int m, int n, int k,
                             const GemmRing ring, const Epi epi) {
  using namespace gemm_cfg;
  constexpr int kBM = 64 * kConsumers, kSubs = gemm_subs(kBN);
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const uint32_t base = (ptx::smem_u32(smem_raw) + 1023u) & ~1023u;
  const uint32_t bars = base + ring.stages * ring.stage_bytes + kSlackBytes;
  auto full = [&](uint32_t s) { return bars + 8u * s; };
  auto empty = [&](uint32_t s) { return bars + 8u * (kMaxStages + s); };

  if (threadIdx.x == 0) {
    for (int s = 0; s < ring.stages; ++s) {
      ptx::mbar_init(full(s), 1);
      ptx::mbar_init(empty(s), kConsumers);
    }
    ptx::fence_barrier_init();
  }
  __syncthreads();

  const int m_blocks = (m + kBM - 1) / kBM, n_blocks = (n + kBN - 1) / kBN;
  const int tiles = m_blocks * n_blocks, k_iters = (k + kBK - 1) / kBK;
  const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;
  const uint32_t b_off = kSubs * ring.a_bytes;

  if (wg == 0) {
    if constexpr (kConsumers == 2) ptx::setmaxnreg_dec<24>();
    if (tid != 0) return;
    int s = 0;
    uint32_t phase = 0;
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
      int mb, nb;
      gemm_tile_coords(tile, m_blocks, n_blocks, mb, nb);
      for (int kb = 0; kb < k_iters; kb += kSubs) {
        ptx::mbar_wait(empty(s), phase ^ 1u);  // first pass: the slot starts free
        ptx::mbar_arrive_expect_tx(full(s), ring.stage_bytes);
        const uint32_t st = base + s * ring.stage_bytes;
        for (int j = 0; j < kSubs; ++j) {
          ptx::tma_load_2d(st + j * ring.a_bytes, &map_a, full(s), (kb + j) * kBK, mb * kBM);
          ptx::tma_load_2d(st + b_off + j * ring.b_bytes, &map_b, full(s), (kb + j) * kBK, nb * kBN);
        }
        if (++s == ring.stages) s = 0, phase ^= 1u;
      }
    }
    return;
  }

  if constexpr (kConsumers == 2) ptx::setmaxnreg_inc<240>();  // one warpgroup fits as compiled
  const int c = wg - 1;
  float acc[kBN / 2];
  int s = 0;
  uint32_t phase = 0;
  for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    int mb, nb;
    gemm_tile_coords(tile, m_blocks, n_blocks, mb, nb);
#pragma unroll
    for (int i = 0; i < kBN / 2; ++i) acc[i] = 0.f;
    int held = -1;  // the stage whose products may still be in flight
    for (int kb = 0; kb < k_iters; kb += kSubs) {
      ptx::mbar_wait(full(s), phase);
      const uint32_t st = base + s * ring.stage_bytes;
      ptx::wgmma_fence();
#pragma unroll
      for (int j = 0; j < kSubs; ++j) {
        const uint32_t a = st + j * ring.a_bytes + c * (64 * kRowBytes);
        const uint32_t b = st + b_off + j * ring.b_bytes;
#pragma unroll
        for (int kk = 0; kk < kBK / 16; ++kk) {
          ptx::wgmma_gemm<kBN, kHalf>(acc, ptx::smem_desc_sw128(a + 32 * kk),
                                      ptx::smem_desc_sw128(b + 32 * kk));
        }
      }
      ptx::wgmma_commit();
      ptx::wgmma_wait<1>();  // the previous stage's products are done: free its slot
      if (held >= 0 && tid == 0) ptx::mbar_arrive(empty(held));
      held = s;
      if (++s == ring.stages) s = 0, phase ^= 1u;
    }
    ptx::wgmma_wait<0>();
    if (held >= 0 && tid == 0) ptx::mbar_arrive(empty(held));
#pragma unroll
    for (int i = 0; i < kBN / 2; ++i) ptx::reg_fence(acc[i]);
    epi(acc, mb * kBM + c * 64, nb * kBN, m, n);
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
    if (two && pairs) {
      rl_engine::cuda::store_pair(p, v0, v1);
    } else {
      p[0] = from_float<Out>(v0);
      if (two) p[1] = from_float<Out>(v1);
    }
  }

  template <int kA>
  __device__ __forceinline__ void operator()(const float (&acc)[kA], int row0, int col0, int m,
                                             int n) const {
    const int t = threadIdx.x % 128;
    const int r = row0 + (t / 32) * 16 + (t % 32) / 4, cq = col0 + (t % 4) * 2;
#pragma unroll
    for (int j = 0; j < kA / 4; ++j) {
      store_pair(r, cq + 8 * j, acc[4 * j], acc[4 * j + 1], m, n);
      store_pair(r + 8, cq + 8 * j, acc[4 * j + 2], acc[4 * j + 3], m, n);
    }
  }
};

// Host side. Operands: A [m, k] and B [n, k] with leading dimensions lda, ldb (elements).
struct GemmOperands {
  const void* a;
  int64_t lda;
  const void* b;
  int64_t ldb;
  int m, n, k;
  DType dtype;  // kBF16 or kF16 for the wgmma path, kF32 for the plain path
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

// Output tile of the sm_90a kernel: 64 * consumers rows by bn columns.
struct GemmTile {
  int consumers, bn;
};

inline GemmRing gemm_ring(GemmTile t, int m);

// The one tile choice of det_gemm (forward and both backward products). It may look at M, N and the
// SM count because the tile never changes a row's bits (see the top of this file); K is not looked
// at. Above M = 64: 128-row tiles, the widest of 256, 128, 64, 32 columns whose tiles keep at least
// 80% of the SMs busy in every wave of the persistent grid. Up to M = 64 (decode), 64-row tiles, and
// the time is the longest of three, estimated per K element for each width: a row's chain of
// dependent k16 steps, waves of resident CTAs x (48 + bn / 2) cycles / 16 (narrow steps are shorter;
// resident CTAs run their chains side by side); moving A and B from L2, tiles per SM x (A rows + bn)
// x 2 bytes at 64 bytes per cycle; and B from memory, N x 2 bytes over the busy SMs at 32 bytes per
// cycle each. The cheapest wins, the wider on a tie.
inline GemmTile choose_gemm_tile(int m, int n, int num_sms) {
  static constexpr int kOne[] = {64, 32, 16, 8}, kTwo[] = {256, 128, 64, 32};
  if (m > 64) {
    const int64_t m_blocks = (m + 127) / 128;
    for (int bn : kTwo) {
      const int64_t tiles = m_blocks * ((n + bn - 1) / bn), waves = (tiles + num_sms - 1) / num_sms;
      if (10 * tiles >= 8 * waves * num_sms) return {2, bn};
    }
    return {2, kTwo[3]};
  }
  GemmTile best{1, kOne[0]};
  double best_cost = 1e30;
  for (int bn : kOne) {
    const GemmTile t{1, bn};
    const GemmRing r = gemm_ring(t, m);
    const int64_t tiles = (n + bn - 1) / bn, slots = static_cast<int64_t>(r.occupancy) * num_sms;
    const double chain = static_cast<double>((tiles + slots - 1) / slots) * (48 + bn / 2) / 16;
    const double l2 = static_cast<double>((tiles + num_sms - 1) / num_sms) * (r.a_rows + bn) * 2 / 64;
    const double hbm = 2.0 * n / (32.0 * (tiles < num_sms ? tiles : num_sms));
    const double cost = chain > l2 ? (chain > hbm ? chain : hbm) : (l2 > hbm ? l2 : hbm);
    if (cost < best_cost) best_cost = cost, best = t;
  }
  return best;
}

// Shared memory for the stages of one CTA when `occupancy` CTAs share an SM.
inline int gemm_ring_bytes(int occupancy) {
  return gemm_cfg::kSmPerSmem / occupancy - 1024 - gemm_cfg::kOverhead;
}

// The ring for a tile: A's box holds only the rows that exist (M rounded up to 8) when M is below
// the tile height; gemm_subs K blocks a stage; as many stages as fit.
inline GemmRing gemm_ring(GemmTile t, int m) {
  using namespace gemm_cfg;
  GemmRing r{};
  const int bm = 64 * t.consumers;
  r.a_rows = m >= bm ? bm : (m + 7) / 8 * 8;
  r.a_bytes = static_cast<uint32_t>(r.a_rows * kRowBytes);
  r.b_bytes = static_cast<uint32_t>(t.bn * kRowBytes);
  r.stage_bytes = gemm_subs(t.bn) * (r.a_bytes + r.b_bytes);
  // The most resident CTAs that still leave each a ring of 4 stages (one where nothing else fits).
  for (r.occupancy = gemm_cfg::gemm_max_occupancy(t.consumers, t.bn);; r.occupancy /= 2) {
    const int fit = static_cast<int>(gemm_ring_bytes(r.occupancy) / r.stage_bytes);
    r.stages = fit < kMaxStages ? fit : kMaxStages;
    if (r.stages >= 4 || r.occupancy == 1) break;
  }
  return r;
}

template <int kConsumers, int kBN, typename Epi>
cudaError_t launch_det_gemm_tile(const GemmOperands& op, const Epi& epi, int num_sms,
                                 cudaStream_t stream) {
  using namespace gemm_cfg;
  constexpr int kBM = 64 * kConsumers;
  if (op.m <= 0 || op.n <= 0) return cudaSuccess;
  const GemmRing ring = gemm_ring({kConsumers, kBN}, op.m);
  CUtensorMap map_a, map_b;
  cudaError_t e = encode_tma_2d(&map_a, op.a, op.dtype, op.m, op.k, op.lda, ring.a_rows);
  if (e == cudaSuccess) e = encode_tma_2d(&map_b, op.b, op.dtype, op.n, op.k, op.ldb, kBN);
  if (e != cudaSuccess) return e;
  auto kernel = op.dtype == DType::kF16 ? rlk_det_gemm_sm90_kernel<kConsumers, kBN, true, Epi>
                                        : rlk_det_gemm_sm90_kernel<kConsumers, kBN, false, Epi>;
  const int smem = ring.stages * static_cast<int>(ring.stage_bytes) + kOverhead;
  e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e != cudaSuccess) return e;
  const int tiles = ((op.m + kBM - 1) / kBM) * ((op.n + kBN - 1) / kBN);
  const int grid = tiles < ring.occupancy * num_sms ? tiles : ring.occupancy * num_sms;
  kernel<<<grid, 128 * (1 + kConsumers), smem, stream>>>(map_a, map_b, op.m, op.n, op.k, ring, epi);
  return cudaGetLastError();
}

template <typename Epi, typename = void>
struct AnyWidth : std::false_type {};
template <typename Epi>
struct AnyWidth<Epi, std::void_t<decltype(Epi::kAnyWidth)>> : std::bool_constant<Epi::kAnyWidth> {};

// det_gemm on the tile choose_gemm_tile picks; an epilogue written for the 64 x 256 fragment alone
// (linear_logp's) always gets the 128 x 256 tile.
template <typename Epi>
cudaError_t launch_det_gemm_sm90(const GemmOperands& op, const Epi& epi, int num_sms,
                                 cudaStream_t stream) {
  if constexpr (!AnyWidth<Epi>::value) {
    return launch_det_gemm_tile<2, 256>(op, epi, num_sms, stream);
  } else {
    const GemmTile t = choose_gemm_tile(op.m, op.n, num_sms);
    if (t.consumers == 1) {
      switch (t.bn) {
        case 64: return launch_det_gemm_tile<1, 64>(op, epi, num_sms, stream);
        case 32: return launch_det_gemm_tile<1, 32>(op, epi, num_sms, stream);
        case 16: return launch_det_gemm_tile<1, 16>(op, epi, num_sms, stream);
        default: return launch_det_gemm_tile<1, 8>(op, epi, num_sms, stream);
      }
    }
    switch (t.bn) {
      case 256: return launch_det_gemm_tile<2, 256>(op, epi, num_sms, stream);
      case 128: return launch_det_gemm_tile<2, 128>(op, epi, num_sms, stream);
      case 64: return launch_det_gemm_tile<2, 64>(op, epi, num_sms, stream);
      default: return launch_det_gemm_tile<2, 32>(op, epi, num_sms, stream);
    }
  }
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
