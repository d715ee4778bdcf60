// CUDA launchers of rmsnorm, rope and swiglu (forward and backward). Inputs of one dtype run in
// it (fp32 arithmetic, one rounding at the store); mixed dtypes are upcast to fp32 exactly and the
// result rounded once to the output dtype. Kernel shapes depend only on the row width and dtype:
// operands are made contiguous and 16-byte aligned so the access width never depends on the call.
#include <torch/library.h>

#include <type_traits>

#include "cuda/glue.cuh"
#include "kernel_counters.h"
#include "rl_engine/cuda/rmsnorm.cuh"
#include "rl_engine/cuda/rope.cuh"
#include "rl_engine/cuda/swiglu.cuh"

namespace rl_engine::cuda {
namespace {

at::Tensor dense(const at::Tensor& t, at::ScalarType dtype) {
  auto c = t.to(dtype).contiguous();
  return aligned16(c) ? c : c.clone();
}

int blocks_for(int64_t work) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((work + 255) / 256, sm_count() * 32LL)));
}

// Dispatch on the element type T and the access width V (16 bytes when width % (16 / size) == 0).
template <typename F>
void dispatch(at::ScalarType s, int64_t width, F&& f) {
  auto go = [&](auto tag) {
    using T = decltype(tag);
    if (width % kVec16<T> == 0) f(T{}, std::integral_constant<int, kVec16<T>>{});
    else f(T{}, std::integral_constant<int, 1>{});
  };
  if (s == at::kBFloat16) go(__nv_bfloat16{});
  else if (s == at::kHalf) go(__half{});
  else go(float{});
}

// Row group size from the vectors per row (each thread holds at most kRmsMaxV of them): a function
// of H and the dtype only, so every call on rows of one width runs one reduction tree.
int group_for(int64_t nv, const char* op) {
  for (const int g : {16, 32, 128, 512, 1024}) {
    if (nv <= int64_t{g} * kRmsMaxV) return g;
  }
  TORCH_CHECK(false, op, ": rows of ", nv, " vectors are wider than this kernel handles");
}

// launch(tag, vec, grp) for rows of h elements of dtype dt: the element type, the vector width
// and the row group of both RMSNorm kernels.
template <typename L>
void with_norm_layout(at::ScalarType dt, int64_t h, const char* op, L&& launch) {
  dispatch(dt, h, [&](auto tag, auto vec) {
    const auto go = [&](auto grp) { launch(tag, vec, grp); };
    switch (group_for(h / decltype(vec)::value, op)) {
      case 16: go(std::integral_constant<int, 16>{}); break;
      case 32: go(std::integral_constant<int, 32>{}); break;
      case 128: go(std::integral_constant<int, 128>{}); break;
      case 512: go(std::integral_constant<int, 512>{}); break;
      default: go(std::integral_constant<int, 1024>{}); break;
    }
  });
}

void check_norm(const at::Tensor& x, const at::Tensor& weight, const char* op) {
  check_float(x, op, "x");
  check_float(weight, op, "weight");
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && weight.size(0) > 0 && x.size(-1) == weight.size(0),
              op, ": x [..., H] and weight [H] must agree on H > 0, got x ", x.sizes(), " and weight ",
              weight.sizes());
  check_on(weight, x, op, "weight");
}

std::tuple<at::Tensor, at::Tensor> rmsnorm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  constexpr const char* op = "rl_engine::rmsnorm";
  check_norm(x, weight, op);
  c10::cuda::CUDAGuard guard(x.device());
  count_launch(kRmsnorm, kCuda);
  const int64_t h = weight.size(0);
  const auto dt = weight.scalar_type() == x.scalar_type() ? x.scalar_type() : at::kFloat;
  const auto x2 = dense(x.reshape({-1, h}), dt), w = dense(weight, dt);
  const int64_t rows = x2.size(0);
  auto out = at::empty({rows, h}, x2.options());
  auto rstd = at::empty({rows}, x2.options().dtype(at::kFloat));
  if (rows > 0) {
    with_norm_layout(dt, h, op, [&](auto tag, auto vec, auto grp) {
      using T = decltype(tag);
      constexpr int V = decltype(vec)::value, G = decltype(grp)::value;
      const int block = rms_block<G>(), per_block = block / G;
      rlk_rmsnorm_fwd_kernel<T, G, V><<<(rows + per_block - 1) / per_block, block, 0,
                                       at::cuda::getCurrentCUDAStream()>>>(
          reinterpret_cast<const T*>(x2.data_ptr()), reinterpret_cast<const T*>(w.data_ptr()),
          reinterpret_cast<T*>(out.data_ptr()), rstd.data_ptr<float>(), rows, static_cast<int>(h),
          1.f / static_cast<float>(h), static_cast<float>(eps));
    });
    check_launch(cudaGetLastError(), op);
  }
  return {out.to(x.scalar_type()).reshape(x.sizes()), rstd.reshape(x.sizes().slice(0, x.dim() - 1))};
}

