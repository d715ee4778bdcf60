// RMSNorm kernels on fp32 buffers: out[r, i] = (x[r, i] * rstd[r]) * w[i] with
// rstd[r] = 1 / sqrt(sum_i x[r, i]^2 / H + eps). The sum of squares is the fixed-order dot product
// of fixed_order.h, so a row's bits depend only on that row. Callers parallelise over rows for the
// forward and grad_x, and over columns of grad_weight (whose reduction runs over rows in order).
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "rl_engine/cpu/fixed_order.h"

namespace rl_engine::cpu {

// x, out [R, H]; w [H]; rstd [R]. Rows in [row_begin, row_end).
inline void rmsnorm_rows(const float* x, const float* w, float eps, float* out, float* rstd,
                         int64_t row_begin, int64_t row_end, int64_t h) {
  const float inv_h = 1.f / static_cast<float>(h);
  for (int64_t r = row_begin; r < row_end; ++r) {
    const float* xr = x + r * h;
    float* o = out + r * h;
    const float mean_sq = dot(xr, xr, h) * inv_h;
    const float rs = 1.f / std::sqrt(mean_sq + eps);
    rstd[r] = rs;
    for (int64_t i = 0; i < h; ++i) o[i] = (xr[i] * rs) * w[i];
  }
}

// dx[r, i] = rstd * (g[i] w[i] - x[i] * rstd^2 * sum_j(g[j] w[j] x[j]) / H), the exact derivative
// of rmsnorm_rows for one row; the inner sum is again one fixed-order dot product.
inline void rmsnorm_grad_x_rows(const float* g, const float* x, const float* w, const float* rstd,
                                float* dx, int64_t row_begin, int64_t row_end, int64_t h) {
  std::vector<float> gw(static_cast<size_t>(h));
  const float inv_h = 1.f / static_cast<float>(h);
  for (int64_t r = row_begin; r < row_end; ++r) {
    const float* gr = g + r * h;
    const float* xr = x + r * h;
    float* d = dx + r * h;
    const float rs = rstd[r];
    for (int64_t i = 0; i < h; ++i) gw[i] = gr[i] * w[i];
    const float c = ((dot(gw.data(), xr, h) * rs) * rs) * inv_h;
    for (int64_t i = 0; i < h; ++i) d[i] = rs * (gw[i] - xr[i] * c);
  }
}

// dw[i] = sum_r g[r, i] * (x[r, i] * rstd[r]) for columns i in [col_begin, col_end), rows added
// r = 0, 1, ... in order: the bits of dw[i] do not depend on how the columns are split.
inline void rmsnorm_grad_weight_cols(const float* g, const float* x, const float* rstd, float* dw,
                                     int64_t col_begin, int64_t col_end, int64_t rows, int64_t h) {
  for (int64_t i = col_begin; i < col_end; ++i) dw[i] = 0.f;
  for (int64_t r = 0; r < rows; ++r) {
    const float* gr = g + r * h;
    const float* xr = x + r * h;
    const float rs = rstd[r];
    for (int64_t i = col_begin; i < col_end; ++i) dw[i] += gr[i] * (xr[i] * rs);
  }
}

}  // namespace rl_engine::cpu
