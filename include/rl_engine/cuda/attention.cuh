// Deterministic causal attention on Hopper with mma.sync tensor-core tiles (bf16/fp16 in, fp32
// accumulate): prefill forward, paged decode and the backward. Framework-free: raw pointers, cudaError_t.
//
// Batch invariance rests on two facts. (1) Every output row is computed by one warp from its own
// query row with a fixed instruction sequence: the m16n8k16 products give each element from its
// row of A and column of B only, so the other rows sharing a tile (other queries, other heads,
// zero padding) never change a row's bits. (2) Keys are walked in blocks of BN anchored at
// position 0, and the per-block softmax update is one function (attention_block) shared by the
// prefill and decode kernels, with every rounding spelled out (__fmul_rn, ex2.approx) so that the
// compiler cannot contract it differently in the two kernels. A block that is fully masked for a
// row leaves that row's state unchanged bit for bit (alpha = 1, p = 0), so a warp that visits
// extra blocks for its other rows does not move this row's result.
#pragma once

#include "rl_engine/cuda/attention_params.h"
#include "rl_engine/cuda/attention_tiles.cuh"

namespace rl_engine::cuda::attn {

// ------------------------------------------------------------------------------------ forward
// Running state of one warp's 16 query rows: this thread holds rows lane/4 (index 0) and
// lane/4 + 8 (index 1), output columns 8 * dt + 2 * (lane % 4) + {0, 1}.
template <int D>
struct RowState {
  float o[D / 8][4];
  float m[2];  // running max of raw scores
  float l[2];  // this thread's partial of the softmax denominator
  __device__ __forceinline__ void init() {
#pragma unroll
    for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    m[0] = m[1] = -kInf;
    l[0] = l[1] = 0.f;
  }
};

// Folds the KV block starting at key `kstart` (tiles ks, vs of BN rows) into the state. A key is
// visible to a row at position pos when key <= pos and key < klen.
template <typename T, int D, int BN>
__device__ __forceinline__ void attention_block(RowState<D>& st, const uint32_t (&qf)[D / 16][4],
                                                uint32_t ks, uint32_t vs, int kstart,
                                                const int (&pos)[2], int klen, float scale_log2,
                                                int lane) {
  float s[BN / 8][4];
#pragma unroll
  for (int n = 0; n < BN / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
    for (int n = 0; n < BN / 8; n += 2) {
      uint32_t b[4];
      load_b<D>(b, ks, n * 8, kk * 16, lane);
      mma<T>(s[n], qf[kk], b[0], b[1]);
      mma<T>(s[n + 1], qf[kk], b[2], b[3]);
    }
  }
  float mx[2] = {-kInf, -kInf};
#pragma unroll
  for (int n = 0; n < BN / 8; ++n) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int key = kstart + n * 8 + 2 * (lane & 3) + (i & 1);
      const bool vis = key <= pos[i >> 1] && key < klen;
      s[n][i] = vis ? s[n][i] : -kInf;
      mx[i >> 1] = fmaxf(mx[i >> 1], s[n][i]);
    }
  }
  float alpha[2], ms[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    mx[r] = fmaxf(mx[r], shfl_xor(mx[r], 1));
    mx[r] = fmaxf(mx[r], shfl_xor(mx[r], 2));
    const float m_new = fmaxf(st.m[r], mx[r]);
    alpha[r] = m_new == st.m[r] ? 1.f : ex2(__fmul_rn(__fsub_rn(st.m[r], m_new), scale_log2));
    ms[r] = m_new == -kInf ? 0.f : __fmul_rn(m_new, scale_log2);
    st.m[r] = m_new;
    st.l[r] = __fmul_rn(st.l[r], alpha[r]);
  }
#pragma unroll
  for (int d = 0; d < D / 8; ++d) {
    st.o[d][0] = __fmul_rn(st.o[d][0], alpha[0]);
    st.o[d][1] = __fmul_rn(st.o[d][1], alpha[0]);
    st.o[d][2] = __fmul_rn(st.o[d][2], alpha[1]);
    st.o[d][3] = __fmul_rn(st.o[d][3], alpha[1]);
  }
#pragma unroll
  for (int n = 0; n < BN / 8; ++n) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float p = ex2(__fmaf_rn(s[n][i], scale_log2, -ms[i >> 1]));
      s[n][i] = p;
      st.l[i >> 1] = __fadd_rn(st.l[i >> 1], p);
    }
  }
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk) {
    uint32_t a[4];
    c_to_a<T>(a, s, kk);
#pragma unroll
    for (int d = 0; d < D / 8; d += 2) {
      uint32_t b[4];
      load_b_t<D>(b, vs, kk * 16, d * 8, lane);
      mma<T>(st.o[d], a, b[0], b[1]);
      mma<T>(st.o[d + 1], a, b[2], b[3]);
    }
  }
}

