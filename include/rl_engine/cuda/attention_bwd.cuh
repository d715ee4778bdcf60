// Backward of the Hopper attention (see attention.cuh): three kernels, no atomics.
//   delta[r, h] = dO . O in fp32 (one warp per row and head, a fixed butterfly);
//   dq: one warp per 16 query rows walks key tiles in position order; each dq element is one
//       chain of m16n8k16 accumulations over keys 16 at a time from key 0, so it does not depend
//       on the tile size or on the rows that share the CTA;
//   dk/dv: one warp per 16 key rows walks the query rows of its sequence chunk by chunk (a chunk
//       is the rows with position // q_chunk_size == c). A chunk's fp32 partial is accumulated
//       over 32-row steps anchored at the chunk's first row (heads of the kv group inside each
//       step, in head order) and added to dk/dv in chunk order (dk += scale * part), so a call
//       holding only some whole chunks computes the same partials as a call holding all of them.
#pragma once

#include "rl_engine/cuda/attention.cuh"

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

constexpr int kBwdWarps = 4;
static_assert(kDqRows == 16 * kBwdWarps && kDkvKeys == 16 * kBwdWarps, "one warp per 16 rows");
constexpr int kStepRows = 32;            // query rows per dk/dv step

template <int D>
constexpr int dq_keys() {
  return D >= 128 ? 32 : 64;
}
template <int D>
constexpr int dq_smem_bytes() {
  const int qdo = 2 * kDqRows * kStride<D> * 2, kv = 2 * 2 * dq_keys<D>() * kStride<D> * 2;
  return qdo > kv ? qdo : kv;
}

// dq of 64 query rows of one head; tiles run last-first. grid.x = tiles_upper_bound * hq.
template <typename T, int D>
__global__ void __launch_bounds__(kBwdWarps * 32) rlk_attention_bwd_dq_kernel(BwdParams p) {
  constexpr int BN = dq_keys<D>(), kTile = BN * kStride<D> * 2;
  extern __shared__ __align__(128) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int h = blockIdx.x % p.hq, rev = blockIdx.x / p.hq;
  const int total = count_tiles(p.cu_q, p.batch, kDqRows);
  int b, tile;
  if (rev >= total || !find_tile(p.cu_q, p.batch, kDqRows, total - 1 - rev, b, tile)) return;
  const int row0 = p.cu_q[b] + tile * kDqRows, nrows = min(kDqRows, p.cu_q[b + 1] - row0);
  const int kbase = p.cu_k[b], klen = p.cu_k[b + 1] - kbase, g = h / (p.hq / p.hkv);
  const T* q = static_cast<const T*>(p.q);
  const T* dout = static_cast<const T*>(p.dout);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);

  int pos[2];
  bool valid[2];
  float lse2[2], delta[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = warp * 16 + (lane >> 2) + 8 * r;
    valid[r] = row < nrows;
    const int64_t i = (int64_t)(row0 + row) * p.hq + h;
    pos[r] = valid[r] ? static_cast<int>(p.pos[row0 + row]) : 0;
    lse2[r] = valid[r] ? __fmul_rn(p.lse[i], kLog2e) : 0.f;
    delta[r] = valid[r] ? p.delta[i] : 0.f;
  }
  __shared__ int warp_last[kBwdWarps];
  const int wl = min(__reduce_max_sync(0xffffffffu, max(pos[0], pos[1])), klen - 1);
  if (lane == 0) warp_last[warp] = wl;

  const uint32_t base = smem_u32(smem), dbase = base + kDqRows * kStride<D> * 2;
  auto qrow = [&](const T* t) {
    return [=](int r) { return r < nrows ? t + ((int64_t)(row0 + r) * p.hq + h) * D : nullptr; };
  };
  load_tile<D>(base, kDqRows, qrow(q), q, tid, kBwdWarps * 32);
  load_tile<D>(dbase, kDqRows, qrow(dout), dout, tid, kBwdWarps * 32);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  uint32_t qf[D / 16][4], df[D / 16][4];
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    load_a<D>(qf[kk], base, warp * 16, kk * 16, lane);
    load_a<D>(df[kk], dbase, warp * 16, kk * 16, lane);
  }
  int last = -1;
