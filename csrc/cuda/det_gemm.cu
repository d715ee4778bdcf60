// CUDA launchers of det_gemm and its two backward products. All three are one batch-invariant
// GEMM (include/rl_engine/cuda/det_gemm.cuh): the backward products pass transposed views, which
// the large tiles read in place as MN-major operands and the others through a transposed copy,
// with the same bits either way, so every output element is one fixed-order reduction.
#include "rl_engine/cuda/det_gemm.cuh"

#include <torch/library.h>

#include <climits>
#include <vector>

#include "cuda/det_gemm_instances.h"
#include "cuda/glue.cuh"
#include "kernel_counters.h"

namespace rl_engine::cuda {
namespace {

template <typename Out>
void gemm_store(const GemmOperands& g, const GemmPlan& plan, at::Tensor& out, const float* bias,
                bool accumulate, const char* op) {
  Out* p = reinterpret_cast<Out*>(out.data_ptr());
  const bool pairs = out.stride(0) % 2 == 0 && reinterpret_cast<uintptr_t>(p) % (2 * sizeof(Out)) == 0;
  const bool rows16 = sizeof(Out) == 2 && out.stride(0) % 8 == 0 && reinterpret_cast<uintptr_t>(p) % 16 == 0;
  const StoreEpilogue<Out> epi{p, out.stride(0), bias, accumulate, pairs, rows16};
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (g.dtype == DType::kF32) return check_launch(launch_det_gemm_f32(g, epi, stream), op);
  // Range sums of a split K (see plan_det_gemm) and the counters that find the last range of each
  // tile (RangeSums, no zeroing needed), from the caching allocator on this stream.
  at::Tensor scratch, counters;
  if (plan.scratch_floats > 0) scratch = at::empty({plan.scratch_floats}, out.options().dtype(at::kFloat));
  float* sp = plan.scratch_floats > 0 ? scratch.data_ptr<float>() : nullptr;
  const int64_t words = det_gemm_counters(plan, g.m, g.n);
  if (words > 0) counters = at::empty({words}, out.options().dtype(at::kLong));
  auto* cp = words > 0 ? reinterpret_cast<unsigned long long*>(counters.data_ptr<int64_t>()) : nullptr;
  check_launch(launch_det_gemm_planned(g, epi, plan, sp, cp, sm_count(), stream), op);
}

// An operand [rows, k] stored as the transpose of a matrix with 16-byte aligned rows: the bulk
// tensor copy can read it MN-major in place.
bool mn_major_view(const at::Tensor& t) {
  return t.stride(0) == 1 && t.stride(1) != 1 && t.stride(1) >= t.size(0) && (t.stride(1) * 2) % 16 == 0 &&
         aligned16(t);
}

// The operand K-major with 16-byte aligned rows: itself, or a copy (the tiled transpose for a
// transposed view).
at::Tensor k_major(const at::Tensor& t, const char* op) {
  if (t.stride(1) == 1 || t.size(1) == 1) return tma_rows(t);
  if (t.stride(0) == 1) return transposed_rows(t.t(), op);
  return tma_rows(t.contiguous());
}

int64_t leading_rows(const at::Tensor& t) {
  int64_t m = 1;
  for (int64_t i = 0; i + 1 < t.dim(); ++i) m *= t.size(i);
  return m;
}

}  // namespace

void gemm_into(const at::Tensor& a, const at::Tensor& b, at::Tensor& out,
               const std::optional<at::Tensor>& bias, bool accumulate, const char* op, bool split_k,
               const GemmPlan* forced) {
  const int64_t m = a.size(0), n = b.size(0), k = a.size(1);
  TORCH_CHECK(m <= INT_MAX && n <= INT_MAX && k <= INT_MAX, op, ": dimensions beyond 2^31 - 1");
  TORCH_INTERNAL_ASSERT(out.size(0) == m && out.size(1) == n && out.stride(1) == 1 && b.size(1) == k);
  if (m == 0 || n == 0) return;
  if (k == 0) {  // an empty sum: out = bias or 0 (or unchanged when accumulating)
    if (!accumulate) bias.has_value() ? out.copy_(bias->to(at::kFloat).expand({m, n})) : out.zero_();
    return;
  }
  const bool tensor_cores = a.scalar_type() == b.scalar_type() && a.scalar_type() != at::kFloat;
  GemmOperands g{nullptr, 0, nullptr, 0, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k),
                 tensor_cores ? dtype_of(a.scalar_type()) : DType::kF32};
  at::Tensor a2, b2;
  GemmPlan plan{};
  if (tensor_cores) {
    TORCH_INTERNAL_ASSERT(forced == nullptr || is_det_gemm_plan_option(g.m, g.n, g.k, *forced), op,
                          ": the forced plan is not one of det_gemm_plan_options'");
    plan = forced != nullptr ? *forced : plan_det_gemm(g.m, g.n, g.k, sm_count(), split_k);
    const bool in_place = gemm_reads_mn_major(plan.tile);
    g.b_mn = in_place && mn_major_view(b);
    g.a_mn = g.b_mn && mn_major_view(a);
    a2 = g.a_mn ? a : k_major(a, op);
    b2 = g.b_mn ? b : k_major(b, op);
    g.lda = g.a_mn ? a2.stride(1) : a2.stride(0);
    g.ldb = g.b_mn ? b2.stride(1) : b2.stride(0);
  } else {
    a2 = a.to(at::kFloat).contiguous();
    b2 = b.to(at::kFloat).contiguous();
    g.lda = a2.stride(0);
    g.ldb = b2.stride(0);
  }
  g.a = a2.data_ptr();
  g.b = b2.data_ptr();
  at::Tensor bf;
  if (bias.has_value()) bf = bias->to(at::kFloat).contiguous();
  const float* bp = bias.has_value() ? bf.data_ptr<float>() : nullptr;
  switch (out.scalar_type()) {
    case at::kBFloat16: gemm_store<__nv_bfloat16>(g, plan, out, bp, accumulate, op); break;
    case at::kHalf: gemm_store<__half>(g, plan, out, bp, accumulate, op); break;
    case at::kFloat: gemm_store<float>(g, plan, out, bp, accumulate, op); break;
    default: TORCH_CHECK(false, op, ": unsupported output dtype ", out.scalar_type());
  }
}