// out = o / l (one rounding to T), lse = m * scale + ln(l). Rows r with valid[r] false are not
// stored. out_row(r) gives the T* of row r's D outputs; lse_at(r) its float*.
template <typename T, int D, typename OutRow, typename LseAt>
__device__ __forceinline__ void store_rows(RowState<D>& st, float scale, const bool (&valid)[2],
                                           OutRow&& out_row, LseAt&& lse_at, int lane) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = st.l[r];
    l = __fadd_rn(l, shfl_xor(l, 1));
    l = __fadd_rn(l, shfl_xor(l, 2));
    const float inv = __frcp_rn(l);
    if (!valid[r]) continue;
    T* out = out_row(r);
#pragma unroll
    for (int d = 0; d < D / 8; ++d) {
      const int c = d * 8 + 2 * (lane & 3);
      *reinterpret_cast<uint32_t*>(out + c) =
          pack2<T>(__fmul_rn(st.o[d][2 * r], inv), __fmul_rn(st.o[d][2 * r + 1], inv));
    }
    if ((lane & 3) == 0) *lse_at(r) = __fadd_rn(__fmul_rn(st.m[r], scale), __logf(l));
  }
}

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

// The KV walk shared by prefill and decode: blocks 0..nblocks-1 through a `kStages`-deep cp.async
// ring; load(j, k_tile, v_tile) issues block j's copies; warps with `active` false only copy.
template <typename T, int D, int BN, int kStages, typename Load>
__device__ __forceinline__ void kv_walk(RowState<D>& st, const uint32_t (&qf)[D / 16][4],
                                        unsigned char* smem, int nblocks, int warp_last_key,
                                        bool active, const int (&pos)[2], int klen,
                                        float scale_log2, int lane, Load&& load) {
  constexpr int kTile = BN * kStride<D> * 2;
  const uint32_t base = smem_u32(smem);
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < nblocks) load(s, base + (2 * s) * kTile, base + (2 * s + 1) * kTile);
    cp_async_commit();
  }
  for (int j = 0; j < nblocks; ++j) {
    cp_async_wait<kStages - 2>();
    __syncthreads();
    const int nj = j + kStages - 1;
    if (nj < nblocks) {
      const int s = nj % kStages;
      load(nj, base + (2 * s) * kTile, base + (2 * s + 1) * kTile);
    }
    cp_async_commit();
    const int s = j % kStages;
    if (active && j * BN <= warp_last_key) {
      attention_block<T, D, BN>(st, qf, base + (2 * s) * kTile, base + (2 * s + 1) * kTile, j * BN,
                                pos, klen, scale_log2, lane);
    }
  }
}

constexpr int kFwdWarps = 8;
static_assert(kFwdRows == 16 * kFwdWarps, "one warp per 16 query rows");

template <int D, int BN>
constexpr int fwd_smem_bytes() {
  const int q = kFwdRows * kStride<D> * 2, kv = 2 * 2 * BN * kStride<D> * 2;
  return q > kv ? q : kv;
}

// Prefill: one CTA per (128-row query tile of a sequence, q head); tiles run last-first so the
// longest causal walks start early. grid.x = tiles_upper_bound * hq.
template <typename T, int D, int BN>
__global__ void __launch_bounds__(kFwdWarps * 32, 1) rlk_attention_fwd_kernel(FwdParams p) {
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

  int pos[2];
  bool valid[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = warp * 16 + (lane >> 2) + 8 * r;
    valid[r] = row < nrows;
    pos[r] = valid[r] ? static_cast<int>(p.pos[row0 + row]) : 0;
  }
  __shared__ int warp_last[kFwdWarps];
  const int wl = min(__reduce_max_sync(0xffffffffu, max(pos[0], pos[1])), klen - 1);
  if (lane == 0) warp_last[warp] = wl;

  const uint32_t base = smem_u32(smem);
  load_tile<D>(base, kFwdRows, [&](int r) { return r < nrows ? q + ((int64_t)(row0 + r) * p.hq + h) * D : nullptr; },
               q, tid, kFwdWarps * 32);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  uint32_t qf[D / 16][4];
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) load_a<D>(qf[kk], base, warp * 16, kk * 16, lane);
  int last = -1;
