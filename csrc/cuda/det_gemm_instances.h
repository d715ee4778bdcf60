// det_gemm's kernels compile in translation units of their own, one per output type
// (det_gemm_bf16.cu, det_gemm_f16.cu, det_gemm_f32.cu), so a parallel build compiles them side by
// side instead of one after another in det_gemm.cu: a unit that includes this file instantiates
// none of them. The split-K range sums (fp32 stores) that every output type launches compile with
// float's.
#pragma once

#include "rl_engine/cuda/det_gemm.cuh"

#define RLK_DET_GEMM_PLANNED(Out)                                                                     \
  template cudaError_t launch_det_gemm_planned<Out>(const GemmOperands&, const StoreEpilogue<Out>&, \
                                                    const GemmPlan&, float*, int, cudaStream_t)
#define RLK_DET_GEMM_RANGE_SUMS                                                                         \
  template cudaError_t launch_det_gemm_on<StoreEpilogue<float>>(const GemmTile&, const GemmOperands&, \
                                                                const StoreEpilogue<float>&,          \
                                                                const GemmSplit&, int, cudaStream_t)

namespace rl_engine::cuda {

extern RLK_DET_GEMM_PLANNED(__nv_bfloat16);
extern RLK_DET_GEMM_PLANNED(__half);
extern RLK_DET_GEMM_PLANNED(float);
extern RLK_DET_GEMM_RANGE_SUMS;

}  // namespace rl_engine::cuda