std::tuple<at::Tensor, at::Tensor> rmsnorm_backward(const at::Tensor& grad_out, const at::Tensor& x,
                                                    const at::Tensor& weight, const at::Tensor& rstd) {
  constexpr const char* op = "rl_engine::rmsnorm_backward";
  check_norm(x, weight, op);
  check_float(grad_out, op, "grad_out");
  TORCH_CHECK(grad_out.sizes() == x.sizes(), op, ": grad_out must have x's shape ", x.sizes());
  check_on(grad_out, x, op, "grad_out");
  check_on(rstd, x, op, "rstd");
  c10::cuda::CUDAGuard guard(x.device());
  count_launch(kRmsnormBackward, kCuda);
  const int64_t h = weight.size(0);
  const bool same = grad_out.scalar_type() == x.scalar_type() && weight.scalar_type() == x.scalar_type();
  const auto dt = same ? x.scalar_type() : at::kFloat;
  const auto x2 = dense(x.reshape({-1, h}), dt), g2 = dense(grad_out.reshape({-1, h}), dt);
  const auto w = dense(weight, dt), rs = dense(rstd.reshape({-1}), at::kFloat);
  const int64_t rows = x2.size(0);
  TORCH_CHECK(rs.numel() == rows, op, ": rstd must have one value per row (", rows, ")");
  auto dx = at::empty({rows, h}, x2.options());
  const auto f32 = x2.options().dtype(at::kFloat);
  if (rows == 0) return {dx.to(x.scalar_type()).reshape(x.sizes()), at::zeros({h}, f32)};
  auto dw = at::empty({h}, f32);  // the tree's last level writes every column
  const int slices = static_cast<int>((h + kRmsTreeThreads - 1) / kRmsTreeThreads);
  auto done = at::empty({slices}, x2.options().dtype(at::kInt));  // cleared by the backward kernel
  auto* done_ptr = reinterpret_cast<unsigned*>(done.data_ptr<int32_t>());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  at::Tensor part, level;
  int64_t groups = 0, rows1 = 0;  // group partials, and the tree's first level
  with_norm_layout(dt, h, op, [&](auto tag, auto vec, auto grp) {
    using T = decltype(tag);
    constexpr int V = decltype(vec)::value, G = decltype(grp)::value;
    const int block = rms_block<G>(), per_block = block / G;
    const int subs = rms_bwd_subs(rows, h, per_block);
    groups = (rows + kRmsChunk * subs - 1) / (kRmsChunk * subs);
    rows1 = (groups + kRmsFanIn - 1) / kRmsFanIn;
    part = at::empty({groups, h}, f32);
    level = at::empty({rows1 > 1 ? rows1 : 0, h}, f32);
    const int smem = static_cast<int>((subs > 1 ? 2 : 1) * per_block * h * sizeof(float));
    if (smem > 48 * 1024) {
      check_launch(cudaFuncSetAttribute(rlk_rmsnorm_bwd_kernel<T, G, V>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, smem), op);
    }
    rlk_rmsnorm_bwd_kernel<T, G, V><<<(groups + per_block - 1) / per_block, block, smem, stream>>>(
        reinterpret_cast<const T*>(g2.data_ptr()), reinterpret_cast<const T*>(x2.data_ptr()),
        reinterpret_cast<const T*>(w.data_ptr()), rs.data_ptr<float>(),
        reinterpret_cast<T*>(dx.data_ptr()), part.data_ptr<float>(), rows, static_cast<int>(h),
        1.f / static_cast<float>(h), subs, done_ptr, slices);
  });
  check_launch(cudaGetLastError(), op);
  rlk_rmsnorm_column_tree_kernel<<<dim3(static_cast<unsigned>(rows1), slices), kRmsTreeThreads, 0, stream>>>(
      part.data_ptr<float>(), groups, static_cast<int>(h), level.data_ptr<float>(), dw.data_ptr<float>(),
      done_ptr);
  check_launch(cudaGetLastError(), op);
  return {dx.to(x.scalar_type()).reshape(x.sizes()), dw};
}

at::Tensor rope_apply(const at::Tensor& x, const at::Tensor& positions, double theta, float sign,
                      const char* op) {
  check_float(x, op, "x");
  TORCH_CHECK(x.dim() == 3 && x.size(2) > 0 && x.size(2) % 2 == 0, op,
              ": expected [T, heads, D] with D even, got ", x.sizes());
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 && positions.size(0) == x.size(0),
              op, ": positions must be int64 [T] with T = ", x.size(0), ", got ", positions.scalar_type(),
              " ", positions.sizes());
  TORCH_CHECK(theta > 0, op, ": theta must be positive, got ", theta);
  check_on(positions, x, op, "positions");
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t t = x.size(0), heads = x.size(1), d = x.size(2);
  const auto xc = dense(x, x.scalar_type());
  const auto pos = positions.contiguous();
  // inv_freq = 1 / theta ** (arange(0, D, 2) / D) in fp32, the tensor ops of the CPU kernel and of
  // the Hugging Face rotary embedding.
  const auto exps = at::arange(0, d, 2, x.options().dtype(at::kFloat)).div(d);
  const auto inv_freq = at::reciprocal(at::pow(theta, exps)).contiguous();
  auto out = at::empty_like(xc);
  if (xc.numel() > 0) {
    dispatch(x.scalar_type(), d / 2, [&](auto tag, auto vec) {
      using T = decltype(tag);
      constexpr int V = decltype(vec)::value;
      const int64_t work = t * ((heads + kRopeHeads - 1) / kRopeHeads) * (d / 2 / V);
      rlk_rope_kernel<T, V><<<(work + 255) / 256, 256, 0, at::cuda::getCurrentCUDAStream()>>>(
          reinterpret_cast<const T*>(xc.data_ptr()), pos.data_ptr<int64_t>(),
          inv_freq.data_ptr<float>(), sign, reinterpret_cast<T*>(out.data_ptr()), t,
          static_cast<int>(heads), static_cast<int>(d));
    });
    check_launch(cudaGetLastError(), op);
  }
  return out;
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& positions, double theta) {
  count_launch(kRope, kCuda);
  return rope_apply(x, positions, theta, 1.f, "rl_engine::rope");
}

