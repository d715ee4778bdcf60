// The CUDA IPC collectives' host entry points: slot sizes, the access width and the launch. No
// torch here (the glue is csrc/cuda/ipc_collectives_op.cpp).
#include <cstdint>

#include "rl_engine/cuda/ipc_collectives.cuh"
#include "rl_engine/cuda/ipc_collectives.h"

namespace rl_engine::cuda {

namespace {

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

int64_t round_up(int64_t a, int64_t b) { return (a + b - 1) / b * b; }

template <typename T>
cudaError_t launch_for(IpcKind kind, const IpcPeers& peers, int rank, int ranks, const void* x,
                       int64_t numel, void* out, uint64_t* epochs, int blocks,
                       cudaStream_t stream) {
  constexpr int V = kVec16<T>;
  const T* xt = static_cast<const T*>(x);
  T* ot = static_cast<T*>(out);
  const int64_t slot = ipc_slot_elems(kind, numel, ranks, sizeof(T));
  // 16-byte accesses of the user's tensors only where every vector they touch is aligned; the
  // staging slots always are. The bits do not depend on the width.
  const bool wide_x = aligned16(x) && (kind != IpcKind::kReduceScatter || numel % V == 0);
  const bool wide_out = aligned16(out) && (kind != IpcKind::kAllGather || numel % V == 0);
  switch (kind) {
    case IpcKind::kAllGather:
      rlk_ipc_all_gather_kernel<T, V><<<blocks, kIpcThreads, 0, stream>>>(
          peers, rank, ranks, xt, numel, slot, ot, wide_x, wide_out, epochs);
      break;
    case IpcKind::kReduceScatter:
      rlk_ipc_reduce_scatter_kernel<T, V><<<blocks, kIpcThreads, 0, stream>>>(
          peers, rank, ranks, xt, numel, slot, ot, wide_x, wide_out, epochs);
      break;
    case IpcKind::kAllReduce:
      rlk_ipc_all_reduce_kernel<T, V><<<blocks, kIpcThreads, 0, stream>>>(
          peers, rank, ranks, xt, numel, slot, ot, wide_x, wide_out, epochs);
      break;
  }
  return cudaGetLastError();
}

}  // namespace

int64_t ipc_flag_bytes() { return kIpcFlagBytes; }
int ipc_max_ranks() { return kIpcMaxRanks; }
int ipc_max_blocks() { return kIpcMaxBlocks; }

int64_t ipc_slot_elems(IpcKind kind, int64_t numel, int ranks, int element_size) {
  const int64_t vec = 16 / element_size;
  if (kind == IpcKind::kAllReduce) return round_up((numel + ranks - 1) / ranks, vec);
  return round_up(numel, vec);
}

int64_t ipc_stage_bytes(IpcKind kind, int64_t numel, int ranks, int element_size) {
  const int64_t slots = kind == IpcKind::kAllReduce ? 2 * ranks : ranks;
  return slots * ipc_slot_elems(kind, numel, ranks, element_size) * element_size;
}

cudaError_t ipc_collective_launch(IpcKind kind, SumDType dtype, char* const* bases, int rank,
                                  int ranks, const void* x, int64_t numel, void* out,
                                  uint64_t* epochs, int blocks, cudaStream_t stream) {
  if (ranks < 1 || ranks > kIpcMaxRanks || rank < 0 || rank >= ranks || blocks < 1 ||
      blocks > kIpcMaxBlocks || numel < 0) {
    return cudaErrorInvalidValue;
  }
  IpcPeers peers{};
  for (int p = 0; p < ranks; ++p) peers.base[p] = bases[p];
  switch (dtype) {
    case SumDType::kBF16:
      return launch_for<__nv_bfloat16>(kind, peers, rank, ranks, x, numel, out, epochs, blocks,
                                       stream);
    case SumDType::kF16:
      return launch_for<__half>(kind, peers, rank, ranks, x, numel, out, epochs, blocks, stream);
    case SumDType::kF32:
      return launch_for<float>(kind, peers, rank, ranks, x, numel, out, epochs, blocks, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace rl_engine::cuda