#pragma unroll
  for (int w = 0; w < kFwdWarps; ++w) last = max(last, warp_last[w]);
  __syncthreads();  // the Q tile's smem becomes the KV ring

  RowState<D> st;
  st.init();
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
  kv_walk<T, D, BN, 2>(st, qf, smem, nblocks, wl, true, pos, klen, p.scale_log2, lane, load);

  T* out = static_cast<T*>(p.out);
  store_rows<T, D>(
      st, p.scale, valid,
      [&](int r) { return out + ((int64_t)(row0 + warp * 16 + (lane >> 2) + 8 * r) * p.hq + h) * D; },
      [&](int r) { return p.lse + (int64_t)(row0 + warp * 16 + (lane >> 2) + 8 * r) * p.hq + h; },
      lane);
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

// Decode: one CTA per (sequence, kv head); the rows of the tile are the kv head's query heads,
// all at position seq_lens[b] - 1. Same block walk and block update as the prefill.
template <typename T, int D, int BN>
__global__ void __launch_bounds__(kDecWarps * 32) rlk_attention_decode_kernel(DecodeParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int b = blockIdx.x / p.hkv, g = blockIdx.x % p.hkv, group = p.hq / p.hkv;
  const int len = min(p.seq_lens[b], p.max_pages * p.page_size);
  const T* q = static_cast<const T*>(p.q);
  const T* kc = static_cast<const T*>(p.k_cache);
  const T* vc = static_cast<const T*>(p.v_cache);
  const int32_t* pages = p.block_table + (int64_t)b * p.max_pages;

  const uint32_t base = smem_u32(smem);
  const int rows = ((group + 15) / 16) * 16;
  load_tile<D>(base, rows, [&](int r) { return r < group ? q + ((int64_t)b * p.hq + g * group + r) * D : nullptr; },
               q, tid, kDecWarps * 32);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  const bool active = warp * 16 < group;
  uint32_t qf[D / 16][4];
  if (active) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) load_a<D>(qf[kk], base, warp * 16, kk * 16, lane);
  }
  __syncthreads();

  const int t = len - 1;
  const int pos[2] = {t, t};
  RowState<D> st;
  st.init();
  const int nblocks = t < 0 ? 0 : t / BN + 1;
  // The pages of the keys this thread copies are looked up once per block for K and V together,
  // as independent loads issued back to back (not one dependent lookup per 16-byte copy).
  auto load = [&](int j, uint32_t kt, uint32_t vt) {
    constexpr int kChunks = D / 8, kRowsPerPass = kDecWarps * 32 / kChunks;
    static_assert((kDecWarps * 32) % kChunks == 0 && BN % kRowsPerPass == 0, "copy layout");
    constexpr int kPasses = BN / kRowsPerPass;
    const int c = tid % kChunks, r0 = tid / kChunks;
    int64_t off[kPasses];
#pragma unroll
    for (int m = 0; m < kPasses; ++m) {
      const int key = j * BN + r0 + m * kRowsPerPass;
      const int page = key < len ? pages[key / p.page_size] : -1;
      off[m] = page >= 0 && page < p.num_pages
                   ? (((int64_t)page * p.page_size + key % p.page_size) * p.hkv + g) * D + c * 8
                   : -1;
    }
#pragma unroll
    for (int m = 0; m < kPasses; ++m) {
      const uint32_t dst = ((r0 + m * kRowsPerPass) * kStride<D> + c * 8) * 2;
      cp_async16(kt + dst, off[m] >= 0 ? kc + off[m] : kc, off[m] >= 0);
      cp_async16(vt + dst, off[m] >= 0 ? vc + off[m] : vc, off[m] >= 0);
    }
  };
  kv_walk<T, D, BN, decode_stages<BN>()>(st, qf, smem, nblocks, t, active, pos, len, p.scale_log2,
                                         lane, load);
  if (!active) return;
  bool valid[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) valid[r] = warp * 16 + (lane >> 2) + 8 * r < group;
  T* out = static_cast<T*>(p.out);
  store_rows<T, D>(
      st, p.scale, valid,
      [&](int r) { return out + ((int64_t)b * p.hq + g * group + warp * 16 + (lane >> 2) + 8 * r) * D; },
      [&](int r) { return p.lse + (int64_t)b * p.hq + g * group + warp * 16 + (lane >> 2) + 8 * r; },
      lane);
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

template <typename T, int D, int BN>
cudaError_t launch_attention_decode(const DecodeParams& p, int batch, cudaStream_t stream) {
  auto kernel = rlk_attention_decode_kernel<T, D, BN>;
  constexpr int smem = decode_smem_bytes<D, BN>();
  if (cudaError_t e = set_smem(kernel, smem); e != cudaSuccess) return e;
  kernel<<<batch * p.hkv, kDecWarps * 32, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace rl_engine::cuda::attn

#include "rl_engine/cuda/attention_bwd.cuh"
