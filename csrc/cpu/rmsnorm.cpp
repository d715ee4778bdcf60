// CPU launchers of rmsnorm and its backward.
#include "rl_engine/cpu/rmsnorm.h"

#include <torch/library.h>

#include "cpu/common.h"
#include "kernel_counters.h"

namespace rl_engine::cpu {
namespace {

void check_x_weight(const at::Tensor& x, const at::Tensor& weight, const char* op) {
  check_float_dtype(x, "x");
  check_float_dtype(weight, "weight");
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && weight.size(0) > 0 &&
                  x.size(-1) == weight.size(0),
              "rl_engine::", op, ": x [..., H] and weight [H] must agree on H > 0, got x ",
              x.sizes(), " and weight ", weight.sizes());
}

std::tuple<at::Tensor, at::Tensor> rmsnorm(const at::Tensor& x, const at::Tensor& weight,
                                           double eps) {
  check_x_weight(x, weight, "rmsnorm");
  count_launch(kRmsnorm, kCpu);
  const int64_t h = weight.size(0);
  auto x2 = f32(x.reshape({-1, h}));
  auto wf = f32(weight);
  const int64_t rows = x2.size(0);
  auto out = at::empty({rows, h}, x2.options());
  auto rstd = at::empty({rows}, x2.options());
  const float* xp = x2.data_ptr<float>();
  const float* wp = wf.data_ptr<float>();
  float* op = out.data_ptr<float>();
  float* rp = rstd.data_ptr<float>();
  const float e = static_cast<float>(eps);
  parallel_rows(rows, [&](int64_t b, int64_t end) { rmsnorm_rows(xp, wp, e, op, rp, b, end, h); });
  return {out.to(x.scalar_type()).reshape(x.sizes()), rstd.reshape(x.sizes().slice(0, x.dim() - 1))};
}

std::tuple<at::Tensor, at::Tensor> rmsnorm_backward(const at::Tensor& grad_out, const at::Tensor& x,
                                                    const at::Tensor& weight,
                                                    const at::Tensor& rstd) {
  check_x_weight(x, weight, "rmsnorm_backward");
  check_float_dtype(grad_out, "grad_out");
  TORCH_CHECK(grad_out.sizes() == x.sizes(), "rl_engine::rmsnorm_backward: grad_out must have the "
              "shape of x, got ", grad_out.sizes(), " and ", x.sizes());
  TORCH_CHECK(rstd.scalar_type() == at::kFloat && rstd.numel() * x.size(-1) == x.numel(),
              "rl_engine::rmsnorm_backward: rstd must be fp32 with one value per row of x, got ",
              rstd.scalar_type(), " ", rstd.sizes(), " for x ", x.sizes());
  count_launch(kRmsnormBackward, kCpu);
  const int64_t h = weight.size(0);
  auto g = f32(grad_out.reshape({-1, h}));
  auto x2 = f32(x.reshape({-1, h}));
  auto wf = f32(weight);
  auto rs = rstd.reshape({-1}).contiguous();
  const int64_t rows = x2.size(0);
  auto dx = at::empty({rows, h}, x2.options());
  auto dw = at::empty({h}, x2.options());
  const float* gp = g.data_ptr<float>();
  const float* xp = x2.data_ptr<float>();
  const float* wp = wf.data_ptr<float>();
  const float* rp = rs.data_ptr<float>();
  float* dxp = dx.data_ptr<float>();
  float* dwp = dw.data_ptr<float>();
  parallel_rows(rows, [&](int64_t b, int64_t e) { rmsnorm_grad_x_rows(gp, xp, wp, rp, dxp, b, e, h); });
  // grad_weight reduces over rows in index order; threads split its H columns, never the rows.
  parallel_rows(h, [&](int64_t b, int64_t e) {
    rmsnorm_grad_weight_cols(gp, xp, rp, dwp, b, e, rows, h);
  });
  return {dx.to(x.scalar_type()).reshape(x.sizes()), dw};
}

}  // namespace

TORCH_LIBRARY_IMPL(rl_engine, CPU, m) {
  m.impl("rmsnorm", &rmsnorm);
  m.impl("rmsnorm_backward", &rmsnorm_backward);
}

}  // namespace rl_engine::cpu
