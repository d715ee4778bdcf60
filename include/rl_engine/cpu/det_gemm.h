// Deterministic GEMM kernels on fp32 buffers. Each output element is one fixed-order dot product
// (fixed_order.h), so a row's bits do not depend on M, on the row's index or on threading. Callers
// parallelise over [row_begin, row_end) ranges of the output only.
#pragma once

#include <cstdint>

#include "rl_engine/cpu/fixed_order.h"

namespace rl_engine::cpu {

// y[m, n] = dot(x[m, :], w[n, :]) (+ bias[n]); x [M, K], w [N, K], y [M, N], all contiguous.
inline void det_gemm_rows(const float* x, const float* w, const float* bias, float* y,
                          int64_t row_begin, int64_t row_end, int64_t n_cols, int64_t k_dim) {
  for (int64_t m = row_begin; m < row_end; ++m) {
    const float* xr = x + m * k_dim;
    float* yr = y + m * n_cols;
    for (int64_t n = 0; n < n_cols; ++n) {
      const float v = dot(xr, w + n * k_dim, k_dim);
      yr[n] = bias ? v + bias[n] : v;
    }
  }
}

// Reduction over the leading dimension in index order: out[i, j] = sum_r a[r, i] * b[r, j] for
// a [R, I], b [R, J] (the weight gradient dW = dY^T X with R = tokens). Rows i in [row_begin, row_end).
inline void det_gemm_tn_rows(const float* a, const float* b, float* out, int64_t row_begin,
                             int64_t row_end, int64_t r_dim, int64_t i_dim, int64_t j_dim) {
  for (int64_t i = row_begin; i < row_end; ++i) {
    float* o = out + i * j_dim;
    for (int64_t j = 0; j < j_dim; ++j) o[j] = 0.f;
    // Sequential over r (index order), vectorised across j: each o[j] sees r = 0, 1, ... in order.
    for (int64_t r = 0; r < r_dim; ++r) {
      const float s = a[r * i_dim + i];
      const float* br = b + r * j_dim;
      for (int64_t j = 0; j < j_dim; ++j) o[j] += s * br[j];
    }
  }
}

}  // namespace rl_engine::cpu
