#include "kernel_counters.h"

#include <atomic>

#include <ATen/ATen.h>

namespace rl_engine {
namespace {
std::atomic<int64_t> g_counts[kNumKernels][2];
}  // namespace

void count_launch(KernelId id, KernelDevice device) {
  g_counts[id][device].fetch_add(1, std::memory_order_relaxed);
}

at::Tensor kernel_counters() {
  auto out = at::empty({kNumKernels, 2}, at::kLong);
  auto* p = out.data_ptr<int64_t>();
  for (int i = 0; i < kNumKernels; ++i) {
    for (int d = 0; d < 2; ++d) p[i * 2 + d] = g_counts[i][d].load(std::memory_order_relaxed);
  }
  return out;
}

void reset_kernel_counters() {
  for (auto& row : g_counts) {
    for (auto& c : row) c.store(0, std::memory_order_relaxed);
  }
}

bool sm90_compiled() {
#ifdef RL_ENGINE_WITH_SM90
  return true;
#else
  return false;
#endif
}

std::string build_info() {
#ifdef RL_ENGINE_BUILD_INFO
  return RL_ENGINE_BUILD_INFO;
#else
  return "{}";
#endif
}

}  // namespace rl_engine