#pragma unroll
  for (int w = 0; w < kBwdWarps; ++w) last = max(last, warp_last[w]);
  __syncthreads();

  float acc[D / 8][4];
#pragma unroll
  for (int d = 0; d < D / 8; ++d) acc[d][0] = acc[d][1] = acc[d][2] = acc[d][3] = 0.f;
  const int nblocks = last < 0 ? 0 : last / BN + 1;
  auto load = [&](int j, uint32_t kt, uint32_t vt) {
    auto row = [&](const T* t) {
      return [=](int r) {
        const int key = j * BN + r;
        return key < klen ? t + ((int64_t)(kbase + key) * p.hkv + g) * D : nullptr;
      };
    };
    load_tile<D>(kt, BN, row(k), k, tid, kBwdWarps * 32);
    load_tile<D>(vt, BN, row(v), v, tid, kBwdWarps * 32);
  };
  if (nblocks > 0) load(0, base, base + kTile);
  cp_async_commit();
  for (int j = 0; j < nblocks; ++j) {
    cp_async_wait<0>();
    __syncthreads();
    const int s = j & 1;
    if (j + 1 < nblocks) load(j + 1, base + (2 * (s ^ 1)) * kTile, base + (2 * (s ^ 1) + 1) * kTile);
    cp_async_commit();
    if (j * BN > wl) continue;
    const uint32_t ks = base + 2 * s * kTile, vs = ks + kTile;
    float sc[BN / 8][4], dp[BN / 8][4];
#pragma unroll
    for (int n = 0; n < BN / 8; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) sc[n][i] = dp[n][i] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
      for (int n = 0; n < BN / 8; n += 2) {
        uint32_t bk[4], bv[4];
        load_b<D>(bk, ks, n * 8, kk * 16, lane);
        load_b<D>(bv, vs, n * 8, kk * 16, lane);
        mma<T>(sc[n], qf[kk], bk[0], bk[1]);
        mma<T>(sc[n + 1], qf[kk], bk[2], bk[3]);
        mma<T>(dp[n], df[kk], bv[0], bv[1]);
        mma<T>(dp[n + 1], df[kk], bv[2], bv[3]);
      }
    }
#pragma unroll
    for (int n = 0; n < BN / 8; ++n) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int key = j * BN + n * 8 + 2 * (lane & 3) + (i & 1), r = i >> 1;
        const bool vis = key <= pos[r] && key < klen;
        const float pr = ex2(__fmaf_rn(sc[n][i], p.scale_log2, -lse2[r]));
        sc[n][i] = vis ? __fmul_rn(pr, __fsub_rn(dp[n][i], delta[r])) : 0.f;
      }
    }
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      uint32_t a[4];
      c_to_a<T>(a, sc, kk);
#pragma unroll
      for (int d = 0; d < D / 8; d += 2) {
        uint32_t bk[4];
        load_b_t<D>(bk, ks, kk * 16, d * 8, lane);
        mma<T>(acc[d], a, bk[0], bk[1]);
        mma<T>(acc[d + 1], a, bk[2], bk[3]);
      }
    }
  }
  T* dq = static_cast<T*>(p.dq);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (!valid[r]) continue;
    T* o = dq + ((int64_t)(row0 + warp * 16 + (lane >> 2) + 8 * r) * p.hq + h) * D;
#pragma unroll
    for (int d = 0; d < D / 8; ++d) {
      *reinterpret_cast<uint32_t*>(o + d * 8 + 2 * (lane & 3)) =
          pack2<T>(__fmul_rn(acc[d][2 * r], p.scale), __fmul_rn(acc[d][2 * r + 1], p.scale));
    }
  }
}

