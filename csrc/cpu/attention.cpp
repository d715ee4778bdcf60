// CPU launchers of attention_fwd, attention_decode and attention_bwd. Inputs go to contiguous fp32;
// work is split over (query row, head) for the forward and dq, and over (key row, kv head) for
// dk/dv, so each output element is computed whole by one thread in one fixed order.
#include "rl_engine/cpu/attention.h"

#include <vector>

#include <torch/library.h>

#include "cpu/common.h"
#include "kernel_counters.h"

namespace rl_engine::cpu {
namespace {

struct Dims {
  int64_t tq, tk, hq, hkv, d, batch;
};

// Shapes, dtypes and sequence layout shared by the prefill forward and backward. Returns the
// dimensions; seq_of_q[r] is the sequence of query row r.
Dims check_packed(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& cu_q, const at::Tensor& cu_k, const at::Tensor& pos,
                  int64_t kv_block_size, std::vector<int64_t>& seq_of_q) {
  check_float_dtype(q, "q");
  check_float_dtype(k, "k");
  check_float_dtype(v, "v");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && k.sizes() == v.sizes() && q.size(2) == k.size(2),
              "rl_engine::", op, ": q [Tq, Hq, D] and k, v [Tk, Hkv, D] expected, got q ", q.sizes(),
              ", k ", k.sizes(), ", v ", v.sizes());
  const Dims dims{q.size(0), k.size(0), q.size(1), k.size(1), q.size(2), cu_q.numel() - 1};
  TORCH_CHECK(dims.hkv > 0 && dims.hq % dims.hkv == 0, "rl_engine::", op, ": Hq (", dims.hq,
              ") must be a multiple of Hkv (", dims.hkv, ")");
  TORCH_CHECK(dims.d % 8 == 0 && dims.d > 0, "rl_engine::", op, ": head_dim must be a positive "
              "multiple of 8, got ", dims.d);
  TORCH_CHECK(kv_block_size > 0, "rl_engine::", op, ": kv_block_size must be positive, got ",
              kv_block_size);
  TORCH_CHECK(cu_q.scalar_type() == at::kInt && cu_k.scalar_type() == at::kInt && cu_q.dim() == 1 &&
              cu_q.sizes() == cu_k.sizes() && cu_q.numel() >= 2, "rl_engine::", op,
              ": cu_seqlens_q and cu_seqlens_k must be int32 [B+1] with B >= 1, got ", cu_q.sizes(),
              " ", cu_q.scalar_type(), " and ", cu_k.sizes(), " ", cu_k.scalar_type());
  TORCH_CHECK(pos.scalar_type() == at::kLong && pos.dim() == 1 && pos.size(0) == dims.tq,
              "rl_engine::", op, ": q_positions must be int64 [Tq] with Tq = ", dims.tq, ", got ",
              pos.sizes(), " ", pos.scalar_type());
  auto cq = cu_q.contiguous(), ck = cu_k.contiguous(), pc = pos.contiguous();
  const int32_t* cqp = cq.data_ptr<int32_t>();
  const int32_t* ckp = ck.data_ptr<int32_t>();
  const int64_t* pp = pc.data_ptr<int64_t>();
  TORCH_CHECK(cqp[0] == 0 && ckp[0] == 0 && cqp[dims.batch] == dims.tq && ckp[dims.batch] == dims.tk,
              "rl_engine::", op, ": cu_seqlens must start at 0 and end at Tq = ", dims.tq,
              " and Tk = ", dims.tk, ", got ", cu_q, " and ", cu_k);
  seq_of_q.assign(dims.tq, 0);
  for (int64_t b = 0; b < dims.batch; ++b) {
    TORCH_CHECK(cqp[b] <= cqp[b + 1] && ckp[b] <= ckp[b + 1], "rl_engine::", op,
                ": cu_seqlens must be non-decreasing (sequence ", b, ")");
    const int64_t keys = ckp[b + 1] - ckp[b];
    for (int64_t r = cqp[b]; r < cqp[b + 1]; ++r) {
      TORCH_CHECK(pp[r] >= 0 && pp[r] < keys, "rl_engine::", op, ": query row ", r, " of sequence ",
                  b, " has position ", pp[r], " but the sequence has only ", keys,
                  " keys (a query at position p needs keys 0..p)");
      seq_of_q[r] = b;
    }
  }
  return dims;
}

// Row accessor of packed keys: position j of the sequence starting at row `base`, kv head `h`.
struct PackedRows {
  const float* k;
  const float* v;
  int64_t base, hkv, h, d;
  void operator()(int64_t j, const float** kr, const float** vr) const {
    const int64_t off = ((base + j) * hkv + h) * d;
    *kr = k + off;
    *vr = v + off;
  }
};

// Thread-local scratch for one forward walk.
struct ScratchBuffers {
  std::vector<float> scores, acc;
  std::vector<const float*> krows, vrows;
  ScratchBuffers(int64_t block, int64_t d) : scores(block), acc(d), krows(block), vrows(block) {}
  AttentionScratch view() { return {scores.data(), krows.data(), vrows.data(), acc.data()}; }
};

std::tuple<at::Tensor, at::Tensor> attention_fwd(const at::Tensor& q, const at::Tensor& k,
                                                 const at::Tensor& v, const at::Tensor& cu_q,
                                                 const at::Tensor& cu_k, const at::Tensor& pos,
                                                 double softmax_scale, int64_t kv_block_size) {
  std::vector<int64_t> seq_of_q;
  const Dims dm = check_packed("attention_fwd", q, k, v, cu_q, cu_k, pos, kv_block_size, seq_of_q);
  count_launch(kAttentionFwd, kCpu);
  auto qf = f32(q), kf = f32(k), vf = f32(v);
  auto ck = cu_k.contiguous(), pc = pos.contiguous();
  auto out = at::empty({dm.tq, dm.hq, dm.d}, qf.options());
  auto lse = at::empty({dm.tq, dm.hq}, qf.options());
  const float *qp = qf.data_ptr<float>(), *kp = kf.data_ptr<float>(), *vp = vf.data_ptr<float>();
  const int32_t* ckp = ck.data_ptr<int32_t>();
  const int64_t* pp = pc.data_ptr<int64_t>();
  float *op = out.data_ptr<float>(), *lp = lse.data_ptr<float>();
  const int64_t group = dm.hq / dm.hkv;
  const float scale = static_cast<float>(softmax_scale);
  parallel_rows(dm.tq * dm.hq, [&](int64_t begin, int64_t end) {
    ScratchBuffers buf(kv_block_size, dm.d);
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t r = idx / dm.hq, h = idx % dm.hq;
      const PackedRows rows{kp, vp, ckp[seq_of_q[r]], dm.hkv, h / group, dm.d};
      attention_query(qp + idx * dm.d, pp[r], rows, dm.d, scale, kv_block_size, buf.view(),
                      op + idx * dm.d, lp + idx);
    }
  });
  return {out.to(q.scalar_type()), lse};
}

