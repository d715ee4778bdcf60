// Fixed-order fp32 reductions shared by the CPU kernels. Every dot product in rl_engine's CPU
// kernels is this one: element k goes to lane k % kLanes in increasing k, and the lanes are added
// through one fixed tree. The compiler vectorises the lanes; no reassociation is left to it (the
// build passes -ffp-contract=off), so the bits depend only on the two input vectors.
#pragma once

#include <cstdint>

namespace rl_engine::cpu {

constexpr int kLanes = 8;

inline float lane_tree_sum(const float (&acc)[kLanes]) {
  const float a = (acc[0] + acc[4]) + (acc[2] + acc[6]);
  const float b = (acc[1] + acc[5]) + (acc[3] + acc[7]);
  return a + b;
}

inline float dot(const float* x, const float* y, int64_t n) {
  float acc[kLanes] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t k = 0;
  for (; k + kLanes <= n; k += kLanes) {
    for (int l = 0; l < kLanes; ++l) acc[l] += x[k + l] * y[k + l];
  }
  for (int l = 0; k + l < n; ++l) acc[l] += x[k + l] * y[k + l];
  return lane_tree_sum(acc);
}

// Strided dot product: sum_k x[k * sx] * y[k * sy] with the same lane rule.
inline float dot_strided(const float* x, int64_t sx, const float* y, int64_t sy, int64_t n) {
  float acc[kLanes] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  for (int64_t k = 0; k < n; ++k) acc[k % kLanes] += x[k * sx] * y[k * sy];
  return lane_tree_sum(acc);
}

}  // namespace rl_engine::cpu
