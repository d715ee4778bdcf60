// dk/dv of the Hopper attention backward on wgmma and bulk tensor copies (sm_90a).
//
// One CTA per 128 keys of one kv head, warpgroup c owning keys 64c .. 64c + 63. The CTA walks the
// query rows of its sequence chunk by chunk (a chunk is the rows with position // q_chunk_size ==
// c), each chunk in 64-row steps anchored at the chunk's first row, the heads of the kv group
// inside each step in head order, H of them at a time (H = 2 at head_dim 64 where the group's size
// is even, else 1): a step's columns are 64 rows of head h, then the same rows of head h + 1. Per
// step, with the keys as the m64 rows: S^T = K Q^T, dP^T = V dO^T over the step's 64 * H columns,
// then dV += P^T dO and dK += dS^T Q, 16 columns per k16 step in column order, which is the order
// of one head a step: H only groups the k16 products, so it never shows in the bits
// (benchmarks/kernel_ab.sh compares them with a build of one head a step). A
// chunk's fp32 partial is added to dk/dv in chunk order (dk += scale * part) by the one thread that
// owns each element, so a call holding only some whole chunks computes the same partials as a call
// holding all of them: the context-parallel split gives the bits of one call. The first warp also
// copies the steps a few ahead into a ring.
#pragma once

#include "rl_engine/cuda/attention_wgmma.cuh"

