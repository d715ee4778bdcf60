// CPU launchers of swiglu and its backward.
#include "rl_engine/cpu/swiglu.h"

#include <torch/library.h>

#include "cpu/common.h"
#include "kernel_counters.h"

namespace rl_engine::cpu {
namespace {

int64_t check_gate_up(const at::Tensor& gate_up, const char* op) {
  check_float_dtype(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) > 0 && gate_up.size(-1) % 2 == 0,
              "rl_engine::", op, ": gate_up must be [..., 2I] with I > 0, got ", gate_up.sizes());
  return gate_up.size(-1) / 2;
}

at::Tensor swiglu(const at::Tensor& gate_up) {
  const int64_t inter = check_gate_up(gate_up, "swiglu");
  count_launch(kSwiglu, kCpu);
  auto gu = f32(gate_up.reshape({-1, 2 * inter}));
  const int64_t rows = gu.size(0);
  auto out = at::empty({rows, inter}, gu.options());
  const float* gp = gu.data_ptr<float>();
  float* op = out.data_ptr<float>();
  parallel_rows(rows, [&](int64_t b, int64_t e) { swiglu_rows(gp, op, b, e, inter); });
  auto sizes = gate_up.sizes().vec();
  sizes.back() = inter;
  return out.to(gate_up.scalar_type()).reshape(sizes);
}

at::Tensor swiglu_backward(const at::Tensor& grad_out, const at::Tensor& gate_up) {
  const int64_t inter = check_gate_up(gate_up, "swiglu_backward");
  check_float_dtype(grad_out, "grad_out");
  auto expected = gate_up.sizes().vec();
  expected.back() = inter;
  TORCH_CHECK(grad_out.sizes() == at::IntArrayRef(expected), "rl_engine::swiglu_backward: grad_out "
              "must be ", at::IntArrayRef(expected), " for gate_up ", gate_up.sizes(), ", got ",
              grad_out.sizes());
  count_launch(kSwigluBackward, kCpu);
  auto gu = f32(gate_up.reshape({-1, 2 * inter}));
  auto dy = f32(grad_out.reshape({-1, inter}));
  const int64_t rows = gu.size(0);
  auto grad = at::empty({rows, 2 * inter}, gu.options());
  const float* gp = gu.data_ptr<float>();
  const float* dp = dy.data_ptr<float>();
  float* op = grad.data_ptr<float>();
  parallel_rows(rows, [&](int64_t b, int64_t e) { swiglu_backward_rows(dp, gp, op, b, e, inter); });
  return grad.to(gate_up.scalar_type()).reshape(gate_up.sizes());
}

}  // namespace

TORCH_LIBRARY_IMPL(rl_engine, CPU, m) {
  m.impl("swiglu", &swiglu);
  m.impl("swiglu_backward", &swiglu_backward);
}

}  // namespace rl_engine::cpu
