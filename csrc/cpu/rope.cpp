// CPU launchers of rope and its backward.
#include "rl_engine/cpu/rope.h"

#include <torch/library.h>

#include "cpu/common.h"
#include "kernel_counters.h"

namespace rl_engine::cpu {
namespace {

// inv_freq = 1 / theta ** (arange(0, D, 2) / D) in fp32, written with the same tensor ops as the
// Hugging Face Qwen3 rotary embedding so that both get the same bits. It is computed once per call
// (D/2 values, never split across threads), so every row sees the same table.
at::Tensor inv_freq(double theta, int64_t d) {
  auto exponents = at::arange(0, d, 2, at::TensorOptions().dtype(at::kFloat)).div(d);
  return at::reciprocal(at::pow(theta, exponents)).contiguous();
}

at::Tensor rope_apply(const at::Tensor& x, const at::Tensor& positions, double theta, float sign,
                      const char* op) {
  check_float_dtype(x, op);
  TORCH_CHECK(x.dim() == 3 && x.size(2) > 0 && x.size(2) % 2 == 0, "rl_engine::", op,
              ": expected [T, heads, D] with D even, got ", x.sizes());
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 &&
                  positions.size(0) == x.size(0),
              "rl_engine::", op, ": positions must be int64 [T] with T = ", x.size(0), ", got ",
              positions.scalar_type(), " ", positions.sizes());
  TORCH_CHECK(theta > 0, "rl_engine::", op, ": theta must be positive, got ", theta);
  const int64_t t = x.size(0), heads = x.size(1), d = x.size(2);
  auto xf = f32(x);
  auto pos = positions.contiguous();
  auto freq = inv_freq(theta, d);
  auto out = at::empty_like(xf);
  const float* xp = xf.data_ptr<float>();
  const int64_t* pp = pos.data_ptr<int64_t>();
  const float* fp = freq.data_ptr<float>();
  float* op_ = out.data_ptr<float>();
  parallel_rows(t, [&](int64_t b, int64_t e) { rope_rows(xp, pp, fp, sign, op_, b, e, heads, d); });
  return out.to(x.scalar_type());
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& positions, double theta) {
  count_launch(kRope, kCpu);
  return rope_apply(x, positions, theta, 1.f, "rope");
}

at::Tensor rope_backward(const at::Tensor& grad_out, const at::Tensor& positions, double theta) {
  count_launch(kRopeBackward, kCpu);
  return rope_apply(grad_out, positions, theta, -1.f, "rope_backward");
}

}  // namespace

TORCH_LIBRARY_IMPL(rl_engine, CPU, m) {
  m.impl("rope", &rope);
  m.impl("rope_backward", &rope_backward);
}

}  // namespace rl_engine::cpu
