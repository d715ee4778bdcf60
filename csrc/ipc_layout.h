// The buffer layout of the CUDA IPC collectives, for the Python communicator that allocates and
// shares the buffers (zeros in a build without the sm_90a kernels).
#pragma once

#include <cstdint>
#include <vector>

namespace rl_engine {

// {flag bytes, staging bytes the collective needs, most ranks, most grid blocks}.
std::vector<int64_t> ipc_layout(int64_t kind, int64_t numel, int64_t ranks, int64_t element_size);

}  // namespace rl_engine
