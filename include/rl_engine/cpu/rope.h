// Rotary embedding (Qwen3 / NeoX rotate-half) on fp32 buffers. For a token at position p and
// i < D/2: angle = float(p) * inv_freq[i], c = cos(angle), s = sin(angle), and
//   out[i] = x[i] c - x[i + D/2] s,   out[i + D/2] = x[i + D/2] c + x[i] s.
// cos and sin come from the scalar C library for each token, so a token's bits depend only on its
// position and its values (not on its index in the batch, nor on threading).
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

namespace rl_engine::cpu {

// x, out [T, heads, D]; positions [T]; inv_freq [D/2]. sign = +1 rotates by +angle (forward);
// sign = -1 rotates by -angle, the inverse rotation (the backward: the rotation is orthogonal, so
// its gradient is its transpose). Negating sin is exact, so sign = -1 is exactly the transpose.
inline void rope_rows(const float* x, const int64_t* positions, const float* inv_freq, float sign,
                      float* out, int64_t row_begin, int64_t row_end, int64_t heads, int64_t d) {
  const int64_t half = d / 2;
  std::vector<float> cs(static_cast<size_t>(d));
  float* c = cs.data();
  float* s = cs.data() + half;
  for (int64_t t = row_begin; t < row_end; ++t) {
    const float p = static_cast<float>(positions[t]);
    for (int64_t i = 0; i < half; ++i) {
      const float angle = p * inv_freq[i];
      c[i] = std::cos(angle);
      s[i] = sign * std::sin(angle);
    }
    for (int64_t hd = 0; hd < heads; ++hd) {
      const float* xr = x + (t * heads + hd) * d;
      float* o = out + (t * heads + hd) * d;
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = xr[i], x2 = xr[i + half];
        o[i] = x1 * c[i] - x2 * s[i];
        o[i + half] = x2 * c[i] + x1 * s[i];
      }
    }
  }
}

}  // namespace rl_engine::cpu