namespace {

at::Tensor det_gemm(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  constexpr const char* op = "rl_engine::det_gemm";
  check_float(x, op, "x");
  check_float(w, op, "w");
  TORCH_CHECK(w.dim() == 2 && x.dim() >= 1 && x.size(-1) == w.size(1), op, ": x [..., K] and w [N, K] "
              "must agree on K, got x ", x.sizes(), " and w ", w.sizes());
  check_on(w, x, op, "w");
  if (bias.has_value()) {
    check_float(*bias, op, "bias");
    check_on(*bias, x, op, "bias");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == w.size(0), op, ": bias must be [N], got ",
                bias->sizes());
  }
  c10::cuda::CUDAGuard guard(x.device());
  count_launch(kDetGemm, kCuda);
  const int64_t k = w.size(1), n = w.size(0), m = leading_rows(x);
  auto y = at::empty({m, n}, x.options());
  gemm_into(x.reshape({m, k}), w, y, bias, false, op, /*split_k=*/true);
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  return y.reshape(sizes);
}

at::Tensor det_gemm_grad_input(const at::Tensor& grad_y, const at::Tensor& w) {
  constexpr const char* op = "rl_engine::det_gemm_grad_input";
  check_float(grad_y, op, "grad_y");
  check_float(w, op, "w");
  TORCH_CHECK(w.dim() == 2 && grad_y.dim() >= 1 && grad_y.size(-1) == w.size(0), op, ": grad_y "
              "[..., N] and w [N, K] must agree on N, got ", grad_y.sizes(), " and ", w.sizes());
  check_on(w, grad_y, op, "w");
  c10::cuda::CUDAGuard guard(grad_y.device());
  count_launch(kDetGemmGradInput, kCuda);
  const int64_t n = w.size(0), k = w.size(1), m = leading_rows(grad_y);
  auto dx = at::empty({m, k}, grad_y.options());
  // dx[m, k] = sum_n dy[m, n] w[n, k]: B = w^T [K, N] (a view), reduction over n.
  gemm_into(grad_y.reshape({m, n}), w.t(), dx, std::nullopt, false, op, /*split_k=*/true);
  auto sizes = grad_y.sizes().vec();
  sizes.back() = k;
  return dx.reshape(sizes);
}

at::Tensor det_gemm_grad_weight(const at::Tensor& grad_y, const at::Tensor& x) {
  constexpr const char* op = "rl_engine::det_gemm_grad_weight";
  check_float(grad_y, op, "grad_y");
  check_float(x, op, "x");
  TORCH_CHECK(grad_y.dim() >= 1 && x.dim() >= 1, op, ": grad_y and x need a last dimension");
  check_on(x, grad_y, op, "x");
  const int64_t n = grad_y.size(-1), k = x.size(-1), rows = leading_rows(grad_y);
  TORCH_CHECK(rows == leading_rows(x), op, ": grad_y and x must have the same rows, got ", rows,
              " and ", leading_rows(x));
  c10::cuda::CUDAGuard guard(grad_y.device());
  count_launch(kDetGemmGradWeight, kCuda);
  auto dw = at::empty({n, k}, grad_y.options().dtype(at::kFloat));
  // dw[n, k] = sum_m dy[m, n] x[m, k]: A = dy^T, B = x^T (views), rows m in order.
  gemm_into(grad_y.reshape({rows, n}).t(), x.reshape({rows, k}).t(), dw, std::nullopt, false, op,
            /*split_k=*/true);
  return dw;
}

