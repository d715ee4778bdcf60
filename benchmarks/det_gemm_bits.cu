// det_gemm through its plan (plan_det_gemm + launch_det_gemm_planned, bf16) at 54 shapes: M = 40 to
// 4097 against six weights of benchmarks/hopper_ops.py's kind (a ragged N = 2592 among them), bias on
// even M. Every output goes to one file, so two builds can be compared byte for byte, and each line
// prints the plan and its median time of 25 launches:
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a --use_fast_math --expt-relaxed-constexpr \
//     -I<tree>/include -I<tree>/csrc benchmarks/det_gemm_bits.cu -o det_gemm_bits_<tree>
//   ./det_gemm_bits_a a.bin > a.txt; ./det_gemm_bits_b b.bin > b.txt; cmp a.bin b.bin
//
// benchmarks/results/h100/paired/pair_check.txt is its listing at b8b1874 (built against b8b1874's
// and ad124a8's headers), printed before its fill and timer moved to cuda_bench.cuh.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <vector>

#include "cuda_bench.cuh"
#include "rl_engine/cuda/det_gemm.cuh"
using namespace rl_engine::cuda;

int main(int argc, char** argv) {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  FILE* f = argc == 2 ? fopen(argv[1], "wb") : nullptr;
  if (f == nullptr) {
    std::fprintf(stderr, "usage: %s OUT.bin (a file this program can create)\n", argv[0]);
    return 2;
  }
  const int nk[][2] = {{4096, 4096}, {2560, 4096}, {1024, 2560}, {19456, 2560}, {2592, 4096}, {4096, 12288}};
  const int ms[] = {40, 48, 64, 96, 128, 200, 256, 1000, 4097};
  for (auto& s : nk) for (int m : ms) {
    const int n = s[0], k = s[1];
    __nv_bfloat16 *a, *b, *c; float *bias, *scratch = nullptr;
    cudaMalloc(&a, size_t(m) * k * 2); cudaMalloc(&b, size_t(n) * k * 2); cudaMalloc(&c, size_t(m) * n * 2);
    cudaMalloc(&bias, n * 4);
    fill_hashed<<<1024, 256>>>(a, size_t(m) * k, 1u + m, 1.f);
    fill_hashed<<<1024, 256>>>(b, size_t(n) * k, 2u + n, 0.02f);
    std::vector<float> hb(n); for (int i = 0; i < n; ++i) hb[i] = 0.001f * (i % 97);
    cudaMemcpy(bias, hb.data(), n * 4, cudaMemcpyHostToDevice);
    const GemmOperands op{a, k, b, k, m, n, k, DType::kBF16};
    const GemmPlan plan = plan_det_gemm(m, n, k, sms, true);
    if (plan.scratch_floats) cudaMalloc(&scratch, plan.scratch_floats * 4);
    unsigned long long* counters = nullptr;  // RangeSums' (no zeroing needed)
    if (const int64_t words = det_gemm_counters(plan, m, n)) cudaMalloc(&counters, words * 8);
    const bool with_bias = m % 2 == 0;
    cudaMemset(c, 0xff, size_t(m) * n * 2);
    const StoreEpilogue<__nv_bfloat16> store{c, n, with_bias ? bias : nullptr, false, true, true, 0};
    cudaError_t le = launch_det_gemm_planned(op, store, plan, scratch, counters, sms, 0);
    cudaDeviceSynchronize();
    std::vector<uint16_t> h(size_t(m) * n);
    cudaMemcpy(h.data(), c, h.size() * 2, cudaMemcpyDeviceToHost);
    fwrite(h.data(), 2, h.size(), f);
    const float us = median_us([&] { launch_det_gemm_planned(op, store, plan, scratch, counters, sms, 0); }, 25, 0);
    printf("m=%5d n=%5d k=%5d tile %dx%d%s splits %d%s  %8.1f us  launch=%s err=%s\n", m, n, k, plan.tile.bm, plan.tile.bn,
           plan.tile.swap ? " swapped" : "", plan.split.splits, plan.split.across ? " across" : "", us,
           cudaGetErrorString(le), cudaGetErrorString(cudaGetLastError()));
    cudaFree(a), cudaFree(b), cudaFree(c), cudaFree(bias); if (scratch) cudaFree(scratch);
    if (counters) cudaFree(counters);
  }
  fclose(f);
}