namespace rl_engine::cuda::attn {

constexpr int kDkvStepRows = 64;

// One step of the walk: rows [r, r + n) of heads h .. h + H - 1 of the group; chunk_end ends r's
// chunk.
struct Step {
  int r, n, h, chunk_end;
};

// First row in [lo, hi) whose position is >= value (positions increase within a sequence).
__device__ __forceinline__ int lower_bound_pos(const int64_t* pos, int lo, int hi, int64_t value) {
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (pos[mid] < value) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

// The sequence of steps of one key tile (the producer walks it and hands each Step on in its
// stage), H heads a step. ends[r] is the row after row r's chunk.
template <int H>
struct StepWalk {
  const int32_t* ends;
  int qend, group;
  // The first step that can see keys from kstart on (rows of earlier chunks see none of them).
  __device__ __forceinline__ Step first(const int64_t* pos, int qbeg, int kstart, int q_chunk,
                                        bool any_key) const {
    Step st;
    st.r = any_key ? lower_bound_pos(pos, qbeg, qend, (int64_t)(kstart / q_chunk) * q_chunk) : qend;
    st.h = 0;
    st.chunk_end = st.r < qend ? ends[st.r] : qend;
    st.n = min(kDkvStepRows, st.chunk_end - st.r);
    return st;
  }
  // The end of the chunk after st's (read when st's chunk begins, used when it ends).
  __device__ __forceinline__ int following_end(const Step& st) const {
    return st.chunk_end < qend ? ends[st.chunk_end] : qend;
  }
  __device__ __forceinline__ Step next(const Step& st, int following) const {
    Step nx = st;
    if (st.h + H < group) {
      nx.h = st.h + H;
      return nx;
    }
    nx.h = 0;
    nx.r = st.r + kDkvStepRows;
    if (nx.r >= st.chunk_end) {
      nx.r = st.chunk_end;
      nx.chunk_end = following;
    }
    nx.n = min(kDkvStepRows, nx.chunk_end - nx.r);
    return nx;
  }
  // Whether st is the last step of its chunk (its last rows, the group's last heads).
  __device__ __forceinline__ bool ends_chunk(const Step& st) const {
    return st.h + H == group && st.r + kDkvStepRows >= st.chunk_end;
  }
};

// At head_dim 64 a step takes two heads where the group splits into pairs. That halves the steps'
// barriers and copies and makes S^T and dP^T m64n128k16 products, which stage fewer shared-memory
// bytes per product than m64n64k16 (benchmarks/kernel_ab.sh on an H100, 8k tokens, 32 / 8 heads:
// dk/dv 2.48 ms -> 2.16 at chunks of 64 rows, 2.29 -> 1.99 at 128; the same bits,
// benchmarks/results/h100/23bdc12/). At head_dim 128 the products of two heads would need 64
// registers a thread more than there are; two heads a step with one-head products (a ring of two
// stages) cannot take the unmasked copy of the step without spilling, and without it its dk/dv was
// 2-5% slower than one head a step with it.
template <int D, int H>
struct WgDkv {
  static_assert(H == 1 || D == 64, "two heads a step only at head_dim 64");
  static constexpr int kPanels = D / 64;
  static constexpr int kCols = H * kDkvStepRows;  // a step's columns: H heads' rows, one product
  static constexpr uint32_t kKvTile = kDkvKeys * D * 2;         // K or V of the CTA's keys
  static constexpr uint32_t kRowTile = kCols * D * 2;           // Q or dO of one step
  // lse, delta and pos of the step's columns, then the Step itself (padded: stages stay
  // 1024-aligned)
  static constexpr uint32_t kMeta = (kCols * (4 + 4 + 8) + sizeof(Step) + 1023) / 1024 * 1024;
  static constexpr uint32_t kStage = 2 * kRowTile + kMeta;
  static constexpr int kStages = 4;
  static constexpr int kSmemBytes = 1024 + 2 * kKvTile + kStages * kStage + RingBarriers<kStages>::kBytes;
  static constexpr int kThreads = 2 * 128;
  static_assert(kDkvKeys == 128, "two consumer warpgroups of 64 keys");
  static_assert(kSmemBytes <= 227 * 1024, "the ring fits an SM's shared memory");
};

// *addr += (x, y, z, w) as one reduction in memory (no value comes back, so nothing waits for it).
__device__ __forceinline__ void red_add4(float* addr, float x, float y, float z, float w) {
  asm volatile("red.relaxed.gpu.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(addr), "f"(x), "f"(y), "f"(z),
               "f"(w));
}

// Arrives on `bar` once every cp.async this thread issued before has landed.
__device__ __forceinline__ void cp_async_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}

template <typename T, int D, int H>
__global__ void __launch_bounds__(WgDkv<D, H>::kThreads, 1)
    rlk_attention_bwd_dkdv_kernel(const __grid_constant__ CUtensorMap map_q,
                                  const __grid_constant__ CUtensorMap map_do,
                                  const __grid_constant__ CUtensorMap map_k,
                                  const __grid_constant__ CUtensorMap map_v, BwdParams p) {
  using C = WgDkv<D, H>;
  constexpr int kCols = C::kCols;
  constexpr bool kHalf = std::is_same_v<T, __half>;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t ks = (smem_u32(smem_raw) + 1023u) & ~1023u, vs = ks + C::kKvTile;
  const uint32_t stages = vs + C::kKvTile, bars = stages + C::kStages * C::kStage;
  auto q_tile = [&](int s) { return stages + s * C::kStage; };
  auto meta = [&](int s) { return q_tile(s) + 2 * C::kRowTile; };
  // The same as a generic pointer: lse, delta and pos of the step's columns, the Step at the end.
  auto meta_ptr = [&](int s) { return smem_raw + (meta(s) - smem_u32(smem_raw)); };
  auto step_at = [&](int s) { return reinterpret_cast<Step*>(meta_ptr(s) + C::kMeta - sizeof(Step)); };
  const RingBarriers<C::kStages> rb{bars};
  const uint32_t kv_bar = rb.once();

  const int g = blockIdx.x % p.hkv;
  int b, tile;
  // dq, launched next, may take the SMs this kernel's last CTAs leave (launch_attention_bwd).
  ptx::launch_dependents();
  if (!find_tile(p.cu_k, p.batch, kDkvKeys, blockIdx.x / p.hkv, b, tile)) return;
  const int kbase = p.cu_k[b], klen = p.cu_k[b + 1] - kbase, kstart = tile * kDkvKeys;
  const int qbeg = p.cu_q[b], qend = p.cu_q[b + 1], group = p.hq / p.hkv;
  const StepWalk<H> walk{p.chunk_end, qend, group};
  rb.init(1 + 32, 2);  // full: the copy lane's expect_tx and one cp.async arrival per lane
  __syncthreads();
  const int wg = threadIdx.x / 128, tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;

  // The producer: warp 0 copies step `pit` of the walk `pcur` into its stage once both
  // warpgroups have released the stage's previous step (one lane issues the tensor copies and
  // stores the Step, every lane 2 * H columns' lse, delta and position, whose landing it signals on
  // the stage's barrier). After the last step a stage holding only a Step with r = qend ends the walk.
  Step pcur = walk.first(p.pos, qbeg, kstart, p.q_chunk, kstart < klen);
  int following = walk.following_end(pcur), pit = 0;
  bool walked = false;
  auto produce = [&] {
    if (walked) return;
    walked = pcur.r >= qend;
    const int s = pit % C::kStages, hh = g * group + pcur.h;
    ptx::mbar_wait(rb.empty(s), ((pit / C::kStages) & 1) ^ 1);  // first pass: the slot starts free
    if (lane == 0) {
      *step_at(s) = pcur;
      ptx::mbar_arrive_expect_tx(rb.full(s), walked ? 0 : 2 * C::kRowTile);
    }
    if (walked) {
      cp_async_arrive(rb.full(s));
      return;
    }
    if (lane == 0) {
      for (int pn = 0; pn < C::kPanels; ++pn) {
        for (int e = 0; e < H; ++e) {  // head hh + e into columns 64 e .. 64 e + 63
          const uint32_t at = pn * kCols * 128 + e * kDkvStepRows * 128;
          ptx::tma_load_3d(q_tile(s) + at, &map_q, rb.full(s), 64 * pn, hh + e, pcur.r);
          ptx::tma_load_3d(q_tile(s) + C::kRowTile + at, &map_do, rb.full(s), 64 * pn, hh + e, pcur.r);
        }
      }
    }
    for (int col = lane; col < kCols; col += 32) {
      const int row = col % kDkvStepRows;
      const bool ok = row < pcur.n;
      const int64_t i = (int64_t)(pcur.r + (ok ? row : 0)) * p.hq + hh + col / kDkvStepRows;
      cp_async4or8<4>(meta(s) + col * 4, p.lse + i, ok);
      cp_async4or8<4>(meta(s) + kCols * 4 + col * 4, p.delta + i, ok);
      cp_async4or8<8>(meta(s) + kCols * 8 + col * 8, p.pos + pcur.r + (ok ? row : 0), ok);
    }
    cp_async_arrive(rb.full(s));
    const Step nx = walk.next(pcur, following);
    if (nx.chunk_end != pcur.chunk_end) following = walk.following_end(nx);  // a chunk begins
    pcur = nx;
    ++pit;
  };
  const bool producer = threadIdx.x < 32;
  if (producer) {
    if (lane == 0) {
      ptx::mbar_arrive_expect_tx(kv_bar, 2 * C::kKvTile);
      for (int pn = 0; pn < C::kPanels; ++pn) {
        ptx::tma_load_3d(ks + pn * kDkvKeys * 128, &map_k, kv_bar, 64 * pn, g, kbase + kstart);
        ptx::tma_load_3d(vs + pn * kDkvKeys * 128, &map_v, kv_bar, 64 * pn, g, kbase + kstart);
      }
    }
    for (int i = 0; i < C::kStages - 1; ++i) produce();
  }

  // Warpgroup c owns keys 64c .. 64c + 63 of the tile and computes all four products for them.
  const int c = wg, wkey = c * 64 + warp * 16;  // this warp's first key row in the tile
  float pk[D / 8][4], pv[D / 8][4];
#pragma unroll
  for (int d = 0; d < D / 8; ++d)
#pragma unroll
    for (int i = 0; i < 4; ++i) pk[d][i] = pv[d][i] = 0.f;
  float* dk = p.dk + ((int64_t)kbase * p.hkv + g) * D;
  float* dv = p.dv + ((int64_t)kbase * p.hkv + g) * D;
  // Adds the chunk's partials to dk (scaled) and dv and clears them. dk and dv start at zero and
  // each element has this one writer, whose reductions to an address apply in program order: the
  // sums run in chunk order, as a load-add-store would, without waiting for the loads.
  // Lanes 2i and 2i + 1 of a quad hold the same two keys' adjacent column pairs: they swap one key's
  // pair so that each adds four adjacent columns of one key in one reduction, half as many as pair
  // by pair (measured on an H200 at 8k tokens, head_dim 128, chunks of 64 rows: dk/dv 4.00 ms to
  // 3.63). Every element keeps its one writer, and the same value.
  auto flush = [&] {
    const bool odd = lane & 1;
    const int key = kstart + wkey + (lane >> 2) + (odd ? 8 : 0);
    float* kr = dk + (int64_t)key * p.hkv * D + 2 * (lane & 2);
    float* vr = dv + (int64_t)key * p.hkv * D + 2 * (lane & 2);
    // Opaque to the compiler, so that it does not hoist 32 addresses out of the walk.
    asm volatile("" : "+l"(kr), "+l"(vr));
#pragma unroll
    for (int d = 0; d < D / 8; ++d) {
      const float k0 = shfl_xor(odd ? pk[d][0] : pk[d][2], 1), k1 = shfl_xor(odd ? pk[d][1] : pk[d][3], 1);
      const float v0 = shfl_xor(odd ? pv[d][0] : pv[d][2], 1), v1 = shfl_xor(odd ? pv[d][1] : pv[d][3], 1);
      if (key < klen) {
        const float4 kx = odd ? make_float4(k0, k1, pk[d][2], pk[d][3]) : make_float4(pk[d][0], pk[d][1], k0, k1);
        const float4 vx = odd ? make_float4(v0, v1, pv[d][2], pv[d][3]) : make_float4(pv[d][0], pv[d][1], v0, v1);
        red_add4(kr + d * 8, __fmul_rn(p.scale, kx.x), __fmul_rn(p.scale, kx.y), __fmul_rn(p.scale, kx.z),
                 __fmul_rn(p.scale, kx.w));
        red_add4(vr + d * 8, vx.x, vx.y, vx.z, vx.w);
      }
    }
#pragma unroll
    for (int d = 0; d < D / 8; ++d)
#pragma unroll
      for (int i = 0; i < 4; ++i) pk[d][i] = pv[d][i] = 0.f;
  };

  const int key0 = kstart + wkey + (lane >> 2);  // the thread's keys in its fragments: key0, key0 + 8
  ptx::mbar_wait(kv_bar, 0);
  // K and V stay in shared memory: in registers they would spill where the kernel already holds
  // 254-255 (head_dim 128, or two heads a step); one head a step at head_dim 64 was not timed so.
  const OperandA<D, false> ka(ks + c * 64 * 128, kDkvKeys * 128, warp, lane),
      va(vs + c * 64 * 128, kDkvKeys * 128, warp, lane);
  // The copies read past a chunk's end (rows that are masked); zeroes them in stage s so that
  // 0 * x adds exactly zero even where x is inf or NaN.
  auto zero_tail = [&](int s, const Step& st) {
    if (st.r >= qend || st.n == kDkvStepRows) return;
    for (int e = 0; e < H; ++e) {
      zero_rows<D, kCols>(q_tile(s), e * kDkvStepRows + st.n, tid, (e + 1) * kDkvStepRows);
      zero_rows<D, kCols>(q_tile(s) + C::kRowTile, e * kDkvStepRows + st.n, tid, (e + 1) * kDkvStepRows);
    }
    ptx::fence_proxy_async_smem();
    ptx::named_bar_sync(1 + c, 128);
  };
  // sc, dp: S^T and dP^T, rows the warp's keys, columns the step's (head, query row) pairs.
  float sc[kCols / 8][4], dp[kCols / 8][4];
  // sc = P^T in place, zero where a row does not see the key; what depends on the column is read
  // once for the thread's two keys.
  auto probabilities = [&](int s, const Step& cur, auto masked) {
    const float* lse_s = reinterpret_cast<const float*>(meta_ptr(s));
    const int64_t* pos_s = reinterpret_cast<const int64_t*>(lse_s + 2 * kCols);
#pragma unroll
    for (int n = 0; n < kCols / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {  // the thread's two columns of n8 tile n
        const int col = n * 8 + 2 * (lane & 3) + e;
        const float lse2 = __fmul_rn(lse_s[col], kLog2e);
        // The last key the column's row sees (none for a row past the chunk): one comparison a
        // key, where three made the compiler keep the flags in a bit mask.
        int last = INT_MAX;
        if constexpr (decltype(masked)::value)
          last = col % kDkvStepRows < cur.n ? (int)min(pos_s[col], (int64_t)klen - 1) : -1;
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {  // its two keys
          const int i = 2 * hh + e;
          const float pr = ex2(__fmaf_rn(sc[n][i], p.scale_log2, -lse2));
          sc[n][i] = key0 + 8 * hh <= last ? pr : 0.f;
        }
      }
    }
  };
  // dp = dS^T = P^T (dP^T - delta) in place.
  auto score_grads = [&](int s) {
    const float* delta_s = reinterpret_cast<const float*>(meta_ptr(s)) + kCols;
#pragma unroll
    for (int n = 0; n < kCols / 8; ++n) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float delta = delta_s[n * 8 + 2 * (lane & 3) + (i & 1)];
        dp[n][i] = __fmul_rn(sc[n][i], __fsub_rn(dp[n][i], delta));
      }
    }
  };
  // Clears sc for the next S^T (its zeros written before the wgmma fence).
  auto zero_scores = [&] {
    zero_tiles(sc);
    fence_tiles(sc);  // see two_kmajor_products
  };
  // Issues the k16 steps of S^T = K Q^T for the step in stage s.
  auto scores = [&](int s) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) ka.template step<kCols, kHalf>(sc, q_tile(s), kCols * 128, kk);
  };

  // A step runs as two groups of products: dV += P^T dO and dK += dS^T Q of the step before with
  // this step's S^T, then dP^T alone, whose run hides the exponentials of P^T. Each accumulator
  // sees the same products in the same order as one group a product would give. The last step's
  // dV and dK go with the scores of the stage that ends the walk, which holds no rows: those are
  // thrown away, so that no wgmma sits on a branch. No product is in flight across the loop's
  // back edge (the compiler's register moves there would serialize them).
  uint32_t ap[kCols / 16][4], as[kCols / 16][4];  // P^T and dS^T of the step before
  Step prev{}, cur{};
  int it = 0;  // cur's place in the walk; its stage is it % kStages
  // S^T of cur is in sc: the next step's copy awaited, then dP^T, and P^T and dS^T into ap / as.
  auto finish_step = [&] {
    const int s = it % C::kStages, s1 = (it + 1) % C::kStages;
    if (producer) produce();  // step it + kStages - 1
    ptx::mbar_wait(rb.full(s1), ((it + 1) / C::kStages) & 1);
    const Step next = *step_at(s1);
    zero_tail(s1, next);
    zero_tiles(dp);
    fence_tiles(dp);
    ptx::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) va.template step<kCols, kHalf>(dp, q_tile(s) + C::kRowTile, kCols * 128, kk);
    ptx::wgmma_commit();
    if (it > 0 && walk.ends_chunk(prev)) flush();
    // Two copies of the exponentials: one with no mask at all, for a step whose every row sees
    // every key of this warpgroup (its first row has the least position), and one that masks
    // (benchmarks/results/h100/edb0601/, 8k tokens, 32 / 8 heads, chunks of 128 rows: dk/dv
    // 1.98 ms -> 1.42 at head_dim 64, 2.90 -> 2.52 at 128; the same bits).
    const int64_t* pos_s = reinterpret_cast<const int64_t*>(meta_ptr(s) + 8 * kCols);
    const bool all_visible = cur.n == kDkvStepRows && kstart + c * 64 + 63 <= pos_s[0] &&
                             kstart + c * 64 + 64 <= klen;
    if (all_visible) probabilities(s, cur, std::false_type{});
    else probabilities(s, cur, std::true_type{});
    ptx::wgmma_wait<0>();
    fence_tiles(dp);
    score_grads(s);