// One step of the dk/dv walk: rows [r, r + n) of head h, in stage smem.
struct Step {
  int r, n, h, chunk_end;
};

template <int D>
constexpr int dkv_stage_bytes() {
  return 2 * kStepRows * kStride<D> * 2 + kStepRows * (4 + 4 + 8);
}
template <int D>
constexpr int dkv_smem_bytes() {
  return 2 * kDkvKeys * kStride<D> * 2 + 2 * dkv_stage_bytes<D>();
}

// First row in [lo, hi) whose position is >= value (positions increase within a sequence).
__device__ __forceinline__ int lower_bound_pos(const int64_t* pos, int lo, int hi, int64_t value) {
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (pos[mid] < value) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

// dk/dv of 64 key rows of one kv head. grid.x = key_tiles_upper_bound * hkv; tiles run
// first-first (the first keys of a sequence are seen by the most queries).
template <typename T, int D>
__global__ void __launch_bounds__(kBwdWarps * 32) rlk_attention_bwd_dkdv_kernel(BwdParams p) {
  constexpr int kTile = kDkvKeys * kStride<D> * 2, kStage = dkv_stage_bytes<D>();
  constexpr int kQdo = kStepRows * kStride<D> * 2;
  extern __shared__ __align__(128) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = blockIdx.x % p.hkv;
  int b, tile;
  if (!find_tile(p.cu_k, p.batch, kDkvKeys, blockIdx.x / p.hkv, b, tile)) return;
  const int kbase = p.cu_k[b], klen = p.cu_k[b + 1] - kbase, kstart = tile * kDkvKeys;
  const int qbeg = p.cu_q[b], qend = p.cu_q[b + 1], group = p.hq / p.hkv;
  const T* q = static_cast<const T*>(p.q);
  const T* dout = static_cast<const T*>(p.dout);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);

  const uint32_t base = smem_u32(smem), ks = base, vs = base + kTile;
  auto krow = [&](const T* t) {
    return [=](int r) {
      const int key = kstart + r;
      return key < klen ? t + ((int64_t)(kbase + key) * p.hkv + g) * D : nullptr;
    };
  };
  load_tile<D>(ks, kDkvKeys, krow(k), k, tid, kBwdWarps * 32);
  load_tile<D>(vs, kDkvKeys, krow(v), v, tid, kBwdWarps * 32);
  cp_async_commit();

  // Stage layout: q [32][D+8], dout [32][D+8], lse[32], delta[32], pos[32] (int64).
  auto stage_ptr = [&](int s) { return smem + 2 * kTile + s * kStage; };
  auto load_step = [&](const Step& st, int s) {
    const uint32_t sb = smem_u32(stage_ptr(s));
    const int hh = g * group + st.h;
    auto row = [&](const T* t) {
      return [=](int r) { return r < st.n ? t + ((int64_t)(st.r + r) * p.hq + hh) * D : nullptr; };
    };
    load_tile<D>(sb, kStepRows, row(q), q, tid, kBwdWarps * 32);
    load_tile<D>(sb + kQdo, kStepRows, row(dout), dout, tid, kBwdWarps * 32);
    if (tid < kStepRows) {
      const bool ok = tid < st.n;
      const int64_t i = (int64_t)(st.r + (ok ? tid : 0)) * p.hq + hh;
      cp_async4or8<4>(sb + 2 * kQdo + tid * 4, p.lse + i, ok);
      cp_async4or8<4>(sb + 2 * kQdo + kStepRows * 4 + tid * 4, p.delta + i, ok);
      cp_async4or8<8>(sb + 2 * kQdo + kStepRows * 8 + tid * 8, p.pos + st.r + (ok ? tid : 0), ok);
    }
  };
  auto chunk_end = [&](int r) {
    return lower_bound_pos(p.pos, r, qend, (p.pos[r] / p.q_chunk + 1) * p.q_chunk);
  };
  auto advance = [&](const Step& st) {
    Step nx = st;
    if (st.h + 1 < group) {
      nx.h = st.h + 1;
      return nx;
    }
    nx.h = 0;
    nx.r = st.r + kStepRows;
    if (nx.r >= st.chunk_end) {
      nx.r = st.chunk_end;
      nx.chunk_end = nx.r < qend ? chunk_end(nx.r) : qend;
    }
    nx.n = min(kStepRows, nx.chunk_end - nx.r);
    return nx;
  };

  float pk[D / 8][4], pv[D / 8][4];
#pragma unroll
  for (int d = 0; d < D / 8; ++d)
#pragma unroll
    for (int i = 0; i < 4; ++i) pk[d][i] = pv[d][i] = 0.f;
  bool first_flush = true;
  const int wkey = warp * 16;  // this warp's first key row in the tile
  float* dk = p.dk + ((int64_t)kbase * p.hkv + g) * D;
  float* dv = p.dv + ((int64_t)kbase * p.hkv + g) * D;
  auto flush = [&](bool store_zero) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int key = kstart + wkey + (lane >> 2) + 8 * r;
      if (key >= klen) continue;
      float* kr = dk + (int64_t)key * p.hkv * D;
      float* vr = dv + (int64_t)key * p.hkv * D;
#pragma unroll
      for (int d = 0; d < D / 8; ++d) {
        const int c = d * 8 + 2 * (lane & 3);
        float2 nk = make_float2(__fmul_rn(p.scale, pk[d][2 * r]), __fmul_rn(p.scale, pk[d][2 * r + 1]));
        float2 nv = make_float2(pv[d][2 * r], pv[d][2 * r + 1]);
        if (store_zero) nk = nv = make_float2(0.f, 0.f);
        if (!first_flush) {
          const float2 ok = *reinterpret_cast<float2*>(kr + c), ov = *reinterpret_cast<float2*>(vr + c);
          nk = make_float2(__fadd_rn(ok.x, nk.x), __fadd_rn(ok.y, nk.y));
          nv = make_float2(__fadd_rn(ov.x, nv.x), __fadd_rn(ov.y, nv.y));
        }
        *reinterpret_cast<float2*>(kr + c) = nk;
        *reinterpret_cast<float2*>(vr + c) = nv;
      }
    }
