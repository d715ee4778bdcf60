// Shared glue of the CPU launchers: inputs go to contiguous fp32 (exact for bf16/fp16), outputs
// come back with one rounding; work is split over independent output rows only.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

namespace rl_engine::cpu {

inline at::Tensor f32(const at::Tensor& t) { return t.to(at::kFloat).contiguous(); }

inline void check_float_dtype(const at::Tensor& t, const char* name) {
  const auto d = t.scalar_type();
  TORCH_CHECK(d == at::kBFloat16 || d == at::kHalf || d == at::kFloat, "rl_engine: ", name,
              " must be bf16, fp16 or fp32, got ", d);
}

template <typename F>
void parallel_rows(int64_t rows, F&& fn) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) { fn(begin, end); });
}

}  // namespace rl_engine::cpu
