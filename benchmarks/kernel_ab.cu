// One side of an A/B run of the Hopper kernels (benchmarks/kernel_ab.sh builds it from two source
// trees): times the attention prefill forward and backward, the paged decode and det_gemm on fixed
// inputs and prints a hash of each output's bits, so the two builds' lines show at once whether a
// change kept the bits and what it did to the time. Plain CUDA, no torch: it builds in seconds
// where the extension takes minutes.
//
//   kernel_ab attn|decode|gemm    (one line per case: its name, median time, output hashes)
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "rl_engine/cuda/attention_params.h"
#ifndef KERNEL_AB_NO_GEMM  // det_gemm's instances take most of the build: attn and decode skip them
#include "rl_engine/cuda/det_gemm.cuh"
#endif

namespace {

namespace attn = rl_engine::cuda::attn;

void check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
  std::exit(1);
}

// xorshift64: the same inputs on both sides of the comparison.
uint64_t rng_state = 0x9E3779B97F4A7C15ull;
float uniform() {
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17;
  return static_cast<float>((rng_state >> 11) * (1.0 / 9007199254740992.0)) * 2.f - 1.f;
}

template <typename T>
T* upload(const std::vector<T>& h) {
  T* d = nullptr;
  check(cudaMalloc(&d, h.size() * sizeof(T)), "cudaMalloc");
  check(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice), "upload");
  return d;
}

__nv_bfloat16* random_bf16(size_t n, float scale) {
  std::vector<__nv_bfloat16> h(n);
  for (auto& x : h) x = __float2bfloat16(uniform() * scale);
  return upload(h);
}

template <typename T>
T* zeros(size_t n) {
  T* d = nullptr;
  check(cudaMalloc(&d, n * sizeof(T)), "cudaMalloc");
  check(cudaMemset(d, 0, n * sizeof(T)), "cudaMemset");
  return d;
}

// FNV-1a over the bytes: equal hashes on both sides mean equal bits.
unsigned long long bits_hash(const void* d, size_t bytes) {
  std::vector<unsigned char> h(bytes);
  check(cudaMemcpy(h.data(), d, bytes, cudaMemcpyDeviceToHost), "download");
  uint64_t x = 1469598103934665603ull;
  for (unsigned char c : h) x = (x ^ c) * 1099511628211ull;
  return x;
}

// Median of `reps` CUDA-event timings after three warm-up calls.
template <typename F>
float median_ms(F&& f, int reps) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  for (int i = 0; i < 3; ++i) f();
  std::vector<float> t(reps);
  for (float& ms : t) {
    cudaEventRecord(a);
    f();
    cudaEventRecord(b);
    check(cudaEventSynchronize(b), "kernel");
    cudaEventElapsedTime(&ms, a, b);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(t.begin(), t.end());
  return t[reps / 2];
}