#pragma unroll
    for (int d = 0; d < D / 8; ++d)
#pragma unroll
      for (int i = 0; i < 4; ++i) pk[d][i] = pv[d][i] = 0.f;
    first_flush = false;
  };

  // The first chunk that can see this key tile; rows of earlier chunks see none of its keys.
  Step cur;
  cur.r = kstart < klen ? lower_bound_pos(p.pos, qbeg, qend, (int64_t)(kstart / p.q_chunk) * p.q_chunk) : qend;
  cur.h = 0;
  cur.chunk_end = cur.r < qend ? chunk_end(cur.r) : qend;
  cur.n = min(kStepRows, cur.chunk_end - cur.r);
  bool has = cur.r < qend;
  if (has) load_step(cur, 0);
  cp_async_commit();
  int s = 0;
  while (has) {
    const Step nx = advance(cur);
    const bool has_next = nx.r < qend;
    if (has_next) load_step(nx, s ^ 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const uint32_t qs = smem_u32(stage_ptr(s)), ds = qs + kQdo;
    const float* lse_s = reinterpret_cast<const float*>(stage_ptr(s) + 2 * kQdo);
    const float* delta_s = lse_s + kStepRows;
    const int64_t* pos_s = reinterpret_cast<const int64_t*>(stage_ptr(s) + 2 * kQdo + kStepRows * 8);
    float sc[kStepRows / 8][4], dp[kStepRows / 8][4];
#pragma unroll
    for (int n = 0; n < kStepRows / 8; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) sc[n][i] = dp[n][i] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t ka[4], va[4];
      load_a<D>(ka, ks, wkey, kk * 16, lane);
      load_a<D>(va, vs, wkey, kk * 16, lane);
#pragma unroll
      for (int n = 0; n < kStepRows / 8; n += 2) {
        uint32_t bq[4], bd[4];
        load_b<D>(bq, qs, n * 8, kk * 16, lane);
        load_b<D>(bd, ds, n * 8, kk * 16, lane);
        mma<T>(sc[n], ka, bq[0], bq[1]);
        mma<T>(sc[n + 1], ka, bq[2], bq[3]);
        mma<T>(dp[n], va, bd[0], bd[1]);
        mma<T>(dp[n + 1], va, bd[2], bd[3]);
      }
    }
    // sc/dp hold S^T and dP^T: rows are keys, columns the step's query rows.
#pragma unroll
    for (int n = 0; n < kStepRows / 8; ++n) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int key = kstart + wkey + (lane >> 2) + 8 * (i >> 1);
        const int row = n * 8 + 2 * (lane & 3) + (i & 1);
        const bool vis = row < cur.n && key <= pos_s[row] && key < klen;
        const float pr = ex2(__fmaf_rn(sc[n][i], p.scale_log2, -__fmul_rn(lse_s[row], kLog2e)));
        sc[n][i] = vis ? pr : 0.f;
        dp[n][i] = vis ? __fmul_rn(pr, __fsub_rn(dp[n][i], delta_s[row])) : 0.f;
      }
    }
