// Torch glue of the Hopper attention kernels (attention_fwd, attention_decode, attention_bwd):
// argument checks, outputs, launch counters. Built by the host compiler (only in builds with the
// sm_90a kernels), so every TORCH_CHECK throws from host-compiled code; the .cu files only launch.
#ifdef RL_ENGINE_WITH_SM90

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <string>

#include "kernel_counters.h"
#include "rl_engine/cuda/attention_params.h"

namespace rl_engine::cuda::attn {
namespace {

constexpr double kLog2e = 1.4426950408889634;

// Messages get numbers and shapes as strings made by std::to_string: on the GPU machine, streaming
// an integer through std::ostream inside this extension (c10::str does) crashed with a segfault,
// and a bad argument must raise, never crash.
std::string num(int64_t v) { return std::to_string(v); }
std::string num(double v) { return std::to_string(v); }
std::string shape(at::IntArrayRef s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}
const char* name(at::ScalarType t) { return c10::toString(t); }

// q, k, v on one CUDA device, bf16 or fp16 of one dtype, head_dim 64 or 128.
AttnDType check_qkv(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(q.is_cuda() && k.device() == q.device() && v.device() == q.device(), op,
              ": q, k, v must be on one CUDA device, got ", q.device().str(), ", ", k.device().str(),
              ", ", v.device().str());
  const auto dt = q.scalar_type();
  TORCH_CHECK((dt == at::kBFloat16 || dt == at::kHalf) && k.scalar_type() == dt &&
                  v.scalar_type() == dt,
              op, ": the CUDA kernels take bf16 or fp16 q, k, v of one dtype, got ", name(dt), ", ",
              name(k.scalar_type()), ", ", name(v.scalar_type()));
  const int64_t d = q.size(-1);
  TORCH_CHECK(d == 64 || d == 128, op, ": the CUDA kernels support head_dim 64 and 128, got ", num(d));
  return dt == at::kBFloat16 ? AttnDType::kBF16 : AttnDType::kF16;
}

void check_block(const char* op, int64_t block) {
  TORCH_CHECK(block == 16 || block == 32 || block == 64 || block == 128, op,
              ": the CUDA kernels support kv_block_size 16, 32, 64 or 128, got ", num(block));
}

// Shapes of the packed prefill inputs. The values of cu_seqlens and q_positions stay on the device
// and are not read here: the kernels clamp every read to the sequence's rows, so a bad value gives
// a wrong result, never an out-of-bounds access.
AttnDType check_packed(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& cu_q, const at::Tensor& cu_k, const at::Tensor& pos,
                       double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && k.sizes() == v.sizes() && q.size(2) == k.size(2), op,
              ": q [Tq, Hq, D] and k, v [Tk, Hkv, D] expected, got q ", shape(q.sizes()), ", k ",
              shape(k.sizes()), ", v ", shape(v.sizes()));
  const AttnDType dt = check_qkv(op, q, k, v);
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0, op, ": Hq (", num(q.size(1)),
              ") must be a multiple of Hkv (", num(k.size(1)), ")");
  TORCH_CHECK(cu_q.scalar_type() == at::kInt && cu_k.scalar_type() == at::kInt && cu_q.dim() == 1 &&
                  cu_q.sizes() == cu_k.sizes() && cu_q.numel() >= 2,
              op, ": cu_seqlens_q and cu_seqlens_k must be int32 [B+1] with B >= 1, got ", shape(cu_q.sizes()),
              " ", name(cu_q.scalar_type()), " and ", shape(cu_k.sizes()), " ", name(cu_k.scalar_type()));
  TORCH_CHECK(pos.scalar_type() == at::kLong && pos.dim() == 1 && pos.size(0) == q.size(0), op,
              ": q_positions must be int64 [Tq] with Tq = ", num(q.size(0)), ", got ", shape(pos.sizes()),
              " ", name(pos.scalar_type()));
  TORCH_CHECK(scale > 0, op, ": softmax_scale must be positive, got ", num(scale));
  return dt;
}

// Contiguous with a 16-byte aligned start (the kernels copy 16-byte chunks).
at::Tensor dense(const at::Tensor& t) {
  auto c = t.contiguous();
  return reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 == 0 ? c : c.clone();
}

// An index tensor on the device of `like` (moved there if the caller kept it on the host).
at::Tensor on_device(const at::Tensor& t, const at::Tensor& like) {
  return t.to(like.device()).contiguous();
}