// Causal sequences of the given lengths packed together, 32 query / 8 kv heads: forward,
// backward, and the backward with query tiles only (dq_ms: delta, chunk ends and dq) and with key
// tiles only (dkdv_ms: delta, chunk ends, dk/dv and the memsets of dk and dv).
void prefill(const std::vector<int>& lens, int d, int block) {
  const int hq = 32, hkv = 8;
  std::vector<int32_t> cu_h{0};
  std::vector<int64_t> pos;
  for (int n : lens) {
    cu_h.push_back(cu_h.back() + n);
    for (int i = 0; i < n; ++i) pos.push_back(i);
  }
  const int t = cu_h.back(), tiles = (t + 127) / 128 + static_cast<int>(lens.size());
  char name[64];
  if (lens.size() == 1) {
    std::snprintf(name, sizeof name, "t=%d", t);
  } else {
    int at = std::snprintf(name, sizeof name, "lens=%d", lens[0]);
    for (size_t i = 1; i < lens.size(); ++i) at += std::snprintf(name + at, sizeof name - at, "+%d", lens[i]);
  }
  attn::FwdParams f{};
  f.q = random_bf16(size_t(t) * hq * d, 1.f);
  f.k = random_bf16(size_t(t) * hkv * d, 1.f);
  f.v = random_bf16(size_t(t) * hkv * d, 1.f);
  f.out = zeros<__nv_bfloat16>(size_t(t) * hq * d);
  f.lse = zeros<float>(size_t(t) * hq);
  const int32_t* cu = upload(cu_h);
  f.cu_q = f.cu_k = cu;
  f.pos = upload(pos);
  f.batch = static_cast<int>(lens.size()), f.hq = hq, f.hkv = hkv;
  f.scale = 1.f / std::sqrt(static_cast<float>(d));
  f.scale_log2 = f.scale * 1.4426950408889634f;
  auto fwd = [&] { check(attn::launch_fwd(f, attn::AttnDType::kBF16, d, block, t, t, tiles, 0), "fwd"); };
  const float fwd_ms = median_ms(fwd, 20);
  std::printf("fwd %s d=%d block=%d ms=%.4f out=%016llx lse=%016llx\n", name, d, block, fwd_ms,
              bits_hash(f.out, size_t(t) * hq * d * 2), bits_hash(f.lse, size_t(t) * hq * 4));

  // The backward takes this side's own forward output and lse, so a forward that changed bits
  // shows here too.
  attn::BwdParams b{};
  b.dout = random_bf16(size_t(t) * hq * d, 1.f);
  b.q = f.q, b.k = f.k, b.v = f.v, b.lse = f.lse;
  float* delta = zeros<float>(size_t(t) * hq);
  b.delta = delta;
  b.dq = zeros<__nv_bfloat16>(size_t(t) * hq * d);
  b.dk = zeros<float>(size_t(t) * hkv * d);
  b.dv = zeros<float>(size_t(t) * hkv * d);
  b.cu_q = b.cu_k = cu;
  b.pos = f.pos;
  b.chunk_end = zeros<int32_t>(t);
  b.batch = f.batch, b.hq = hq, b.hkv = hkv, b.q_chunk = block;
  b.scale = f.scale, b.scale_log2 = f.scale_log2;
  auto bwd = [&](int q_tiles, int k_tiles) {
    return [&, q_tiles, k_tiles] {
      check(attn::launch_bwd(b, f.out, delta, attn::AttnDType::kBF16, d, t, t, q_tiles, k_tiles, 0), "bwd");
    };
  };
  const float dq_ms = median_ms(bwd(tiles, 0), 10), dkdv_ms = median_ms(bwd(0, tiles), 10);
  const float bwd_ms = median_ms(bwd(tiles, tiles), 10);
  std::printf("bwd %s d=%d block=%d ms=%.4f dq_ms=%.4f dkdv_ms=%.4f dq=%016llx dk=%016llx dv=%016llx\n", name,
              d, block, bwd_ms, dq_ms, dkdv_ms, bits_hash(b.dq, size_t(t) * hq * d * 2),
              bits_hash(b.dk, size_t(t) * hkv * d * 4), bits_hash(b.dv, size_t(t) * hkv * d * 4));
}

// Paged decode as benchmarks/hopper_attention.py runs it (batch 64 unless given), 4k context,
// pages of 16 in a shuffled table; `contiguous` keeps the pages in order instead (what the
// scattered pages cost).
void decode(int d, int block, bool contiguous = false, int batch = 64) {
  const int context = 4096, page = 16, hq = 32, hkv = 8, pages = batch * context / page;
  attn::DecodeParams p{};
  p.q = random_bf16(size_t(batch) * hq * d, 1.f);
  p.k_cache = random_bf16(size_t(pages) * page * hkv * d, 1.f);
  p.v_cache = random_bf16(size_t(pages) * page * hkv * d, 1.f);
  std::vector<int32_t> table(pages);
  for (int i = 0; i < pages; ++i) table[i] = i;
  for (int i = pages - 1; i > 0 && !contiguous; --i) {
    const int j = std::min(i, static_cast<int>((uniform() * 0.5f + 0.5f) * (i + 1)));
    std::swap(table[i], table[j]);
  }
  p.block_table = upload(table);
  p.seq_lens = upload(std::vector<int32_t>(batch, context));
  p.out = zeros<__nv_bfloat16>(size_t(batch) * hq * d);
  p.lse = zeros<float>(size_t(batch) * hq);
  p.hq = hq, p.hkv = hkv, p.page_size = page, p.max_pages = context / page, p.num_pages = pages;
  p.scale = 1.f / std::sqrt(static_cast<float>(d));
  p.scale_log2 = p.scale * 1.4426950408889634f;
  auto run = [&] { check(attn::launch_decode(p, attn::AttnDType::kBF16, d, block, batch, 0), "decode"); };
  const float ms = median_ms(run, 30);
  const double bytes = 2.0 * batch * context * hkv * d * 2 + 2.0 * batch * hq * d * 2;
  std::printf("decode d=%d block=%d batch=%d table=%s ms=%.4f tbs=%.3f out=%016llx lse=%016llx\n", d, block,
              batch, contiguous ? "contiguous" : "shuffled", ms, bytes / ms / 1e9,
              bits_hash(p.out, size_t(batch) * hq * d * 2), bits_hash(p.lse, size_t(batch) * hq * 4));
}