at::Tensor rope_backward(const at::Tensor& grad_out, const at::Tensor& positions, double theta) {
  count_launch(kRopeBackward, kCuda);
  return rope_apply(grad_out, positions, theta, -1.f, "rl_engine::rope_backward");
}

at::Tensor swiglu(const at::Tensor& gate_up) {
  constexpr const char* op = "rl_engine::swiglu";
  check_float(gate_up, op, "gate_up");
  TORCH_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0, op, ": gate_up must be [..., 2I], got ",
              gate_up.sizes());
  c10::cuda::CUDAGuard guard(gate_up.device());
  count_launch(kSwiglu, kCuda);
  const int64_t inter = gate_up.size(-1) / 2;
  const auto gu = dense(gate_up.reshape({-1, 2 * inter}), gate_up.scalar_type());
  const int64_t tokens = gu.size(0);
  auto out = at::empty({tokens, inter}, gu.options());
  if (out.numel() > 0) {
    dispatch(gu.scalar_type(), inter, [&](auto tag, auto vec) {
      using T = decltype(tag);
      constexpr int V = decltype(vec)::value;
      rlk_swiglu_kernel<T, V><<<blocks_for(tokens * (inter / V)), 256, 0, at::cuda::getCurrentCUDAStream()>>>(
          reinterpret_cast<const T*>(gu.data_ptr()), reinterpret_cast<T*>(out.data_ptr()), tokens,
          static_cast<int>(inter));
    });
    check_launch(cudaGetLastError(), op);
  }
  auto sizes = gate_up.sizes().vec();
  sizes.back() = inter;
  return out.reshape(sizes);
}

at::Tensor swiglu_backward(const at::Tensor& grad_out, const at::Tensor& gate_up) {
  constexpr const char* op = "rl_engine::swiglu_backward";
  check_float(grad_out, op, "grad_out");
  check_float(gate_up, op, "gate_up");
  TORCH_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0 && grad_out.dim() == gate_up.dim() &&
                  grad_out.size(-1) * 2 == gate_up.size(-1) && grad_out.numel() * 2 == gate_up.numel(),
              op, ": grad_out [..., I] and gate_up [..., 2I] disagree: ", grad_out.sizes(), " and ",
              gate_up.sizes());
  check_on(grad_out, gate_up, op, "grad_out");
  c10::cuda::CUDAGuard guard(gate_up.device());
  count_launch(kSwigluBackward, kCuda);
  const int64_t inter = gate_up.size(-1) / 2;
  const auto dt = grad_out.scalar_type() == gate_up.scalar_type() ? gate_up.scalar_type() : at::kFloat;
  const auto gu = dense(gate_up.reshape({-1, 2 * inter}), dt), dy = dense(grad_out.reshape({-1, inter}), dt);
  const int64_t tokens = gu.size(0);
  auto grad = at::empty({tokens, 2 * inter}, gu.options());
  if (grad.numel() > 0) {
    dispatch(dt, inter, [&](auto tag, auto vec) {
      using T = decltype(tag);
      constexpr int V = decltype(vec)::value;
      rlk_swiglu_bwd_kernel<T, V><<<blocks_for(tokens * (inter / V)), 256, 0, at::cuda::getCurrentCUDAStream()>>>(
          reinterpret_cast<const T*>(dy.data_ptr()), reinterpret_cast<const T*>(gu.data_ptr()),
          reinterpret_cast<T*>(grad.data_ptr()), tokens, static_cast<int>(inter));
    });
    check_launch(cudaGetLastError(), op);
  }
  return grad.to(gate_up.scalar_type()).reshape(gate_up.sizes());
}

}  // namespace

TORCH_LIBRARY_IMPL(rl_engine, CUDA, m) {
  m.impl("rmsnorm", &rmsnorm);
  m.impl("rmsnorm_backward", &rmsnorm_backward);
  m.impl("rope", &rope);
  m.impl("rope_backward", &rope_backward);
  m.impl("swiglu", &swiglu);
  m.impl("swiglu_backward", &swiglu_backward);
}

}  // namespace rl_engine::cuda
