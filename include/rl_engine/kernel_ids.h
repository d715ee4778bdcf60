// Ids of the kernels whose launches are counted. The Python side reads the names in this order
// from rl_engine/ops/counters.py; tests/ops/test_counters.py keeps the two lists equal. The kIpc*
// kernels (the CUDA IPC collectives) have no CPU implementation.
#pragma once

namespace rl_engine {

enum KernelId : int {
  kDetGemm = 0,
  kDetGemmGradInput,
  kDetGemmGradWeight,
  kRmsnorm,
  kRmsnormBackward,
  kRope,
  kRopeBackward,
  kSwiglu,
  kSwigluBackward,
  kAttentionFwd,
  kAttentionDecode,
  kAttentionBwd,
  kLinearLogpPartial,
  kLogpCombine,
  kLinearLogpBackward,
  kRankOrderSum,
  kIpcAllGather,
  kIpcReduceScatter,
  kIpcAllReduce,
  kNumKernels,
};

enum KernelDevice : int { kCpu = 0, kCuda = 1 };

}  // namespace rl_engine