// x [..., K] and w [N, K] as the sm_90a kernel takes them: bf16 or fp16 of one dtype, on one device.
void check_plan_inputs(const at::Tensor& x, const at::Tensor& w, const char* op) {
  check_float(x, op, "x");
  check_float(w, op, "w");
  check_on(w, x, op, "w");
  TORCH_CHECK(w.dim() == 2 && x.dim() >= 1 && x.size(-1) == w.size(1), op, ": x [..., K] and w [N, K] "
              "must agree on K, got x ", x.sizes(), " and w ", w.sizes());
  TORCH_CHECK(x.scalar_type() == w.scalar_type() && x.scalar_type() != at::kFloat, op, ": the plans are "
              "those of the sm_90a kernel, which takes bf16 or fp16 x and w of one dtype; got ",
              x.scalar_type(), " and ", w.scalar_type());
  const int64_t m = leading_rows(x), n = w.size(0), k = w.size(1);
  TORCH_CHECK(m > 0 && n > 0 && k > 0 && m <= INT_MAX && n <= INT_MAX && k <= INT_MAX, op,
              ": M, N and K must be between 1 and 2^31 - 1, got ", m, ", ", n, " and ", k);
}

// The plans det_gemm could run for x and w on the current device (det_gemm_plan_options),
// plan_det_gemm's pick first.
std::vector<GemmPlan> plan_options(const at::Tensor& x, const at::Tensor& w, const char* op) {
  const int m = static_cast<int>(leading_rows(x)), n = static_cast<int>(w.size(0)), k = static_cast<int>(w.size(1));
  GemmPlan all[kGemmPlanOptions];
  const int count = det_gemm_plan_options(m, n, k, all);
  const GemmPlan pick = plan_det_gemm(m, n, k, sm_count(), /*split_k=*/true);
  std::vector<GemmPlan> plans{pick};
  for (int i = 0; i < count; ++i) {
    if (!same_gemm_plan(all[i], pick)) plans.push_back(all[i]);
  }
  TORCH_INTERNAL_ASSERT(static_cast<int>(plans.size()) == count, op, ": plan_det_gemm picked a plan "
                        "det_gemm_plan_options does not list");
  return plans;
}

// Each plan as (bm, bn, swapped, ranges met across CTAs), flattened.
std::vector<int64_t> det_gemm_plans(const at::Tensor& x, const at::Tensor& w) {
  constexpr const char* op = "rl_engine::_det_gemm_plans";
  check_plan_inputs(x, w, op);
  c10::cuda::CUDAGuard guard(x.device());
  std::vector<int64_t> flat;
  for (const GemmPlan& p : plan_options(x, w, op)) {
    flat.insert(flat.end(), {int64_t{p.tile.bm}, int64_t{p.tile.bn}, int64_t{p.tile.swap}, int64_t{p.split.across}});
  }
  return flat;
}

at::Tensor det_gemm_on_plan(const at::Tensor& x, const at::Tensor& w, at::IntArrayRef plan) {
  constexpr const char* op = "rl_engine::_det_gemm_on_plan";
  check_plan_inputs(x, w, op);
  TORCH_CHECK(plan.size() == 4, op, ": plan is [bm, bn, swapped, across] as _det_gemm_plans lists it, got ",
              plan);
  c10::cuda::CUDAGuard guard(x.device());
  const std::vector<GemmPlan> plans = plan_options(x, w, op);
  const GemmPlan* chosen = nullptr;
  for (const GemmPlan& p : plans) {
    if (p.tile.bm == plan[0] && p.tile.bn == plan[1] && p.tile.swap == (plan[2] != 0) &&
        p.split.across == (plan[3] != 0)) {
      chosen = &p;
    }
  }
  TORCH_CHECK(chosen != nullptr, op, ": ", plan, " is not a plan of x ", x.sizes(), " and w ", w.sizes(),
              "; take one that _det_gemm_plans lists");
  count_launch(kDetGemm, kCuda);
  const int64_t k = w.size(1), n = w.size(0), m = leading_rows(x);
  auto y = at::empty({m, n}, x.options());
  gemm_into(x.reshape({m, k}), w, y, std::nullopt, false, op, /*split_k=*/true, chosen);
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  return y.reshape(sizes);
}

}  // namespace

TORCH_LIBRARY_IMPL(rl_engine, CUDA, m) {
  m.impl("_det_gemm_plans", &det_gemm_plans);
  m.impl("_det_gemm_on_plan", &det_gemm_on_plan);
  m.impl("det_gemm", &det_gemm);
  m.impl("det_gemm_grad_input", &det_gemm_grad_input);
  m.impl("det_gemm_grad_weight", &det_gemm_grad_weight);
}

}  // namespace rl_engine::cuda
