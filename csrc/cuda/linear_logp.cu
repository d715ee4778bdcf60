// CUDA launchers of linear_logp_partial, logp_combine and linear_logp_backward.
//
// bf16/fp16: the LM-head GEMM runs with the fused log-sum-exp epilogue, so only (max, sumexp) per
// sub-tile ([T, V / sub] pairs) ever reaches memory. fp32 (or mixed dtypes): the fp32 GEMM writes
// logits one vocab chunk at a time and a reduction kernel takes the sub-tiles. The backward walks
// the vocab in fixed chunks of kBackwardChunk ids: logits, dlogit (rounded to the input dtype, as
// the production backward does), then grad_hidden += dlogit W_c and grad_weight_c = dlogit^T hidden.
// In bf16/fp16 the logits become dlogit in the GEMM's epilogue (DlogitEpilogue), so a chunk's fp32
// logits never reach memory.
#include "rl_engine/cuda/linear_logp.cuh"

#include <torch/library.h>

#include <algorithm>
#include <limits>

#include "cuda/glue.cuh"
#include "kernel_counters.h"
#include "rl_engine/cuda/det_gemm.cuh"

namespace rl_engine::cuda {
namespace {

constexpr int64_t kBackwardChunk = 8192;  // a numerics constant: grad_hidden adds chunks in order
constexpr int64_t kForwardChunk = 8192;   // fp32 path only (logit buffer width)

bool is_pow2(int64_t v) { return v > 0 && (v & (v - 1)) == 0; }

void check_logp_inputs(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target,
                       const char* op) {
  check_float(hidden, op, "hidden");
  check_float(weight, op, "weight");
  TORCH_CHECK(hidden.dim() == 2 && weight.dim() == 2 && hidden.size(1) == weight.size(1), op,
              ": hidden [T, H] and weight [V, H] must agree on H, got ", hidden.sizes(), " and ",
              weight.sizes());
  TORCH_CHECK(target.scalar_type() == at::kLong && target.dim() == 1 &&
                  target.size(0) == hidden.size(0),
              op, ": target must be int64 [T], got ", target.scalar_type(), " ", target.sizes());
  check_on(weight, hidden, op, "weight");
  check_on(target, hidden, op, "target");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_logp_partial(
    const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target, int64_t vocab_start,
    int64_t vocab_tile, int64_t num_tiles) {
  constexpr const char* op = "rl_engine::linear_logp_partial";
  check_logp_inputs(hidden, weight, target, op);
  const int64_t t_dim = hidden.size(0), v_local = weight.size(0);
  TORCH_CHECK(vocab_tile >= 1, op, ": vocab_tile must be >= 1, got ", vocab_tile);
  TORCH_CHECK(is_pow2(num_tiles) && num_tiles <= 16384, op, ": num_tiles must be a power of two "
              "<= 16384, got ", num_tiles);
  TORCH_CHECK(v_local <= num_tiles * vocab_tile, op, ": weight has ", v_local, " vocab rows, more "
              "than num_tiles * vocab_tile = ", num_tiles * vocab_tile);
  TORCH_CHECK(v_local == 0 || (vocab_start >= 0 && vocab_start % (num_tiles * vocab_tile) == 0), op,
              ": vocab_start must be a multiple of num_tiles * vocab_tile = ", num_tiles * vocab_tile);
  const bool tensor_cores = hidden.scalar_type() == weight.scalar_type() &&
                            hidden.scalar_type() != at::kFloat;
  TORCH_CHECK(!tensor_cores || vocab_tile % 256 == 0 || vocab_tile == 64 || vocab_tile == 128, op,
              ": the sm_90a kernel takes vocab_tile 64, 128 or a multiple of 256, got ", vocab_tile);
  c10::cuda::CUDAGuard guard(hidden.device());
  count_launch(kLinearLogpPartial, kCuda);
  const auto f32 = hidden.options().dtype(at::kFloat);
  auto out_max = at::empty({t_dim}, f32), out_sum = at::empty({t_dim}, f32);
  auto out_target = at::full({t_dim}, -std::numeric_limits<float>::infinity(), f32);
  if (t_dim == 0) return {out_max, out_sum, out_target};

  const int64_t sub = tensor_cores ? std::min<int64_t>(vocab_tile, 256) : vocab_tile;
  const int64_t parts_valid = (v_local + sub - 1) / sub;
  const int64_t part_ld = tensor_cores ? (v_local + 255) / 256 * (256 / sub) : parts_valid;
  auto part = at::empty({t_dim, std::max<int64_t>(part_ld, 1) * 2}, f32);
  auto* part_p = reinterpret_cast<float2*>(part.data_ptr<float>());
  const auto tgt = target.contiguous();
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (v_local > 0 && tensor_cores) {
    const at::Tensor h2 = tma_rows(hidden), w2 = tma_rows(weight);
    const GemmOperands g{h2.data_ptr(), h2.stride(0), w2.data_ptr(), w2.stride(0),
                         static_cast<int>(t_dim), static_cast<int>(v_local),
                         static_cast<int>(hidden.size(1)), dtype_of(hidden.scalar_type())};
    const LogpTileEpilogue epi{part_p, part_ld, out_target.data_ptr<float>(),
                               tgt.data_ptr<int64_t>(), vocab_start, static_cast<int>(sub)};
    check_launch(launch_det_gemm_sm90(g, epi, sm_count(), stream), op);
  } else if (v_local > 0) {
    const auto hf = hidden.to(at::kFloat).contiguous(), wf = weight.to(at::kFloat).contiguous();
    const int64_t chunk = std::max<int64_t>(1, kForwardChunk / sub) * sub;
    auto logits = at::empty({t_dim, std::min(chunk, v_local)}, f32);
    for (int64_t c0 = 0; c0 < v_local; c0 += chunk) {
      const int64_t vc = std::min(chunk, v_local - c0);
      auto lg = logits.narrow(1, 0, vc);
      gemm_into(hf, wf.narrow(0, c0, vc), lg, std::nullopt, false, op, /*split_k=*/false);
      const int64_t work = t_dim * ((vc + sub - 1) / sub);
      rlk_linear_logp_subtile_kernel<<<(work + 255) / 256, 256, 0, stream>>>(
          lg.data_ptr<float>(), lg.stride(0), t_dim, static_cast<int>(vc), static_cast<int>(sub),
          part_p, part_ld, c0 / sub, tgt.data_ptr<int64_t>(), vocab_start + c0,
          out_target.data_ptr<float>());
      check_launch(cudaGetLastError(), op);
    }
  }
  const size_t smem = static_cast<size_t>(num_tiles + std::max<int64_t>(num_tiles / 2, 1)) * sizeof(float2);
  if (smem > 48 * 1024) {
    check_launch(cudaFuncSetAttribute(rlk_linear_logp_tree_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(smem)), op);
  }
  const int grid = static_cast<int>(std::min<int64_t>(t_dim, 65536));
  rlk_linear_logp_tree_kernel<<<grid, 256, smem, stream>>>(part_p, part_ld, parts_valid,
                                                    static_cast<int>(vocab_tile / sub),
                                                    static_cast<int>(num_tiles), t_dim,
                                                    out_max.data_ptr<float>(), out_sum.data_ptr<float>());
  check_launch(cudaGetLastError(), op);
  return {out_max, out_sum, out_target};
}

std::tuple<at::Tensor, at::Tensor> logp_combine(const at::Tensor& max, const at::Tensor& sumexp,
                                                const at::Tensor& target_logit) {
  constexpr const char* op = "rl_engine::logp_combine";
  TORCH_CHECK(max.dim() == 2 && sumexp.sizes() == max.sizes() && target_logit.sizes() == max.sizes(),
              op, ": max, sumexp and target_logit must be [R, T] alike, got ", max.sizes(), ", ",
              sumexp.sizes(), ", ", target_logit.sizes());
  TORCH_CHECK(is_pow2(max.size(0)) && max.size(0) <= 64, op, ": the number of shards R must be a "
              "power of two <= 64, got ", max.size(0));
  check_on(sumexp, max, op, "sumexp");
  check_on(target_logit, max, op, "target_logit");
  c10::cuda::CUDAGuard guard(max.device());
  count_launch(kLogpCombine, kCuda);
  const auto m = max.to(at::kFloat).contiguous(), s = sumexp.to(at::kFloat).contiguous();
  const auto tl = target_logit.to(at::kFloat).contiguous();
  const int64_t t_dim = max.size(1);
  auto logp = at::empty({t_dim}, m.options()), lse = at::empty({t_dim}, m.options());
  if (t_dim == 0) return {logp, lse};
  rlk_linear_logp_combine_kernel<<<(t_dim + 255) / 256, 256, 0, at::cuda::getCurrentCUDAStream()>>>(
      m.data_ptr<float>(), s.data_ptr<float>(), tl.data_ptr<float>(), static_cast<int>(max.size(0)),
      t_dim, logp.data_ptr<float>(), lse.data_ptr<float>());
  check_launch(cudaGetLastError(), op);
  return {logp, lse};
}

// dlogit of the fp32 path, from a chunk's logits in memory.
void launch_dlogit(const at::Tensor& lg, int64_t id0, const at::Tensor& tgt, const at::Tensor& lse,
                   const at::Tensor& grad, at::Tensor& dl, const char* op) {
  const int64_t total = dl.numel();
  const int grid = static_cast<int>(std::min<int64_t>((total + 255) / 256, sm_count() * 16LL));
  rlk_linear_logp_dlogit_kernel<float><<<grid, 256, 0, at::cuda::getCurrentCUDAStream()>>>(
      lg.data_ptr<float>(), lg.stride(0), lg.size(0), static_cast<int>(lg.size(1)), dl.size(1), id0,
      tgt.data_ptr<int64_t>(), lse.data_ptr<float>(), grad.data_ptr<float>(), dl.data_ptr<float>());
  check_launch(cudaGetLastError(), op);
}

// The forward's logits of one vocab chunk (K unsplit, so the bits of linear_logp_partial's tiles)
// straight into dlogit through DlogitEpilogue.
template <typename T>
void launch_dlogit_gemm(const at::Tensor& h2, const at::Tensor& wc, int64_t id0, const at::Tensor& tgt,
                        const at::Tensor& lse, const at::Tensor& grad, at::Tensor& dl, const char* op) {
  const at::Tensor w2 = tma_rows(wc);
  const GemmOperands g{h2.data_ptr(), h2.stride(0), w2.data_ptr(), w2.stride(0), static_cast<int>(h2.size(0)),
                       static_cast<int>(w2.size(0)), static_cast<int>(h2.size(1)), dtype_of(h2.scalar_type())};
  T* p = reinterpret_cast<T*>(dl.data_ptr());
  const bool rows16 = dl.stride(0) % 8 == 0 && reinterpret_cast<uintptr_t>(p) % 16 == 0;
  const StoreEpilogue<T> store{p, dl.stride(0), nullptr, false, dl.stride(0) % 2 == 0, rows16};
  const DlogitEpilogue<T> epi{store, tgt.data_ptr<int64_t>(), lse.data_ptr<float>(), grad.data_ptr<float>(), id0};
  check_launch(launch_det_gemm_sm90(g, epi, sm_count(), at::cuda::getCurrentCUDAStream()), op);
}

std::tuple<at::Tensor, at::Tensor> linear_logp_backward(const at::Tensor& grad_logp,
                                                        const at::Tensor& hidden, const at::Tensor& weight,
                                                        const at::Tensor& target, const at::Tensor& lse,
                                                        int64_t vocab_start) {
  constexpr const char* op = "rl_engine::linear_logp_backward";
  check_logp_inputs(hidden, weight, target, op);
  const int64_t t_dim = hidden.size(0), v_local = weight.size(0), h = hidden.size(1);
  TORCH_CHECK(grad_logp.dim() == 1 && grad_logp.size(0) == t_dim && lse.dim() == 1 &&
                  lse.size(0) == t_dim,
              op, ": grad_logp and lse must be [T] with T = ", t_dim);
  check_on(grad_logp, hidden, op, "grad_logp");
  check_on(lse, hidden, op, "lse");
  c10::cuda::CUDAGuard guard(hidden.device());
  count_launch(kLinearLogpBackward, kCuda);
  const auto f32 = hidden.options().dtype(at::kFloat);
  if (t_dim == 0 || v_local == 0 || h == 0) {
    return {at::zeros({t_dim, h}, f32), at::zeros({v_local, h}, f32)};
  }
  // Every element is written: the first chunk stores grad_hidden, each chunk its rows of grad_weight.
  auto grad_hidden = at::empty({t_dim, h}, f32);
  auto grad_weight = at::empty({v_local, h}, f32);
  const bool tensor_cores = hidden.scalar_type() == weight.scalar_type() &&
                            hidden.scalar_type() != at::kFloat;
  const auto dtype = tensor_cores ? hidden.scalar_type() : at::kFloat;
  const auto hs = hidden.to(dtype), ws = weight.to(dtype);
  const auto g = grad_logp.to(at::kFloat).contiguous(), l = lse.to(at::kFloat).contiguous();
  const auto tgt = target.contiguous();
  const int64_t align = 16 / c10::elementSize(dtype);
  at::Tensor logits;  // fp32 path only: the 16-bit one turns logits into dlogit in the GEMM's epilogue
  if (!tensor_cores) logits = at::empty({t_dim, std::min(kBackwardChunk, v_local)}, f32);
  const at::Tensor h2 = tensor_cores ? tma_rows(hs) : hs;
  for (int64_t c0 = 0; c0 < v_local; c0 += kBackwardChunk) {
    const int64_t vc = std::min(kBackwardChunk, v_local - c0);
    const auto wc = ws.narrow(0, c0, vc);
    // Rows padded to 16 bytes for the next GEMMs' tensor maps, which end at column vc: the padding
    // is never read, so it is left as allocated.
    auto dl = at::empty({t_dim, round_up(vc, align)}, hidden.options().dtype(dtype));
    switch (dtype) {
      case at::kBFloat16: launch_dlogit_gemm<__nv_bfloat16>(h2, wc, vocab_start + c0, tgt, l, g, dl, op); break;
      case at::kHalf: launch_dlogit_gemm<__half>(h2, wc, vocab_start + c0, tgt, l, g, dl, op); break;
      default: {
        auto lg = logits.narrow(1, 0, vc);
        gemm_into(hs, wc, lg, std::nullopt, false, op, /*split_k=*/false);  // the forward's logits
        launch_dlogit(lg, vocab_start + c0, tgt, l, g, dl, op);
      }
    }
    const auto dlv = dl.narrow(1, 0, vc);
    // Transposed views: the GEMM reads them in place on its large tiles (see gemm_into).
    gemm_into(dlv, wc.t(), grad_hidden, std::nullopt, c0 > 0, op, /*split_k=*/true);
    auto gw = grad_weight.narrow(0, c0, vc);
    gemm_into(dlv.t(), hs.t(), gw, std::nullopt, false, op, /*split_k=*/true);
  }
  return {grad_hidden, grad_weight};
}

}  // namespace

TORCH_LIBRARY_IMPL(rl_engine, CUDA, m) {
  m.impl("linear_logp_partial", &linear_logp_partial);
  m.impl("logp_combine", &logp_combine);
  m.impl("linear_logp_backward", &linear_logp_backward);
}

}  // namespace rl_engine::cuda
