// Host entry points of the CUDA IPC collectives (kernels in ipc_collectives.cuh, entries defined
// in csrc/cuda/ipc_collectives.cu). Plain C++ for the host-compiled torch glue.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "rl_engine/cuda/rank_order_sum.h"

namespace rl_engine::cuda {

enum class IpcKind : int { kAllGather = 0, kReduceScatter = 1, kAllReduce = 2 };

// Bytes of the flag area at the start of every IPC buffer, and the most ranks and blocks.
int64_t ipc_flag_bytes();
int ipc_max_ranks();
int ipc_max_blocks();

// Elements of one staging slot for a collective of `numel` elements per rank (all_gather: the
// input; reduce_scatter: the output share; all_reduce: the whole tensor) with this element size.
int64_t ipc_slot_elems(IpcKind kind, int64_t numel, int ranks, int element_size);
// Staging bytes a collective needs in every rank's buffer after the flag area.
int64_t ipc_stage_bytes(IpcKind kind, int64_t numel, int ranks, int element_size);

// Launches one collective. bases[p]: rank p's buffer mapped here (bases[rank] is this rank's own).
// numel as for ipc_slot_elems; x and out as the kind needs (all_gather: out holds ranks * numel;
// reduce_scatter: x holds ranks * numel). epochs: max_blocks zeroed uint64 counters private to this
// rank's communicator. blocks: the grid, the same on every rank.
cudaError_t ipc_collective_launch(IpcKind kind, SumDType dtype, char* const* bases, int rank,
                                  int ranks, const void* x, int64_t numel, void* out,
                                  uint64_t* epochs, int blocks, cudaStream_t stream);

}  // namespace rl_engine::cuda
