// CPU launchers of the selected-token log-prob ops: shard partials, the cross-shard combine and
// the backward of one shard.
#include "rl_engine/cpu/linear_logp.h"

#include <torch/library.h>

#include "cpu/common.h"
#include "kernel_counters.h"

namespace rl_engine::cpu {
namespace {

bool is_power_of_two(int64_t n) { return n > 0 && (n & (n - 1)) == 0; }

// Shapes shared by the forward and the backward: hidden [T, H], weight [V_local, H], target [T].
void check_shard(const char* op, const at::Tensor& hidden, const at::Tensor& weight,
                 const at::Tensor& target) {
  check_float_dtype(hidden, "hidden");
  check_float_dtype(weight, "weight");
  TORCH_CHECK(hidden.dim() == 2 && weight.dim() == 2 && hidden.size(1) == weight.size(1), op,
              ": hidden [T, H] and weight [V_local, H] must agree on H, got hidden ", hidden.sizes(),
              " and weight ", weight.sizes());
  TORCH_CHECK(target.scalar_type() == at::kLong, op, ": target must be int64, got ",
              target.scalar_type());
  TORCH_CHECK(target.dim() == 1 && target.size(0) == hidden.size(0), op, ": target must be [T] with "
              "T = ", hidden.size(0), ", got ", target.sizes());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_logp_partial(
    const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target,
    int64_t vocab_start, int64_t vocab_tile, int64_t num_tiles) {
  constexpr const char* op = "rl_engine::linear_logp_partial";
  check_shard(op, hidden, weight, target);
  TORCH_CHECK(vocab_tile >= 1, op, ": vocab_tile must be >= 1, got ", vocab_tile);
  TORCH_CHECK(is_power_of_two(num_tiles), op, ": num_tiles must be a power of two, got ", num_tiles);
  const int64_t v_local = weight.size(0);
  TORCH_CHECK(v_local <= num_tiles * vocab_tile, op, ": weight has ", v_local, " vocab rows, more "
              "than num_tiles * vocab_tile = ", num_tiles * vocab_tile);
  // A shard must be a whole subtree of the global tile tree, or a split would change the bits. An
  // empty shard (all padding) holds no ids, so where it says it starts does not matter.
  TORCH_CHECK(v_local == 0 || (vocab_start >= 0 && vocab_start % (num_tiles * vocab_tile) == 0), op,
              ": vocab_start must be a multiple of num_tiles * vocab_tile = ", num_tiles * vocab_tile,
              ", got ", vocab_start);
  count_launch(kLinearLogpPartial, kCpu);
  auto h = f32(hidden);
  auto w = f32(weight);
  auto tg = target.contiguous();
  const int64_t t_dim = h.size(0), h_dim = h.size(1);
  auto out_max = at::empty({t_dim}, h.options());
  auto out_sum = at::empty({t_dim}, h.options());
  auto out_target = at::empty({t_dim}, h.options());
  const float* hp = h.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const int64_t* tp = tg.data_ptr<int64_t>();
  float* mp = out_max.data_ptr<float>();
  float* sp = out_sum.data_ptr<float>();
  float* lp = out_target.data_ptr<float>();
  parallel_rows(t_dim, [&](int64_t b, int64_t e) {
    linear_logp_partial_rows(hp, wp, tp, mp, sp, lp, b, e, v_local, h_dim, vocab_start, vocab_tile,
                             num_tiles);
  });
  return {out_max, out_sum, out_target};
}

std::tuple<at::Tensor, at::Tensor> logp_combine(const at::Tensor& max, const at::Tensor& sumexp,
                                                const at::Tensor& target_logit) {
  constexpr const char* op = "rl_engine::logp_combine";
  check_float_dtype(max, "max");
  check_float_dtype(sumexp, "sumexp");
  check_float_dtype(target_logit, "target_logit");
  TORCH_CHECK(max.dim() == 2 && sumexp.sizes() == max.sizes() && target_logit.sizes() == max.sizes(),
              op, ": max, sumexp and target_logit must all be [R, T], got ", max.sizes(), ", ",
              sumexp.sizes(), " and ", target_logit.sizes());
  const int64_t r_dim = max.size(0), t_dim = max.size(1);
  TORCH_CHECK(is_power_of_two(r_dim), op, ": the number of shards R must be a power of two, got ",
              r_dim);
  auto m = f32(max);
  auto s = f32(sumexp);
  auto tl = f32(target_logit);
  const float* mp = m.data_ptr<float>();
  const float* sp = s.data_ptr<float>();
  const float* tp = tl.data_ptr<float>();
  // Exactly one shard holds each target (the others report -inf); checked before any work.
  for (int64_t t = 0; t < t_dim; ++t) {
    int64_t holders = 0;
    for (int64_t r = 0; r < r_dim; ++r) holders += tp[r * t_dim + t] != kNegInf;
    TORCH_CHECK(holders == 1, op, ": token ", t, " has its target in ", holders, " of ", r_dim,
                " shards; exactly one must hold it (is the target id outside the vocab?)");
  }
  count_launch(kLogpCombine, kCpu);
  auto logp = at::empty({t_dim}, m.options());
  auto lse = at::empty({t_dim}, m.options());
  float* op_ = logp.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  parallel_rows(t_dim, [&](int64_t b, int64_t e) {
    std::vector<LseNode> nodes(r_dim);
    for (int64_t t = b; t < e; ++t) {
      float target = kNegInf;
      for (int64_t r = 0; r < r_dim; ++r) {
        nodes[r] = {mp[r * t_dim + t], sp[r * t_dim + t]};
        if (tp[r * t_dim + t] != kNegInf) target = tp[r * t_dim + t];
      }
      const LseNode root = lse_tree(nodes.data(), r_dim);
      lp[t] = root.m + std::log(root.s);
      op_[t] = target - lp[t];
    }
  });
  return {logp, lse};
}

std::tuple<at::Tensor, at::Tensor> linear_logp_backward(const at::Tensor& grad_logp,
                                                        const at::Tensor& hidden,
                                                        const at::Tensor& weight,
                                                        const at::Tensor& target,
                                                        const at::Tensor& lse, int64_t vocab_start) {
  constexpr const char* op = "rl_engine::linear_logp_backward";
  check_shard(op, hidden, weight, target);
  check_float_dtype(grad_logp, "grad_logp");
  check_float_dtype(lse, "lse");
  const int64_t t_dim = hidden.size(0), h_dim = hidden.size(1), v_local = weight.size(0);
  TORCH_CHECK(grad_logp.dim() == 1 && grad_logp.size(0) == t_dim && lse.dim() == 1 &&
              lse.size(0) == t_dim, op, ": grad_logp and lse must be [T] with T = ", t_dim,
              ", got ", grad_logp.sizes(), " and ", lse.sizes());
  count_launch(kLinearLogpBackward, kCpu);
  auto g = f32(grad_logp);
  auto h = f32(hidden);
  auto w = f32(weight);
  auto tg = target.contiguous();
  auto ls = f32(lse);
  auto grad_hidden = at::empty({t_dim, h_dim}, h.options());
  auto grad_weight = at::empty({v_local, h_dim}, h.options());
  const float* gp = g.data_ptr<float>();
  const float* hp = h.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const int64_t* tp = tg.data_ptr<int64_t>();
  const float* lp = ls.data_ptr<float>();
  float* ghp = grad_hidden.data_ptr<float>();
  float* gwp = grad_weight.data_ptr<float>();
  // The tile size only sets cache blocking here; the sum over v is in index order regardless.
  constexpr int64_t kVocabBlock = 64;
  parallel_rows(t_dim, [&](int64_t b, int64_t e) {
    linear_logp_grad_hidden_rows(gp, hp, wp, tp, lp, ghp, b, e, v_local, h_dim, vocab_start,
                                 kVocabBlock);
  });
  parallel_rows(v_local, [&](int64_t b, int64_t e) {
    linear_logp_grad_weight_rows(gp, hp, wp, tp, lp, gwp, b, e, t_dim, h_dim, vocab_start);
  });
  return {grad_hidden, grad_weight};
}

}  // namespace

TORCH_LIBRARY_IMPL(rl_engine, CPU, m) {
  m.impl("linear_logp_partial", &linear_logp_partial);
  m.impl("logp_combine", &logp_combine);
  m.impl("linear_logp_backward", &linear_logp_backward);
}

}  // namespace rl_engine::cpu