#pragma unroll
    for (int kk = 0; kk < kCols / 16; ++kk) {
      c_to_a<T>(ap[kk], sc, kk);
      c_to_a<T>(as[kk], dp, kk);
    }
    prev = cur;
    cur = next;
    ++it;
  };

  ptx::mbar_wait(rb.full(0), 0);
  cur = *step_at(0);
  if (cur.r >= qend) return;
  zero_tail(0, cur);
  zero_scores();
  ptx::wgmma_fence();
  scores(0);
  ptx::wgmma_commit();
  ptx::wgmma_wait<0>();
  fence_tiles(sc);
  finish_step();
  for (;;) {
    const uint32_t qs = q_tile((it - 1) % C::kStages), ds = qs + C::kRowTile;  // prev's stage
    zero_scores();
    ptx::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kCols / 16; ++kk) {
      nmajor_step<D, kHalf>(pv, ap[kk], ds, kCols * 128, kk);
      nmajor_step<D, kHalf>(pk, as[kk], qs, kCols * 128, kk);
    }
    scores(it % C::kStages);
    ptx::wgmma_commit();
    ptx::wgmma_wait<0>();
    fence_tiles(sc);
    fence_tiles(pk);
    fence_tiles(pv);
    fence_a(ap);
    fence_a(as);
    if (tid == 0) ptx::mbar_arrive(rb.empty((it - 1) % C::kStages));
    if (cur.r >= qend) break;
    finish_step();
  }
  if (walk.ends_chunk(prev)) flush();
}

