// Torch glue shared by the CUDA launchers: argument checks, dtype mapping, operands laid out for
// the bulk tensor copy, and the GEMM dispatcher (defined in det_gemm.cu) that linear_logp reuses.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <climits>
#include <optional>

#include "rl_engine/cuda/transpose.cuh"
#include "rl_engine/cuda/types.cuh"

namespace rl_engine::cuda {

inline void check_float(const at::Tensor& t, const char* op, const char* name) {
  const auto d = t.scalar_type();
  TORCH_CHECK(d == at::kBFloat16 || d == at::kHalf || d == at::kFloat, op, ": ", name,
              " must be bf16, fp16 or fp32, got ", d);
}

inline void check_on(const at::Tensor& t, const at::Tensor& ref, const char* op, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.device() == ref.device(), op, ": ", name, " must be on ", ref.device(),
              ", got ", t.device());
}

inline DType dtype_of(at::ScalarType s) {
  return s == at::kBFloat16 ? DType::kBF16 : s == at::kHalf ? DType::kF16 : DType::kF32;
}

inline bool aligned16(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

inline int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

inline int sm_count() { return at::cuda::getCurrentDeviceProperties()->multiProcessorCount; }

inline void check_launch(cudaError_t e, const char* op) {
  TORCH_CHECK(e == cudaSuccess, op, ": CUDA launch failed: ", cudaGetErrorString(e));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// A 2-D matrix whose rows start on 16-byte boundaries (what the bulk tensor copy needs): the input
// itself when it already is one, else a copy into a buffer with padded rows (the padding is never
// read: the tensor map's width is the true one).
inline at::Tensor tma_rows(const at::Tensor& t) {
  const int64_t es = t.element_size();
  if (t.stride(1) == 1 && (t.stride(0) * es) % 16 == 0 && t.stride(0) >= t.size(1) && aligned16(t)) {
    return t;
  }
  auto buf = at::empty({t.size(0), round_up(std::max<int64_t>(t.size(1), 1), 16 / es)}, t.options());
  auto view = buf.narrow(1, 0, t.size(1));
  view.copy_(t);
  return view;
}

// t^T [cols, rows] with 16-byte aligned rows in one pass of the tiled transpose (16-bit types;
// fp32 goes through torch, its GEMM path needs no alignment).
inline at::Tensor transposed_rows(const at::Tensor& t, const char* op) {
  if (t.element_size() != 2) return t.t().contiguous();
  const auto src = t.stride(1) == 1 ? t : t.contiguous();
  const int64_t rows = src.size(0), cols = src.size(1);
  TORCH_CHECK(rows <= int64_t{65535} * 64 && cols <= INT_MAX, op, ": matrix too large to transpose: ",
              src.sizes());
  auto buf = at::empty({cols, round_up(std::max<int64_t>(rows, 1), 8)}, t.options());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const auto launch = [&](auto tag) {
    using T = decltype(tag);
    return launch_transpose<T>(reinterpret_cast<const T*>(src.data_ptr()), src.stride(0),
                               static_cast<int>(rows), static_cast<int>(cols),
                               reinterpret_cast<T*>(buf.data_ptr()), buf.stride(0), stream);
  };
  check_launch(t.scalar_type() == at::kHalf ? launch(__half{}) : launch(__nv_bfloat16{}), op);
  return buf.narrow(1, 0, rows);
}

struct GemmPlan;  // include/rl_engine/cuda/det_gemm.cuh

// out[m, n] (=|+=) a[m, k] . b[n, k]^T (+ bias[n]): bf16/fp16 pairs go to the sm_90a kernel, anything
// else to the fp32 kernel after an exact upcast. out may be a row-strided view; bias is fp32.
// split_k: K in ranges chosen by N and K (plan_det_gemm), or in one range for a product that must
// repeat an unsplit kernel's bits (linear_logp's logits recompute). fp32 operands ignore it.
// plan: one of det_gemm_plan_options' plans to run instead of plan_det_gemm's pick (the hook through
// which the benchmark and the tests reach every plan); split_k is then ignored.
void gemm_into(const at::Tensor& a, const at::Tensor& b, at::Tensor& out,
               const std::optional<at::Tensor>& bias, bool accumulate, const char* op, bool split_k,
               const GemmPlan* plan = nullptr);

}  // namespace rl_engine::cuda
