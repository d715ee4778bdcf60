#include "ipc_layout.h"

#include <stdexcept>

#ifdef RL_ENGINE_WITH_SM90
#include "rl_engine/cuda/ipc_collectives.h"
#endif

namespace rl_engine {

std::vector<int64_t> ipc_layout(int64_t kind, int64_t numel, int64_t ranks, int64_t element_size) {
  if (kind < 0 || kind > 2 || numel < 0 || ranks < 1 ||
      (element_size != 2 && element_size != 4)) {
    throw std::invalid_argument(
        "rl_engine::ipc_layout: kind must be 0, 1 or 2, numel >= 0, ranks >= 1 and element_size "
        "2 or 4");
  }
#ifdef RL_ENGINE_WITH_SM90
  using cuda::IpcKind;
  const auto k = static_cast<IpcKind>(kind);
  return {cuda::ipc_flag_bytes(),
          cuda::ipc_stage_bytes(k, numel, static_cast<int>(ranks), static_cast<int>(element_size)),
          cuda::ipc_max_ranks(), cuda::ipc_max_blocks()};
#else
  return {0, 0, 0, 0};
#endif
}

}  // namespace rl_engine
