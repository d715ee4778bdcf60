// Launch counters: each kernel launcher calls count_launch() so that readbacks report what ran,
// not what the routing layer meant to run.
#pragma once

#include <string>

#include <ATen/core/Tensor.h>

#include "rl_engine/kernel_ids.h"

namespace rl_engine {

void count_launch(KernelId id, KernelDevice device);
at::Tensor kernel_counters();
void reset_kernel_counters();
bool sm90_compiled();
std::string build_info();

}  // namespace rl_engine