void check_cuda(cudaError_t e, const char* op) {
  TORCH_CHECK(e == cudaSuccess, op, ": CUDA launch failed: ", cudaGetErrorString(e));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

int as_int(int64_t v, const char* op, const char* what) {
  TORCH_CHECK(v >= 0 && v < std::numeric_limits<int32_t>::max(), op, ": ", what, " (", num(v),
              ") does not fit the kernels' 32-bit indices");
  return static_cast<int>(v);
}

std::tuple<at::Tensor, at::Tensor> attention_fwd(const at::Tensor& q, const at::Tensor& k,
                                                 const at::Tensor& v, const at::Tensor& cu_q,
                                                 const at::Tensor& cu_k, const at::Tensor& pos,
                                                 double softmax_scale, int64_t kv_block_size) {
  constexpr const char* op = "rl_engine::attention_fwd";
  const AttnDType dt = check_packed(op, q, k, v, cu_q, cu_k, pos, softmax_scale);
  check_block(op, kv_block_size);
  c10::cuda::CUDAGuard guard(q.device());
  count_launch(kAttentionFwd, kCuda);
  const auto qc = dense(q), kc = dense(k), vc = dense(v);
  const auto cq = on_device(cu_q, q), ck = on_device(cu_k, q), pc = on_device(pos, q);
  const int64_t tq = q.size(0), hq = q.size(1), batch = cu_q.numel() - 1;
  auto out = at::empty_like(qc);
  auto lse = at::empty({tq, hq}, q.options().dtype(at::kFloat));
  if (tq == 0) return {out, lse};
  const int64_t tiles = (tq + kFwdRows - 1) / kFwdRows + batch;
  as_int(tiles * hq, op, "query tiles x heads");
  as_int(k.size(0) * k.size(1), op, "Tk x Hkv");
  const FwdParams p{qc.data_ptr(), kc.data_ptr(), vc.data_ptr(), out.data_ptr(), lse.data_ptr<float>(),
                    cq.data_ptr<int32_t>(), ck.data_ptr<int32_t>(), pc.data_ptr<int64_t>(),
                    as_int(batch, op, "batch"), static_cast<int>(hq), static_cast<int>(k.size(1)),
                    static_cast<float>(softmax_scale), static_cast<float>(softmax_scale * kLog2e)};
  check_cuda(launch_fwd(p, dt, static_cast<int>(q.size(2)), static_cast<int>(kv_block_size), tq,
                        k.size(0), static_cast<int>(tiles), at::cuda::getCurrentCUDAStream()),
             op);
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor> attention_decode(const at::Tensor& q, const at::Tensor& k_cache,
                                                    const at::Tensor& v_cache,
                                                    const at::Tensor& block_table,
                                                    const at::Tensor& seq_lens,
                                                    double softmax_scale, int64_t kv_block_size) {
  constexpr const char* op = "rl_engine::attention_decode";
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
                  q.size(2) == k_cache.size(3),
              op, ": q [B, Hq, D] and k_cache, v_cache [num_pages, page_size, Hkv, D] expected, got q ",
              shape(q.sizes()), ", k_cache ", shape(k_cache.sizes()), ", v_cache ", shape(v_cache.sizes()));
  const AttnDType dt = check_qkv(op, q, k_cache, v_cache);
  const int64_t batch = q.size(0), hq = q.size(1), page = k_cache.size(1), hkv = k_cache.size(2);
  TORCH_CHECK(hkv > 0 && hq % hkv == 0 && hq / hkv <= kDecodeMaxGroup, op, ": Hq (", num(hq),
              ") must be a multiple of Hkv (", num(hkv), ") with at most ", num(int64_t{kDecodeMaxGroup}),
              " query heads per kv head");
  TORCH_CHECK(page > 0 && kv_block_size > 0 && kv_block_size % page == 0, op, ": kv_block_size (",
              num(kv_block_size), ") must be a positive multiple of page_size (", num(page), ")");
  check_block(op, kv_block_size);
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.dim() == 2 &&
                  block_table.size(0) == batch,
              op, ": block_table must be int32 [B, max_pages] with B = ", num(batch), ", got ",
              shape(block_table.sizes()), " ", name(block_table.scalar_type()));
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.dim() == 1 && seq_lens.size(0) == batch,
              op, ": seq_lens must be int32 [B] with B = ", num(batch), ", got ",
              shape(seq_lens.sizes()), " ", name(seq_lens.scalar_type()));
  TORCH_CHECK(softmax_scale > 0, op, ": softmax_scale must be positive, got ", num(softmax_scale));
  c10::cuda::CUDAGuard guard(q.device());
  count_launch(kAttentionDecode, kCuda);
  const auto qc = dense(q), kc = dense(k_cache), vc = dense(v_cache);
  const auto bt = on_device(block_table, q), sl = on_device(seq_lens, q);
  auto out = at::empty_like(qc);
  auto lse = at::empty({batch, hq}, q.options().dtype(at::kFloat));
  if (batch == 0) return {out, lse};
  as_int(batch * hkv, op, "batch x Hkv");
  as_int(k_cache.size(0) * page, op, "cache slots");
  const DecodeParams p{qc.data_ptr(), kc.data_ptr(), vc.data_ptr(), bt.data_ptr<int32_t>(),
                       sl.data_ptr<int32_t>(), out.data_ptr(), lse.data_ptr<float>(),
                       static_cast<int>(hq), static_cast<int>(hkv), static_cast<int>(page),
                       as_int(bt.size(1), op, "max_pages"), static_cast<int>(k_cache.size(0)),
                       static_cast<float>(softmax_scale), static_cast<float>(softmax_scale * kLog2e)};
  check_cuda(launch_decode(p, dt, static_cast<int>(q.size(2)), static_cast<int>(kv_block_size),
                           static_cast<int>(batch), at::cuda::getCurrentCUDAStream()),
             op);
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_bwd(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const at::Tensor& cu_q, const at::Tensor& cu_k,
    const at::Tensor& pos, double softmax_scale, int64_t kv_block_size, int64_t q_chunk_size) {
  constexpr const char* op = "rl_engine::attention_bwd";
  const AttnDType dt = check_packed(op, q, k, v, cu_q, cu_k, pos, softmax_scale);
  TORCH_CHECK(grad_out.sizes() == q.sizes() && out.sizes() == q.sizes(), op,
              ": grad_out and out must have q's shape ", shape(q.sizes()), ", got ",
              shape(grad_out.sizes()), " and ", shape(out.sizes()));
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.dim() == 2 && lse.size(0) == q.size(0) &&
                  lse.size(1) == q.size(1),
              op, ": lse must be fp32 [Tq, Hq], got ", shape(lse.sizes()), " ", name(lse.scalar_type()));
  TORCH_CHECK(kv_block_size > 0, op, ": kv_block_size must be positive, got ", num(kv_block_size));
  TORCH_CHECK(q_chunk_size > 0, op, ": q_chunk_size must be positive, got ", num(q_chunk_size));
  c10::cuda::CUDAGuard guard(q.device());
  count_launch(kAttentionBwd, kCuda);
  const auto qc = dense(q), kc = dense(k), vc = dense(v);
  const auto gc = dense(grad_out.to(q.scalar_type())), oc = dense(out.to(q.scalar_type()));
  const auto lc = on_device(lse, q);
  const auto cq = on_device(cu_q, q), ck = on_device(cu_k, q), pc = on_device(pos, q);
  const int64_t tq = q.size(0), tk = k.size(0), hq = q.size(1), hkv = k.size(1), d = q.size(2);
  const int64_t batch = cu_q.numel() - 1;
  auto dq = at::empty_like(qc);
  auto dk = at::empty({tk, hkv, d}, q.options().dtype(at::kFloat));
  auto dv = at::empty({tk, hkv, d}, q.options().dtype(at::kFloat));
  auto delta = at::empty({tq, hq}, q.options().dtype(at::kFloat));
  auto chunk_end = at::empty({tq}, q.options().dtype(at::kInt));
  const int64_t q_tiles = tq == 0 ? 0 : (tq + kDqRows - 1) / kDqRows + batch;
  const int64_t k_tiles = tk == 0 ? 0 : (tk + kDkvKeys - 1) / kDkvKeys + batch;
  as_int(q_tiles * hq, op, "query tiles x heads");
  as_int(k_tiles * hkv, op, "key tiles x kv heads");
  const BwdParams p{gc.data_ptr(), qc.data_ptr(), kc.data_ptr(), vc.data_ptr(), lc.data_ptr<float>(),
                    delta.data_ptr<float>(), dq.data_ptr(), dk.data_ptr<float>(), dv.data_ptr<float>(),
                    cq.data_ptr<int32_t>(), ck.data_ptr<int32_t>(), pc.data_ptr<int64_t>(),
                    chunk_end.data_ptr<int32_t>(), as_int(batch, op, "batch"), static_cast<int>(hq),
                    static_cast<int>(hkv), static_cast<int>(std::min<int64_t>(q_chunk_size, std::numeric_limits<int32_t>::max())),
                    static_cast<float>(softmax_scale), static_cast<float>(softmax_scale * kLog2e)};
  check_cuda(launch_bwd(p, oc.data_ptr(), delta.data_ptr<float>(), dt, static_cast<int>(d), tq, tk,
                        static_cast<int>(q_tiles), static_cast<int>(k_tiles),
                        at::cuda::getCurrentCUDAStream()),
             op);
  return {dq, dk, dv};
}

}  // namespace

TORCH_LIBRARY_IMPL(rl_engine, CUDA, m) {
  m.impl("attention_fwd", &attention_fwd);
  m.impl("attention_decode", &attention_decode);
  m.impl("attention_bwd", &attention_bwd);
}

}  // namespace rl_engine::cuda::attn

#endif  // RL_ENGINE_WITH_SM90
