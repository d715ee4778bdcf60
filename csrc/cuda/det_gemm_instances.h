// det_gemm's kernels compile in translation units of their own, one per output type
// (det_gemm_bf16.cu, det_gemm_f16.cu, det_gemm_f32.cu), so a parallel build compiles them side by
// side instead of one after another in det_gemm.cu: a unit that includes this file instantiates
// none of them.
#pragma once

#include "rl_engine/cuda/det_gemm.cuh"

#define RLK_DET_GEMM_PLANNED(Out)                                                                     \
  template cudaError_t launch_det_gemm_planned<Out>(const GemmOperands&, const StoreEpilogue<Out>&, \
                                                    const GemmPlan&, float*, unsigned long long*, int, \
                                                    cudaStream_t)

namespace rl_engine::cuda {

extern RLK_DET_GEMM_PLANNED(__nv_bfloat16);
extern RLK_DET_GEMM_PLANNED(__half);
extern RLK_DET_GEMM_PLANNED(float);

}  // namespace rl_engine::cuda