#pragma unroll
    for (int kk = 0; kk < kStepRows / 16; ++kk) {
      uint32_t ap[4], as[4];
      c_to_a<T>(ap, sc, kk);
      c_to_a<T>(as, dp, kk);
#pragma unroll
      for (int d = 0; d < D / 8; d += 2) {
        uint32_t bd[4], bq[4];
        load_b_t<D>(bd, ds, kk * 16, d * 8, lane);
        load_b_t<D>(bq, qs, kk * 16, d * 8, lane);
        mma<T>(pv[d], ap, bd[0], bd[1]);
        mma<T>(pv[d + 1], ap, bd[2], bd[3]);
        mma<T>(pk[d], as, bq[0], bq[1]);
        mma<T>(pk[d + 1], as, bq[2], bq[3]);
      }
    }
    if (cur.h + 1 == group && cur.r + kStepRows >= cur.chunk_end) flush(false);
    __syncthreads();  // stage s is reloaded next iteration
    cur = nx;
    has = has_next;
    s ^= 1;
  }
  cp_async_wait<0>();
  if (first_flush) flush(true);
}

template <typename T, int D>
cudaError_t launch_attention_bwd(const BwdParams& p, const T* out, float* delta, int64_t tq,
                                 int q_tiles, int k_tiles, cudaStream_t stream) {
  const int64_t rows = tq * p.hq;
  if (rows > 0) {
    rlk_attention_bwd_delta_kernel<T, D><<<(rows + 7) / 8, 256, 0, stream>>>(
        static_cast<const T*>(p.dout), out, delta, rows);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  auto dq = rlk_attention_bwd_dq_kernel<T, D>;
  if (cudaError_t e = set_smem(dq, dq_smem_bytes<D>()); e != cudaSuccess) return e;
  if (q_tiles > 0) {
    dq<<<q_tiles * p.hq, kBwdWarps * 32, dq_smem_bytes<D>(), stream>>>(p);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  auto dkv = rlk_attention_bwd_dkdv_kernel<T, D>;
  if (cudaError_t e = set_smem(dkv, dkv_smem_bytes<D>()); e != cudaSuccess) return e;
  if (k_tiles > 0) dkv<<<k_tiles * p.hkv, kBwdWarps * 32, dkv_smem_bytes<D>(), stream>>>(p);
  return cudaGetLastError();
}

}  // namespace rl_engine::cuda::attn
