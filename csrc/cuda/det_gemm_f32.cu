// det_gemm's kernels with float output (see det_gemm_instances.h). No torch headers here.
#include "cuda/det_gemm_instances.h"

namespace rl_engine::cuda {

RLK_DET_GEMM_PLANNED(float);

}  // namespace rl_engine::cuda
