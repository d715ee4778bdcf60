// SwiGLU on fp32 buffers: gate_up[t] = [gate | up] (2I values), out[t, i] = silu(gate[i]) * up[i]
// with silu(g) = g / (1 + exp(-g)). Elementwise, so every value depends only on its own inputs.
#pragma once

#include <cmath>
#include <cstdint>

namespace rl_engine::cpu {

// gate_up [T, 2I], out [T, I]; rows in [row_begin, row_end).
inline void swiglu_rows(const float* gate_up, float* out, int64_t row_begin, int64_t row_end,
                        int64_t inter) {
  for (int64_t t = row_begin; t < row_end; ++t) {
    const float* gate = gate_up + t * 2 * inter;
    const float* up = gate + inter;
    float* o = out + t * inter;
    for (int64_t i = 0; i < inter; ++i) {
      const float g = gate[i];
      o[i] = (g / (1.f + std::exp(-g))) * up[i];
    }
  }
}

// d gate[i] = (dy[i] * up[i]) * sig * (1 + g (1 - sig)), d up[i] = dy[i] * silu(g), with
// sig = 1 / (1 + exp(-g)); the same factors (and order) as torch's silu backward.
inline void swiglu_backward_rows(const float* grad_out, const float* gate_up, float* grad,
                                 int64_t row_begin, int64_t row_end, int64_t inter) {
  for (int64_t t = row_begin; t < row_end; ++t) {
    const float* gate = gate_up + t * 2 * inter;
    const float* up = gate + inter;
    const float* dy = grad_out + t * inter;
    float* dgate = grad + t * 2 * inter;
    float* dup = dgate + inter;
    for (int64_t i = 0; i < inter; ++i) {
      const float g = gate[i];
      const float e = 1.f + std::exp(-g);
      const float sig = 1.f / e;
      dgate[i] = ((dy[i] * up[i]) * sig) * (1.f + g * (1.f - sig));
      dup[i] = dy[i] * (g / e);
    }
  }
}

}  // namespace rl_engine::cpu