template <typename T, int D, int H>
cudaError_t launch_attention_dkdv_heads(const BwdParams& p, int64_t tq, int64_t tk, int k_tiles,
                                        cudaStream_t stream) {
  using C = WgDkv<D, H>;
  constexpr bool kHalf = std::is_same_v<T, __half>;
  CUtensorMap mq, mdo, mk, mv;
  cudaError_t e = encode_rows_map(&mq, p.q, kHalf, tq, p.hq, D, kDkvStepRows);
  if (e == cudaSuccess) e = encode_rows_map(&mdo, p.dout, kHalf, tq, p.hq, D, kDkvStepRows);
  if (e == cudaSuccess) e = encode_rows_map(&mk, p.k, kHalf, tk, p.hkv, D, kDkvKeys);
  if (e == cudaSuccess) e = encode_rows_map(&mv, p.v, kHalf, tk, p.hkv, D, kDkvKeys);
  if (e != cudaSuccess) return e;
  // The kernel adds each chunk's partials into dk and dv (keys no row sees stay zero).
  const size_t bytes = static_cast<size_t>(tk) * p.hkv * D * sizeof(float);
  if ((e = cudaMemsetAsync(p.dk, 0, bytes, stream)) != cudaSuccess) return e;
  if ((e = cudaMemsetAsync(p.dv, 0, bytes, stream)) != cudaSuccess) return e;
  auto kernel = rlk_attention_bwd_dkdv_kernel<T, D, H>;
  if ((e = set_smem(kernel, C::kSmemBytes)) != cudaSuccess) return e;
  kernel<<<k_tiles * p.hkv, C::kThreads, C::kSmemBytes, stream>>>(mq, mdo, mk, mv, p);
  return cudaGetLastError();
}

template <typename T, int D>
cudaError_t launch_attention_dkdv(const BwdParams& p, int64_t tq, int64_t tk, int k_tiles,
                                  cudaStream_t stream) {
  if constexpr (D == 64) {
    if ((p.hq / p.hkv) % 2 == 0) return launch_attention_dkdv_heads<T, D, 2>(p, tq, tk, k_tiles, stream);
  }
  return launch_attention_dkdv_heads<T, D, 1>(p, tq, tk, k_tiles, stream);
}

}  // namespace rl_engine::cuda::attn