#ifndef KERNEL_AB_NO_GEMM
// Whether the tree's launch_det_gemm_planned takes RangeSums' counters (its sides may be built from
// trees before and after they came).
template <typename Op, typename = void>
struct TakesCounters : std::false_type {};
template <typename Op>
struct TakesCounters<Op, std::void_t<decltype(rl_engine::cuda::launch_det_gemm_planned(
                             std::declval<const Op&>(), rl_engine::cuda::StoreEpilogue<__nv_bfloat16>{},
                             rl_engine::cuda::GemmPlan{}, static_cast<float*>(nullptr),
                             static_cast<unsigned long long*>(nullptr), 0, cudaStream_t{}))>> : std::true_type {};

// det_gemm as planned for (m, n, k) into bf16, split K where the plan splits it.
template <typename Op = rl_engine::cuda::GemmOperands>
void gemm(const char* name, int m, int n, int k, int sms) {
  const void* a = random_bf16(size_t(m) * k, 1.f);
  const void* w = random_bf16(size_t(n) * k, 0.05f);
  auto* out = zeros<__nv_bfloat16>(size_t(m) * n);
  using namespace rl_engine::cuda;
  const GemmPlan plan = plan_det_gemm(m, n, k, sms, true);
  float* scratch = plan.scratch_floats > 0 ? zeros<float>(plan.scratch_floats) : nullptr;
  const Op op{a, k, w, k, m, n, k, DType::kBF16};
  const StoreEpilogue<__nv_bfloat16> epi{out, n, nullptr, false, n % 2 == 0, n % 8 == 0, 0};
  unsigned long long* counters = nullptr;  // RangeSums' where the tree has them (no zeroing needed)
  if constexpr (TakesCounters<Op>::value) {
    // A generic lambda: the name is looked up only in a tree that has it.
    const int64_t words = [](const auto& p, int rows, int cols) { return det_gemm_counters(p, rows, cols); }(plan, m, n);
    if (words > 0) counters = zeros<unsigned long long>(words);
  }
  auto run = [&] {
    if constexpr (TakesCounters<Op>::value) {
      check(launch_det_gemm_planned(op, epi, plan, scratch, counters, sms, 0), "det_gemm");
    } else {
      check(launch_det_gemm_planned(op, epi, plan, scratch, sms, 0), "det_gemm");
    }
  };
  const float ms = median_ms(run, 50);
  std::printf("gemm %s m=%d n=%d k=%d tile=%dx%d%s splits=%d us=%.2f out=%016llx\n", name, m, n, k, plan.tile.bm,
              plan.tile.bn, plan.tile.swap ? "s" : "", plan.split.splits, ms * 1000,
              bits_hash(out, size_t(m) * n * 2));
}
#endif

}  // namespace

int main(int argc, char** argv) {
  const char* what = argc > 1 ? argv[1] : "attn";
  int sms = 0;
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), "device");
  if (!std::strcmp(what, "attn")) {
    for (int block : {64, 128}) {
      for (int d : {128, 64}) {
        prefill({8192}, d, block);
        prefill({4096}, d, block);
      }
      // Lengths off the tile and block edges: partial blocks, the masked tails, a second sequence.
      prefill({1000, 3097}, 128, block);
    }
  } else if (!std::strcmp(what, "decode")) {
    for (int d : {128, 64})
      for (int block : {64, 128}) decode(d, block);
    decode(128, 64, true);
    // A batch of 8 x 8 kv heads: 64 CTAs, fewer than the SMs, so no occupancy is won or lost.
    for (int block : {64, 128}) decode(64, block, false, 8);
#ifndef KERNEL_AB_NO_GEMM
  } else if (!std::strcmp(what, "gemm")) {
    const struct { const char* name; int n, k; } shapes[] = {
        {"square", 4096, 4096}, {"deep", 4096, 12288}, {"8b_kv", 1024, 4096}, {"4b_o", 2560, 4096},
        {"4b_down", 2560, 9728}, {"4b_q", 4096, 2560}, {"4b_kv", 1024, 2560}, {"4b_qkv", 6144, 2560},
        {"wide", 12288, 4096}, {"8b_gate_up", 24576, 4096}};
    for (const auto& s : shapes)
      for (int m : {1, 16, 32, 64, 128, 256, 1024, 8192}) gemm(s.name, m, s.n, s.k, sms);
    gemm("lm_head", 8192, 151936, 4096, sms);  // Qwen3's vocab: linear_logp's product
#endif
  } else {
    std::fprintf(stderr, "kernel_ab: unknown case set '%s' (attn, decode or gemm; gemm needs a build "
                         "without KERNEL_AB_NO_GEMM)\n", what);
    return 2;
  }
  return 0;
}
