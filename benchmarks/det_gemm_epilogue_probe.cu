// det_gemm's 128 x 256 tile with its store epilogue and with one that stores nothing, at four large
// shapes (and the 128 x 192 and 128 x 128 tiles with the store): what the epilogue costs a tile.
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a --use_fast_math --expt-relaxed-constexpr \
//     -Iinclude -Icsrc benchmarks/det_gemm_epilogue_probe.cu -o det_gemm_epilogue_probe
//   ./det_gemm_epilogue_probe [random]
//
// The operands are zeros (cudaMemset) unless `random` asks for hashed values in [-1, 1): on zeros the
// tensor cores switch less than on real data, so the main loop may run faster and the epilogue's
// share read high. Compare the two columns, not the TF/s with benchmarks/hopper_ops.py's.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cstdio>
#include <string>

#include "cuda_bench.cuh"
#include "rl_engine/cuda/det_gemm.cuh"
using namespace rl_engine::cuda;

struct NullEpi {  // keeps the products alive, stores nothing unless *flag
  const int* flag;
  float* sink;
  template <int kA>
  __device__ __forceinline__ void operator()(const float (&acc)[kA], int row0, int col0, int m, int n) const {
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < kA; ++i) s += acc[i];
    if (*flag) sink[threadIdx.x] = s;
  }
};

int main(int argc, char** argv) {
  const bool random = argc > 1 && std::string(argv[1]) == "random";
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  const int shapes[][3] = {{8192, 4096, 4096}, {4096, 4096, 4096}, {8192, 12288, 4096}, {8192, 4096, 12288}};
  for (auto& s : shapes) {
    const int m = s[0], n = s[1], k = s[2];
    __nv_bfloat16 *a, *b, *c;
    cudaMalloc(&a, size_t(m) * k * 2);
    cudaMalloc(&b, size_t(n) * k * 2);
    cudaMalloc(&c, size_t(m) * n * 2);
    cudaMemset(a, 0, size_t(m) * k * 2);
    cudaMemset(b, 0, size_t(n) * k * 2);
    if (random) {
      fill_hashed<<<1024, 256>>>(a, size_t(m) * k, 1u, 1.f);
      fill_hashed<<<1024, 256>>>(b, size_t(n) * k, 2u, 0.02f);
    }
    int* flag;
    float* sink;
    cudaMalloc(&flag, 4);
    cudaMemset(flag, 0, 4);
    cudaMalloc(&sink, 4096);
    const GemmOperands op{a, k, b, k, m, n, k, DType::kBF16};
    const StoreEpilogue<__nv_bfloat16> store{c, n, nullptr, false, true, true, 0};
    const NullEpi null{flag, sink};
    const GemmSplit split = gemm_no_split(k);
    const float t_store = median_us([&] { launch_det_gemm_tile<128, 256, false>(op, store, split, sms, 0); });
    const float t_null = median_us([&] { launch_det_gemm_tile<128, 256, false>(op, null, split, sms, 0); });
    const float t_192 = median_us([&] { launch_det_gemm_tile<128, 192, false>(op, store, split, sms, 0); });
    const float t_128 = median_us([&] { launch_det_gemm_tile<128, 128, false>(op, store, split, sms, 0); });
    const double tf = 2.0 * m * n * k / 1e12;
    std::printf("m=%d n=%d k=%d  store %.1f us (%.0f TF/s)  no store %.1f us (%.0f)  epilogue share %.1f%%  "
                "128x192 %.1f us  128x128 %.1f us  err=%s\n",
                m, n, k, t_store, tf / t_store * 1e6, t_null, tf / t_null * 1e6, 100.0 * (t_store - t_null) / t_store,
                t_192, t_128, cudaGetErrorString(cudaGetLastError()));
    cudaFree(a), cudaFree(b), cudaFree(c), cudaFree(flag), cudaFree(sink);
  }
  return 0;
}
