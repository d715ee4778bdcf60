// Torch glue of the CUDA IPC collectives: the shared buffers (allocate, export a handle, map a
// peer's) and the three collectives. Built by the host compiler, only in builds with the sm_90a
// kernels; csrc/cuda/ipc_collectives.cu only launches.
#ifdef RL_ENGINE_WITH_SM90

#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "kernel_counters.h"
#include "rl_engine/cuda/ipc_collectives.h"

namespace rl_engine::cuda {
namespace {

void check_cuda(cudaError_t e, const char* op, const char* what) {
  TORCH_CHECK(e == cudaSuccess, op, ": ", what, " failed: ", cudaGetErrorString(e));
}

at::TensorOptions bytes_on(const at::Tensor& like) {
  return at::TensorOptions().dtype(at::kByte).device(like.device());
}

at::Tensor ipc_buffer(const at::Tensor& like, int64_t bytes) {
  constexpr const char* op = "rl_engine::ipc_buffer";
  TORCH_CHECK(like.is_cuda(), op, ": like must be a CUDA tensor");
  TORCH_CHECK(bytes > 0, op, ": bytes must be positive, got ", std::to_string(bytes));
  c10::cuda::CUDAGuard guard(like.device());
  // A cudaMalloc of its own (not the caching allocator's), so the IPC handle covers exactly this
  // buffer and peers may map it for as long as this tensor lives.
  void* ptr = nullptr;
  check_cuda(cudaMalloc(&ptr, static_cast<size_t>(bytes)), op, "cudaMalloc");
  // Zeroed flags and epochs start every rank's barriers at the same count.
  check_cuda(cudaMemset(ptr, 0, static_cast<size_t>(bytes)), op, "cudaMemset");
  // Done before the handle leaves this process: a peer may store into the buffer at once.
  check_cuda(cudaDeviceSynchronize(), op, "cudaDeviceSynchronize");
  const int device = like.device().index();
  return at::from_blob(
      ptr, {bytes},
      [device](void* p) {
        c10::cuda::CUDAGuard g(static_cast<c10::DeviceIndex>(device));
        cudaDeviceSynchronize();  // no kernel of this process may still use it
        cudaFree(p);
      },
      bytes_on(like));
}

at::Tensor ipc_handle(const at::Tensor& buffer) {
  constexpr const char* op = "rl_engine::ipc_handle";
  TORCH_CHECK(buffer.is_cuda() && buffer.scalar_type() == at::kByte, op,
              ": buffer must be a uint8 CUDA tensor from ipc_buffer");
  c10::cuda::CUDAGuard guard(buffer.device());
  cudaIpcMemHandle_t handle;
  check_cuda(cudaIpcGetMemHandle(&handle, buffer.data_ptr()), op, "cudaIpcGetMemHandle");
  auto out = at::empty({static_cast<int64_t>(sizeof(handle))}, at::kByte);
  std::memcpy(out.data_ptr(), &handle, sizeof(handle));
  return out;
}

at::Tensor ipc_open(const at::Tensor& handle, const at::Tensor& like, int64_t bytes) {
  constexpr const char* op = "rl_engine::ipc_open";
  TORCH_CHECK(handle.device().is_cpu() && handle.scalar_type() == at::kByte &&
                  handle.numel() == static_cast<int64_t>(sizeof(cudaIpcMemHandle_t)),
              op, ": handle must be the CPU uint8 tensor that ipc_handle returned");
  TORCH_CHECK(like.is_cuda(), op, ": like must be a CUDA tensor");
  c10::cuda::CUDAGuard guard(like.device());
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle.contiguous().data_ptr(), sizeof(h));
  void* ptr = nullptr;
  check_cuda(cudaIpcOpenMemHandle(&ptr, h, cudaIpcMemLazyEnablePeerAccess), op,
             "cudaIpcOpenMemHandle (are the GPUs peers of one host?)");
  const int device = like.device().index();
  return at::from_blob(
      ptr, {bytes},
      [device](void* p) {
        c10::cuda::CUDAGuard g(static_cast<c10::DeviceIndex>(device));
        cudaDeviceSynchronize();
        cudaIpcCloseMemHandle(p);
      },
      bytes_on(like));
}

SumDType dtype_of(const at::Tensor& x, const char* op) {
  switch (x.scalar_type()) {
    case at::kBFloat16: return SumDType::kBF16;
    case at::kHalf: return SumDType::kF16;
    case at::kFloat: return SumDType::kF32;
    default: break;
  }
  TORCH_CHECK(false, op, ": x must be bf16, fp16 or fp32, got ", c10::toString(x.scalar_type()));
  return SumDType::kF32;  // not reached: the check throws
}

at::Tensor run(IpcKind kind, const char* op, const at::Tensor& x, at::TensorList buffers,
               int64_t rank, const at::Tensor& epochs, int64_t max_blocks) {
  static constexpr KernelId kIds[] = {kIpcAllGather, kIpcReduceScatter, kIpcAllReduce};
  const int64_t ranks = static_cast<int64_t>(buffers.size());
  TORCH_CHECK(ranks >= 1 && ranks <= ipc_max_ranks(), op, ": between 1 and ",
              std::to_string(ipc_max_ranks()), " buffers, got ", std::to_string(ranks));
  TORCH_CHECK(rank >= 0 && rank < ranks, op, ": rank ", std::to_string(rank), " outside 0..",
              std::to_string(ranks - 1));
  TORCH_CHECK(x.is_cuda() && x.is_contiguous(), op, ": x must be a contiguous CUDA tensor");
  TORCH_CHECK(epochs.is_cuda() && epochs.scalar_type() == at::kLong &&
                  epochs.numel() == ipc_max_blocks(),
              op, ": epochs must be int64 CUDA [", std::to_string(ipc_max_blocks()), "]");
  TORCH_CHECK(max_blocks >= 1 && max_blocks <= ipc_max_blocks(), op, ": max_blocks must be in 1..",
              std::to_string(ipc_max_blocks()));
  const SumDType dt = dtype_of(x, op);
  TORCH_CHECK(kind != IpcKind::kReduceScatter || (x.dim() >= 1 && x.size(0) % ranks == 0), op,
              ": x's dim 0 must be divisible by the ", std::to_string(ranks), " ranks");
  const int64_t numel = kind == IpcKind::kReduceScatter ? x.numel() / ranks : x.numel();
  const int es = static_cast<int>(x.element_size());
  const int64_t need = ipc_flag_bytes() + ipc_stage_bytes(kind, numel, ranks, es);
  std::vector<char*> bases(ranks);
  for (int64_t p = 0; p < ranks; ++p) {
    const auto& b = buffers[p];
    TORCH_CHECK(b.is_cuda() && b.device() == x.device() && b.numel() >= need, op, ": buffer ",
                std::to_string(p), " must be on x's device with at least ", std::to_string(need),
                " bytes (the communicator grows its buffers before a larger message)");
    bases[p] = static_cast<char*>(b.data_ptr());
  }
  std::vector<int64_t> shape = x.sizes().vec();
  if (kind == IpcKind::kAllGather) shape.at(0) *= ranks;
  if (kind == IpcKind::kReduceScatter) shape.at(0) /= ranks;
  c10::cuda::CUDAGuard guard(x.device());
  auto out = at::empty(shape, x.options());
  // Counted even for an empty message: the routing layer asks that an R collective launched.
  count_launch(kIds[static_cast<int>(kind)], kCuda);
  if (numel == 0) return out;
  const int64_t slot = ipc_slot_elems(kind, numel, static_cast<int>(ranks), es);
  const int64_t per_block = int64_t{512} * (16 / es);
  const int64_t want = (slot + per_block - 1) / per_block;
  const int blocks = static_cast<int>(want < max_blocks ? want : max_blocks);
  const cudaError_t e = ipc_collective_launch(
      kind, dt, bases.data(), static_cast<int>(rank), static_cast<int>(ranks), x.data_ptr(), numel,
      out.data_ptr(), reinterpret_cast<uint64_t*>(epochs.data_ptr<int64_t>()), blocks,
      c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(e == cudaSuccess, op, ": CUDA launch failed: ", cudaGetErrorString(e));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor ipc_all_gather(const at::Tensor& x, at::TensorList buffers, int64_t rank,
                          const at::Tensor& epochs, int64_t max_blocks) {
  return run(IpcKind::kAllGather, "rl_engine::ipc_all_gather", x, buffers, rank, epochs,
             max_blocks);
}

at::Tensor ipc_reduce_scatter(const at::Tensor& x, at::TensorList buffers, int64_t rank,
                              const at::Tensor& epochs, int64_t max_blocks) {
  return run(IpcKind::kReduceScatter, "rl_engine::ipc_reduce_scatter", x, buffers, rank, epochs,
             max_blocks);
}

at::Tensor ipc_all_reduce(const at::Tensor& x, at::TensorList buffers, int64_t rank,
                          const at::Tensor& epochs, int64_t max_blocks) {
  return run(IpcKind::kAllReduce, "rl_engine::ipc_all_reduce", x, buffers, rank, epochs,
             max_blocks);
}

}  // namespace

TORCH_LIBRARY_IMPL(rl_engine, CUDA, m) {
  m.impl("ipc_buffer", &ipc_buffer);
  m.impl("ipc_handle", &ipc_handle);
  m.impl("ipc_open", &ipc_open);
  m.impl("ipc_all_gather", &ipc_all_gather);
  m.impl("ipc_reduce_scatter", &ipc_reduce_scatter);
  m.impl("ipc_all_reduce", &ipc_all_reduce);
}

}  // namespace rl_engine::cuda

#endif  // RL_ENGINE_WITH_SM90
