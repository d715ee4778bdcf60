// CPU launchers of det_gemm and its two backward products.
#include "rl_engine/cpu/det_gemm.h"

#include <torch/library.h>

#include "cpu/common.h"
#include "kernel_counters.h"

namespace rl_engine::cpu {
namespace {

at::Tensor det_gemm(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  check_float_dtype(x, "x");
  check_float_dtype(w, "w");
  TORCH_CHECK(w.dim() == 2 && x.size(-1) == w.size(1), "rl_engine::det_gemm: x [..., K] and w [N, K] "
              "must agree on K, got x ", x.sizes(), " and w ", w.sizes());
  count_launch(kDetGemm, kCpu);
  const int64_t k = w.size(1), n = w.size(0);
  auto x2 = f32(x.reshape({-1, k}));
  auto wf = f32(w);
  at::Tensor bf;
  if (bias.has_value()) bf = f32(*bias);
  const int64_t m = x2.size(0);
  auto y = at::empty({m, n}, x2.options());
  const float* xp = x2.data_ptr<float>();
  const float* wp = wf.data_ptr<float>();
  const float* bp = bias.has_value() ? bf.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  parallel_rows(m, [&](int64_t b, int64_t e) { det_gemm_rows(xp, wp, bp, yp, b, e, n, k); });
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  return y.to(x.scalar_type()).reshape(sizes);
}

at::Tensor det_gemm_grad_input(const at::Tensor& grad_y, const at::Tensor& w) {
  check_float_dtype(grad_y, "grad_y");
  TORCH_CHECK(w.dim() == 2 && grad_y.size(-1) == w.size(0), "rl_engine::det_gemm_grad_input: grad_y "
              "[..., N] and w [N, K] must agree on N, got ", grad_y.sizes(), " and ", w.sizes());
  count_launch(kDetGemmGradInput, kCpu);
  const int64_t n = w.size(0), k = w.size(1);
  auto g = f32(grad_y.reshape({-1, n}));
  auto wt = f32(w).t().contiguous();  // [K, N]: dx[m, k] = dot(dy[m, :], w[:, k])
  const int64_t m = g.size(0);
  auto dx = at::empty({m, k}, g.options());
  const float* gp = g.data_ptr<float>();
  const float* wp = wt.data_ptr<float>();
  float* dp = dx.data_ptr<float>();
  parallel_rows(m, [&](int64_t b, int64_t e) { det_gemm_rows(gp, wp, nullptr, dp, b, e, k, n); });
  auto sizes = grad_y.sizes().vec();
  sizes.back() = k;
  return dx.to(grad_y.scalar_type()).reshape(sizes);
}

at::Tensor det_gemm_grad_weight(const at::Tensor& grad_y, const at::Tensor& x) {
  check_float_dtype(grad_y, "grad_y");
  check_float_dtype(x, "x");
  const int64_t n = grad_y.size(-1), k = x.size(-1);
  auto g = f32(grad_y.reshape({-1, n}));
  auto xf = f32(x.reshape({-1, k}));
  TORCH_CHECK(g.size(0) == xf.size(0), "rl_engine::det_gemm_grad_weight: grad_y and x must have the "
              "same rows, got ", g.size(0), " and ", xf.size(0));
  count_launch(kDetGemmGradWeight, kCpu);
  auto dw = at::empty({n, k}, g.options());
  const float* gp = g.data_ptr<float>();
  const float* xp = xf.data_ptr<float>();
  float* dp = dw.data_ptr<float>();
  const int64_t rows = g.size(0);
  parallel_rows(n, [&](int64_t b, int64_t e) { det_gemm_tn_rows(gp, xp, dp, b, e, rows, n, k); });
  return dw;
}

at::Tensor rank_order_sum(const at::Tensor& parts) {
  check_float_dtype(parts, "parts");
  TORCH_CHECK(parts.dim() >= 1 && parts.size(0) >= 1, "rl_engine::rank_order_sum: parts must be "
              "[R, ...] with R >= 1, got ", parts.sizes());
  count_launch(kRankOrderSum, kCpu);
  auto p = f32(parts);
  const int64_t r = p.size(0), numel = p.numel() / r;
  auto out = at::empty(parts.sizes().slice(1), p.options());
  const float* pp = p.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, numel, 4096, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      float acc = pp[i];
      for (int64_t j = 1; j < r; ++j) acc += pp[j * numel + i];
      op[i] = acc;
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(rl_engine, CPU, m) {
  m.impl("det_gemm", &det_gemm);
  m.impl("det_gemm_grad_input", &det_gemm_grad_input);
  m.impl("det_gemm_grad_weight", &det_gemm_grad_weight);
  m.impl("rank_order_sum", &rank_order_sum);
}

}  // namespace rl_engine::cpu
