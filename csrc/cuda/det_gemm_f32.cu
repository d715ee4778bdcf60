// det_gemm's kernels with float output, and the split-K range sums that every output type
// launches (see det_gemm_instances.h). No torch headers here.
#include "cuda/det_gemm_instances.h"

namespace rl_engine::cuda {

RLK_DET_GEMM_PLANNED(float);
RLK_DET_GEMM_RANGE_SUMS;

}  // namespace rl_engine::cuda
