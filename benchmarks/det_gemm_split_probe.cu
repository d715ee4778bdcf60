// det_gemm with K in 1 to 4 ranges against cuBLAS (cublasGemmEx, bf16 in and out, fp32 compute), at
// the shapes whose K choose_gemm_split leaves in one range (N > 3072) and M = 1 to 8192. Each plan is
// plan_det_gemm's layout for that range count (plan_det_gemm_in with gemm_split_in's ranges); times
// are medians of CUDA graphs that cycle through copies of the weight that do not fit in L2
// together, as benchmarks/hopper_ops.py times det_gemm. It asks whether the K chain bounds
// those shapes at decode sizes (more ranges would shorten it). A second part times the K = 12288
// shape at M = 1, 2, 4 and 8 on the swapped 32 x 8 tile with A's tensor map declaring the rows
// that exist or 8 (only the rows that exist stored), for the M = 1-2 rows that run longer than
// M = 4 on an H200. Results: benchmarks/results/h100/split_probe/. Build (no GPU needed) with the
// CUDA 13 cuBLAS of the GPU machine's torch (nvidia/cu13), run there with that lib folder on
// LD_LIBRARY_PATH:
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a --use_fast_math --expt-relaxed-constexpr \
//     -I include -I csrc -I $CU13/include -L $CU13/lib -o split_probe benchmarks/det_gemm_split_probe.cu \
//     -l:libcublas.so.13 -l:libcublasLt.so.13
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "cuda_bench.cuh"
#include "rl_engine/cuda/det_gemm.cuh"

using namespace rl_engine::cuda;

static void check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
  std::exit(1);
}

// Stores rows < rows of the swapped fragment only (A's tensor map may declare more).
struct RowLimit {
  StoreEpilogue<__nv_bfloat16> e;
  int rows;
  __device__ __forceinline__ void store_one(int row, int col, float v, int m, int n) const {
    if (row < rows) e.store_one(row, col, v, m, n);
  }
};

static cudaStream_t stream;

// Median us per call of calls launches captured in one graph.
static float graph_us(const std::function<void(int)>& launch, int calls, int reps = 15) {
  cudaGraph_t g;
  cudaGraphExec_t ge;
  check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed), "capture");
  for (int i = 0; i < calls; ++i) launch(i);
  check(cudaStreamEndCapture(stream, &g), "end capture");
  check(cudaGraphInstantiate(&ge, g, 0), "instantiate");
  for (int i = 0; i < 3; ++i) check(cudaGraphLaunch(ge, stream), "replay");
  cudaEvent_t a, b;
  cudaEventCreate(&a), cudaEventCreate(&b);
  std::vector<float> t;
  for (int r = 0; r < reps; ++r) {
    cudaEventRecord(a, stream);
    cudaGraphLaunch(ge, stream);
    cudaEventRecord(b, stream);
    check(cudaEventSynchronize(b), "sync");
    float ms;
    cudaEventElapsedTime(&ms, a, b);
    t.push_back(ms * 1000 / calls);
  }
  std::sort(t.begin(), t.end());
  cudaGraphExecDestroy(ge);
  cudaGraphDestroy(g);
  return t[t.size() / 2];
}

static __nv_bfloat16* filled(size_t n, unsigned seed, float scale) {
  __nv_bfloat16* p;
  check(cudaMalloc(&p, n * 2), "malloc");
  fill_hashed<<<1024, 256>>>(p, n, seed, scale);
  return p;
}

int main() {
  int sms = 0;
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), "device");
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  cublasHandle_t h;
  cublasCreate(&h);
  cublasSetStream(h, stream);
  void* cublas_ws;
  check(cudaMalloc(&cublas_ws, 32 << 20), "ws");
  cublasSetWorkspace(h, cublas_ws, 32 << 20);
  const struct { const char* name; int n, k; } shapes[] = {
      {"deep", 4096, 12288}, {"4b_q", 4096, 2560}, {"square", 4096, 4096}, {"4b_qkv", 6144, 2560},
      {"8b_qkv", 6144, 4096}};
  const int ms_list[] = {1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096, 8192};
  const size_t l2 = 60u << 20;
  for (const auto& s : shapes) {
    const size_t wbytes = size_t(s.n) * s.k * 2;
    const int copies = std::min<int>(24, std::max<int>(2, int((3 * l2 + wbytes - 1) / wbytes)));
    std::vector<__nv_bfloat16*> w;
    for (int i = 0; i < copies; ++i) w.push_back(filled(size_t(s.n) * s.k, 7 + i, 0.05f));
    __nv_bfloat16* x = filled(size_t(8192) * s.k, 3, 1.f);
    __nv_bfloat16* out;
    check(cudaMalloc(&out, size_t(8192) * s.n * 2), "out");
    float* scratch;
    check(cudaMalloc(&scratch, size_t(4) * 8192 * s.n * 4), "scratch");
    for (int m : ms_list) {
      const int calls = m <= 1024 ? std::max(4, copies) : 2;
      const float cub = graph_us([&](int i) {
        const float one = 1.f, zero = 0.f;
        cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, s.n, m, s.k, &one, w[i % copies], CUDA_R_16BF, s.k, x,
                     CUDA_R_16BF, s.k, &zero, out, CUDA_R_16BF, s.n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
      }, calls);
      const GemmPlan pick = plan_det_gemm(m, s.n, s.k, sms, true);
      for (int want = 1; want <= 4; ++want) {
        const GemmPlan p = plan_det_gemm_in(m, s.n, sms, gemm_split_in(s.k, want));
        if (want > 1 && p.split.splits == gemm_split_in(s.k, want - 1).splits) continue;
        const StoreEpilogue<__nv_bfloat16> epi{out, s.n, nullptr, false, true, true, 0};
        const float us = graph_us([&](int i) {
          const GemmOperands op{x, s.k, w[i % copies], s.k, m, s.n, s.k, DType::kBF16};
          check(launch_det_gemm_planned(op, epi, p, scratch, sms, stream), "det_gemm");
        }, calls);
        std::printf("%-7s m=%-5d splits=%d%s tile=%dx%d%s%s us=%8.2f cublas=%8.2f ratio=%.3f ws=%.2f\n", s.name, m,
                    p.split.splits, same_gemm_plan(p, pick) ? "*" : " ", p.tile.bm, p.tile.bn, p.tile.swap ? "s" : "",
                    p.split.across ? "a" : "", us, cub, cub / us, wbytes / us / 1e6 / 4.8);
        std::fflush(stdout);
      }
    }
    if (std::string(s.name) == "deep") {
      // M = 1 on the swapped 32 x 8 tile: A's map of 1 row, or of 8 rows with row 0 stored alone.
      for (int rows : {1, 2, 4, 8}) {
        for (int map_rows : {rows, 8}) {
          const RowLimit epi{{out, s.n, nullptr, false, true, true, 0}, rows};
          const float us = graph_us([&](int i) {
            const GemmOperands op{x, s.k, w[i % copies], s.k, map_rows, s.n, s.k, DType::kBF16};
            check(launch_det_gemm_tile<32, 8, true>(op, epi, gemm_no_split(s.k), sms, stream), "rows");
          }, std::max(4, copies));
          std::printf("deep rows=%d map_rows=%d us=%8.2f\n", rows, map_rows, us);
        }
      }
    }
    for (auto* p : w) cudaFree(p);
    cudaFree(x), cudaFree(out), cudaFree(scratch);
  }
  return 0;
}
