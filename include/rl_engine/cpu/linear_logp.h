// Selected-token log-prob kernels on fp32 buffers, without [T, V] logits. The log-sum-exp of a
// row is built from fixed-size vocab tiles aligned to absolute vocab index, merged through one
// fixed binary tree; a shard of 2^k consecutive tiles is a subtree, so a vocab split followed by
// merging the shard roots in shard order gives the bits of the unsplit call. Logits are the
// fixed-order dot products of det_gemm, so they carry det_gemm's bits.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "rl_engine/cpu/fixed_order.h"

namespace rl_engine::cpu {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// One node of the log-sum-exp tree: lse = m + log(s).
struct LseNode {
  float m;
  float s;
};

// The only merge rule, used at every level of the tree and across shards. A side with m = -inf
// (padding) contributes exactly 0 and leaves the other side's bits unchanged (x * exp(0) == x).
inline LseNode lse_merge(LseNode a, LseNode b) {
  const float m = a.m > b.m ? a.m : b.m;
  if (m == kNegInf) return {kNegInf, 0.f};  // both padding; avoids exp(-inf - -inf) = NaN
  const float ea = a.m == kNegInf ? 0.f : std::exp(a.m - m);
  const float eb = b.m == kNegInf ? 0.f : std::exp(b.m - m);
  return {m, a.s * ea + b.s * eb};
}

// Merges nodes[0..n) in place through pairs (0,1), (2,3), ... level by level; n is a power of
// two. The root ends up in nodes[0].
inline LseNode lse_tree(LseNode* nodes, int64_t n) {
  for (; n > 1; n /= 2) {
    for (int64_t i = 0; i < n / 2; ++i) nodes[i] = lse_merge(nodes[2 * i], nodes[2 * i + 1]);
  }
  return nodes[0];
}

// (max, sum exp(logit - max)) of one tile, both taken in vocab order; an empty tile is padding.
inline LseNode tile_stats(const float* logits, int64_t n) {
  float m = kNegInf;
  for (int64_t i = 0; i < n; ++i) m = logits[i] > m ? logits[i] : m;
  if (m == kNegInf) return {kNegInf, 0.f};
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += std::exp(logits[i] - m);
  return {m, s};
}

// Shard partials for tokens [t_begin, t_end): hidden [T, H], weight [V_local, H], target [T]
// (absolute ids). Writes out_max, out_sum, out_target [T]. Weight tiles are visited once per
// block of tokens so a tile stays in cache; each token's arithmetic is the same in any block.
inline void linear_logp_partial_rows(const float* hidden, const float* weight, const int64_t* target,
                                     float* out_max, float* out_sum, float* out_target,
                                     int64_t t_begin, int64_t t_end, int64_t v_local, int64_t h_dim,
                                     int64_t vocab_start, int64_t vocab_tile, int64_t num_tiles) {
  constexpr int64_t kTokenBlock = 16;
  std::vector<LseNode> nodes(kTokenBlock * num_tiles);
  std::vector<float> logits(vocab_tile);
  for (int64_t tb = t_begin; tb < t_end; tb += kTokenBlock) {
    const int64_t te = tb + kTokenBlock < t_end ? tb + kTokenBlock : t_end;
    for (int64_t j = 0; j < num_tiles; ++j) {
      const int64_t v0 = j * vocab_tile;
      const int64_t v1 = v0 + vocab_tile < v_local ? v0 + vocab_tile : v_local;
      for (int64_t t = tb; t < te; ++t) {
        const float* h = hidden + t * h_dim;
        for (int64_t v = v0; v < v1; ++v) logits[v - v0] = dot(h, weight + v * h_dim, h_dim);
        nodes[(t - tb) * num_tiles + j] = tile_stats(logits.data(), v1 > v0 ? v1 - v0 : 0);
      }
    }
    for (int64_t t = tb; t < te; ++t) {
      const LseNode root = lse_tree(nodes.data() + (t - tb) * num_tiles, num_tiles);
      out_max[t] = root.m;
      out_sum[t] = root.s;
      const int64_t local = target[t] - vocab_start;
      out_target[t] = (local >= 0 && local < v_local)
                          ? dot(hidden + t * h_dim, weight + local * h_dim, h_dim)
                          : kNegInf;
    }
  }
}

// d logit[t, v] = grad[t] * (1[v == target] - exp(logit - lse[t])), the logit recomputed with dot.
inline float dlogit(const float* h, const float* w_row, int64_t h_dim, float grad, float lse,
                    bool is_target) {
  const float p = std::exp(dot(h, w_row, h_dim) - lse);
  return grad * ((is_target ? 1.f : 0.f) - p);
}

// grad_hidden[t, :] = sum_v dlogit[t, v] * weight[v, :] over v = 0..V_local-1 in index order,
// for tokens [t_begin, t_end). Tokens go in blocks so each weight tile is reused from cache.
inline void linear_logp_grad_hidden_rows(const float* grad, const float* hidden, const float* weight,
                                         const int64_t* target, const float* lse, float* grad_hidden,
                                         int64_t t_begin, int64_t t_end, int64_t v_local,
                                         int64_t h_dim, int64_t vocab_start, int64_t vocab_tile) {
  constexpr int64_t kTokenBlock = 16;
  for (int64_t t = t_begin; t < t_end; ++t) {
    for (int64_t k = 0; k < h_dim; ++k) grad_hidden[t * h_dim + k] = 0.f;
  }
  for (int64_t tb = t_begin; tb < t_end; tb += kTokenBlock) {
    const int64_t te = tb + kTokenBlock < t_end ? tb + kTokenBlock : t_end;
    for (int64_t v0 = 0; v0 < v_local; v0 += vocab_tile) {
      const int64_t v1 = v0 + vocab_tile < v_local ? v0 + vocab_tile : v_local;
      for (int64_t t = tb; t < te; ++t) {
        const float* h = hidden + t * h_dim;
        float* gh = grad_hidden + t * h_dim;
        const int64_t local = target[t] - vocab_start;
        for (int64_t v = v0; v < v1; ++v) {
          const float* w = weight + v * h_dim;
          const float d = dlogit(h, w, h_dim, grad[t], lse[t], v == local);
          for (int64_t k = 0; k < h_dim; ++k) gh[k] += d * w[k];
        }
      }
    }
  }
}

// grad_weight[v, :] = sum_t dlogit[t, v] * hidden[t, :] over t = 0..T-1 in row order, for vocab
// rows [v_begin, v_end). Tokens go in blocks so a block of hidden rows is reused from cache.
inline void linear_logp_grad_weight_rows(const float* grad, const float* hidden, const float* weight,
                                         const int64_t* target, const float* lse, float* grad_weight,
                                         int64_t v_begin, int64_t v_end, int64_t t_dim, int64_t h_dim,
                                         int64_t vocab_start) {
  constexpr int64_t kTokenBlock = 64;
  for (int64_t v = v_begin; v < v_end; ++v) {
    for (int64_t k = 0; k < h_dim; ++k) grad_weight[v * h_dim + k] = 0.f;
  }
  for (int64_t tb = 0; tb < t_dim; tb += kTokenBlock) {
    const int64_t te = tb + kTokenBlock < t_dim ? tb + kTokenBlock : t_dim;
    for (int64_t v = v_begin; v < v_end; ++v) {
      const float* w = weight + v * h_dim;
      float* gw = grad_weight + v * h_dim;
      for (int64_t t = tb; t < te; ++t) {
        const float* h = hidden + t * h_dim;
        const float d = dlogit(h, w, h_dim, grad[t], lse[t], target[t] - vocab_start == v);
        for (int64_t k = 0; k < h_dim; ++k) gw[k] += d * h[k];
      }
    }
  }
}

}  // namespace rl_engine::cpu
