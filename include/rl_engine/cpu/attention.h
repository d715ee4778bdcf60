// Deterministic causal attention on fp32 buffers: the forward walk shared by prefill and paged
// decode, and the FlashAttention-2 backward. A query at absolute position p sees keys 0..p of its
// sequence. Keys are visited in blocks of `block` positions anchored at position 0, in block order,
// keys in position order inside a block. Where a key row lives (packed rows or cache pages) is hidden
// behind a `rows(j, &k, &v)` accessor that returns the row pointers of key position j, so prefill
// and decode run the same arithmetic on the same values and give the same bits.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "rl_engine/cpu/fixed_order.h"

namespace rl_engine::cpu {

// Per-thread buffers of one forward walk: `block` scores and row pointers, `d` accumulators.
struct AttentionScratch {
  float* scores;
  const float** krows;
  const float** vrows;
  float* acc;
};

// Folds one KV block (n keys, row pointers in position order) into the running fp32 state
// (m, l, acc) with the FlashAttention-2 update: m' = max(m, max_j s_j), acc and l rescaled by
// exp(m - m'), then p_j = exp(s_j - m') added in key order. Not inlined so that every caller
// executes this one compiled body.
[[gnu::noinline]] inline void attention_block_update(const float* q, const float* const* krows,
                                                     const float* const* vrows, int64_t n,
                                                     int64_t d, float scale, float* scores,
                                                     float& m, float& l, float* acc) {
  float block_max = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) {
    scores[j] = scale * dot(q, krows[j], d);
    block_max = std::max(block_max, scores[j]);
  }
  const float m_new = std::max(m, block_max);
  const float alpha = std::exp(m - m_new);  // 0 on the first block (m = -inf)
  l *= alpha;
  for (int64_t i = 0; i < d; ++i) acc[i] *= alpha;
  for (int64_t j = 0; j < n; ++j) {
    const float p = std::exp(scores[j] - m_new);
    l += p;
    const float* vr = vrows[j];
    for (int64_t i = 0; i < d; ++i) acc[i] += p * vr[i];
  }
  m = m_new;
}

// One (query row, head) of the forward: out[d] = softmax(scale * q.K[0..pos]) V, lse = m + log(l).
template <typename Rows>
void attention_query(const float* q, int64_t pos, Rows&& rows, int64_t d, float scale,
                     int64_t block, const AttentionScratch& s, float* out, float* lse) {
  float m = -std::numeric_limits<float>::infinity();
  float l = 0.f;
  for (int64_t i = 0; i < d; ++i) s.acc[i] = 0.f;
  for (int64_t start = 0; start <= pos; start += block) {
    const int64_t n = std::min(block, pos + 1 - start);  // keys past pos are masked out
    for (int64_t j = 0; j < n; ++j) rows(start + j, &s.krows[j], &s.vrows[j]);
    attention_block_update(q, s.krows, s.vrows, n, d, scale, s.scores, m, l, s.acc);
  }
  for (int64_t i = 0; i < d; ++i) out[i] = s.acc[i] / l;
  *lse = m + std::log(l);
}

// Probability and score gradient of one (query, key) pair of the backward:
// p = exp(scale * q.k - lse), dS = p * (dO.v - delta) with delta = dO.O.
struct AttentionGradPair {
  float p;
  float ds;
};

inline AttentionGradPair attention_grad_pair(const float* q, const float* dout, const float* k,
                                             const float* v, float lse, float delta, int64_t d,
                                             float scale) {
  const float p = std::exp(scale * dot(q, k, d) - lse);
  return {p, p * (dot(dout, v, d) - delta)};
}

// dq of one (query row, head): scale * sum_j dS_j k_j over keys 0..pos in position order (which is
// block order). `acc` is d floats of scratch; dq gets the fp32 result.
template <typename Rows>
void attention_bwd_dq(const float* q, const float* dout, float lse, float delta, int64_t pos,
                      Rows&& rows, int64_t d, float scale, float* acc, float* dq) {
  for (int64_t i = 0; i < d; ++i) acc[i] = 0.f;
  for (int64_t j = 0; j <= pos; ++j) {
    const float* k;
    const float* v;
    rows(j, &k, &v);
    const float ds = attention_grad_pair(q, dout, k, v, lse, delta, d, scale).ds;
    for (int64_t i = 0; i < d; ++i) acc[i] += ds * k[i];
  }
  for (int64_t i = 0; i < d; ++i) dq[i] = scale * acc[i];
}

// dk/dv of one key row (position kpos, one kv head) over the query rows of its sequence.
// `queries(r, h, &q, &dout, &lse, &delta)` gives row r's data for q head h of this kv head's group;
// positions[r] is row r's absolute position (strictly increasing). The sum is organised in query
// chunks (position / chunk): per chunk an fp32 partial over rows in position order and, inside each
// row, the group's heads in head order; the partials (dk's scaled once) are added to dk/dv in chunk
// order starting from zero. part_k/part_v are d floats of scratch each.
template <typename Queries>
void attention_bwd_dkv(const float* k, const float* v, int64_t kpos, const int64_t* positions,
                       int64_t n_rows, int64_t group, Queries&& queries, int64_t d, float scale,
                       int64_t chunk, float* part_k, float* part_v, float* dk, float* dv) {
  for (int64_t i = 0; i < d; ++i) dk[i] = dv[i] = 0.f;
  // Rows before the first one that sees this key contribute nothing.
  const int64_t first = std::lower_bound(positions, positions + n_rows, kpos) - positions;
  auto flush = [&]() {
    for (int64_t i = 0; i < d; ++i) {
      dk[i] += scale * part_k[i];
      dv[i] += part_v[i];
    }
  };
  int64_t current = -1;
  for (int64_t r = first; r < n_rows; ++r) {
    const int64_t c = positions[r] / chunk;
    if (c != current) {
      if (current >= 0) flush();
      current = c;
      for (int64_t i = 0; i < d; ++i) part_k[i] = part_v[i] = 0.f;
    }
    for (int64_t h = 0; h < group; ++h) {
      const float *q, *dout;
      float lse, delta;
      queries(r, h, &q, &dout, &lse, &delta);
      const AttentionGradPair g = attention_grad_pair(q, dout, k, v, lse, delta, d, scale);
      for (int64_t i = 0; i < d; ++i) {
        part_k[i] += g.ds * q[i];
        part_v[i] += g.p * dout[i];
      }
    }
  }
  if (current >= 0) flush();
}

}  // namespace rl_engine::cpu