std::tuple<at::Tensor, at::Tensor> attention_decode(const at::Tensor& q, const at::Tensor& k_cache,
                                                    const at::Tensor& v_cache,
                                                    const at::Tensor& block_table,
                                                    const at::Tensor& seq_lens,
                                                    double softmax_scale, int64_t kv_block_size) {
  check_float_dtype(q, "q");
  check_float_dtype(k_cache, "k_cache");
  check_float_dtype(v_cache, "v_cache");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
              q.size(2) == k_cache.size(3), "rl_engine::attention_decode: q [B, Hq, D] and "
              "k_cache, v_cache [num_pages, page_size, Hkv, D] expected, got q ", q.sizes(),
              ", k_cache ", k_cache.sizes(), ", v_cache ", v_cache.sizes());
  const int64_t batch = q.size(0), hq = q.size(1), d = q.size(2);
  const int64_t num_pages = k_cache.size(0), page = k_cache.size(1), hkv = k_cache.size(2);
  TORCH_CHECK(hkv > 0 && hq % hkv == 0, "rl_engine::attention_decode: Hq (", hq,
              ") must be a multiple of Hkv (", hkv, ")");
  TORCH_CHECK(d % 8 == 0 && d > 0, "rl_engine::attention_decode: head_dim must be a positive "
              "multiple of 8, got ", d);
  TORCH_CHECK(page > 0 && kv_block_size > 0 && kv_block_size % page == 0,
              "rl_engine::attention_decode: kv_block_size (", kv_block_size,
              ") must be a positive multiple of page_size (", page, ")");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.dim() == 2 &&
              block_table.size(0) == batch, "rl_engine::attention_decode: block_table must be "
              "int32 [B, max_pages] with B = ", batch, ", got ", block_table.sizes(), " ",
              block_table.scalar_type());
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.dim() == 1 && seq_lens.size(0) == batch,
              "rl_engine::attention_decode: seq_lens must be int32 [B] with B = ", batch, ", got ",
              seq_lens.sizes(), " ", seq_lens.scalar_type());
  auto bt = block_table.contiguous(), sl = seq_lens.contiguous();
  const int32_t* btp = bt.data_ptr<int32_t>();
  const int32_t* slp = sl.data_ptr<int32_t>();
  const int64_t max_pages = bt.size(1);
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(slp[b] >= 1 && slp[b] <= max_pages * page, "rl_engine::attention_decode: seq_lens[",
                b, "] = ", slp[b], " must be in [1, max_pages * page_size = ", max_pages * page, "]");
    for (int64_t p = 0; p < (slp[b] + page - 1) / page; ++p) {
      const int32_t phys = btp[b * max_pages + p];
      TORCH_CHECK(phys >= 0 && phys < num_pages, "rl_engine::attention_decode: block_table[", b,
                  ", ", p, "] = ", phys, " is not a page of the cache (num_pages = ", num_pages, ")");
    }
  }
  count_launch(kAttentionDecode, kCpu);
  auto qf = f32(q), kf = f32(k_cache), vf = f32(v_cache);
  auto out = at::empty({batch, hq, d}, qf.options());
  auto lse = at::empty({batch, hq}, qf.options());
  const float *qp = qf.data_ptr<float>(), *kp = kf.data_ptr<float>(), *vp = vf.data_ptr<float>();
  float *op = out.data_ptr<float>(), *lp = lse.data_ptr<float>();
  const int64_t group = hq / hkv;
  const float scale = static_cast<float>(softmax_scale);
  parallel_rows(batch * hq, [&](int64_t begin, int64_t end) {
    ScratchBuffers buf(kv_block_size, d);
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t b = idx / hq, g = (idx % hq) / group;
      const int32_t* pages = btp + b * max_pages;
      auto rows = [&](int64_t j, const float** kr, const float** vr) {
        const int64_t off = ((pages[j / page] * page + j % page) * hkv + g) * d;
        *kr = kp + off;
        *vr = vp + off;
      };
      attention_query(qp + idx * d, slp[b] - 1, rows, d, scale, kv_block_size, buf.view(),
                      op + idx * d, lp + idx);
    }
  });
  return {out.to(q.scalar_type()), lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_bwd(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const at::Tensor& cu_q, const at::Tensor& cu_k,
    const at::Tensor& pos, double softmax_scale, int64_t kv_block_size, int64_t q_chunk_size) {
  std::vector<int64_t> seq_of_q;
  const Dims dm = check_packed("attention_bwd", q, k, v, cu_q, cu_k, pos, kv_block_size, seq_of_q);
  check_float_dtype(grad_out, "grad_out");
  check_float_dtype(out, "out");
  TORCH_CHECK(grad_out.sizes() == q.sizes() && out.sizes() == q.sizes(), "rl_engine::attention_bwd: "
              "grad_out and out must have q's shape ", q.sizes(), ", got ", grad_out.sizes(), " and ",
              out.sizes());
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.dim() == 2 && lse.size(0) == dm.tq &&
              lse.size(1) == dm.hq, "rl_engine::attention_bwd: lse must be fp32 [Tq, Hq] = [",
              dm.tq, ", ", dm.hq, "], got ", lse.sizes(), " ", lse.scalar_type());
  TORCH_CHECK(q_chunk_size > 0, "rl_engine::attention_bwd: q_chunk_size must be positive, got ",
              q_chunk_size);
  auto cq = cu_q.contiguous(), ck = cu_k.contiguous(), pc = pos.contiguous();
  const int32_t *cqp = cq.data_ptr<int32_t>(), *ckp = ck.data_ptr<int32_t>();
  const int64_t* pp = pc.data_ptr<int64_t>();
  for (int64_t r = 1; r < dm.tq; ++r) {
    TORCH_CHECK(seq_of_q[r] != seq_of_q[r - 1] || pp[r] > pp[r - 1], "rl_engine::attention_bwd: "
                "q_positions must increase strictly within a sequence (row ", r, " has position ",
                pp[r], " after ", pp[r - 1], ")");
  }
  count_launch(kAttentionBwd, kCpu);
  auto gf = f32(grad_out), qf = f32(q), kf = f32(k), vf = f32(v), of = f32(out);
  auto lf = lse.contiguous();
  const float *gp = gf.data_ptr<float>(), *qp = qf.data_ptr<float>(), *kp = kf.data_ptr<float>();
  const float *vp = vf.data_ptr<float>(), *outp = of.data_ptr<float>(), *lp = lf.data_ptr<float>();
  const int64_t d = dm.d, group = dm.hq / dm.hkv;
  const float scale = static_cast<float>(softmax_scale);

  // delta[r, h] = dO . O, the softmax-Jacobian term of every (row, head).
  auto delta = at::empty({dm.tq, dm.hq}, qf.options());
  float* dp = delta.data_ptr<float>();
  parallel_rows(dm.tq * dm.hq, [&](int64_t begin, int64_t end) {
    for (int64_t idx = begin; idx < end; ++idx) dp[idx] = dot(gp + idx * d, outp + idx * d, d);
  });

  auto dq = at::empty({dm.tq, dm.hq, d}, qf.options());
  float* dqp = dq.data_ptr<float>();
  parallel_rows(dm.tq * dm.hq, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(d);
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t r = idx / dm.hq, h = idx % dm.hq;
      const PackedRows rows{kp, vp, ckp[seq_of_q[r]], dm.hkv, h / group, d};
      attention_bwd_dq(qp + idx * d, gp + idx * d, lp[idx], dp[idx], pp[r], rows, d, scale,
                       acc.data(), dqp + idx * d);
    }
  });

  // Sequence of each key row, for the (key row, kv head) split of dk/dv.
  std::vector<int64_t> seq_of_k(dm.tk, 0);
  for (int64_t b = 0; b < dm.batch; ++b)
    for (int64_t j = ckp[b]; j < ckp[b + 1]; ++j) seq_of_k[j] = b;
  auto dk = at::empty({dm.tk, dm.hkv, d}, qf.options());
  auto dv = at::empty({dm.tk, dm.hkv, d}, qf.options());
  float *dkp = dk.data_ptr<float>(), *dvp = dv.data_ptr<float>();
  parallel_rows(dm.tk * dm.hkv, [&](int64_t begin, int64_t end) {
    std::vector<float> part_k(d), part_v(d);
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t j = idx / dm.hkv, g = idx % dm.hkv, b = seq_of_k[j];
      const int64_t row0 = cqp[b];
      auto queries = [&](int64_t r, int64_t h, const float** qr, const float** dor, float* l,
                         float* de) {
        const int64_t qi = (row0 + r) * dm.hq + g * group + h;
        *qr = qp + qi * d;
        *dor = gp + qi * d;
        *l = lp[qi];
        *de = dp[qi];
      };
      attention_bwd_dkv(kp + idx * d, vp + idx * d, j - ckp[b], pp + row0, cqp[b + 1] - row0, group,
                        queries, d, scale, q_chunk_size, part_k.data(), part_v.data(),
                        dkp + idx * d, dvp + idx * d);
    }
  });
  return {dq.to(q.scalar_type()), dk, dv};
}

}  // namespace

TORCH_LIBRARY_IMPL(rl_engine, CPU, m) {
  m.impl("attention_fwd", &attention_fwd);
  m.impl("attention_decode", &attention_decode);
  m.impl("attention_bwd", &attention_bwd);
}

}  // namespace rl_engine::cpu
