// wgmma m64nNk16 of det_gemm for every tile width it uses (N = 8 ... 256), both operands K-major in
// shared memory, fp32 accumulators, scale-d = 1 (the caller zeroes them). The narrow widths serve the
// small-M tiles; every width gives an output element the same k16 step, so a row's bits do not
// depend on which width computed it.
#pragma once

#include <cstdint>

#include "rl_engine/cuda/ptx.cuh"
#include "rl_engine/cuda/wgmma.cuh"

namespace rl_engine::cuda::ptx {

#define RLK_GW_REGS4(d) "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
#define RLK_GW_REGS8(d) RLK_GW_REGS4(d), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
#define RLK_GW_REGS16(d) \
  RLK_GW_REGS8(d), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), \
      "+f"(d[14]), "+f"(d[15])

// The narrow shapes, spelled out: the instruction name carries N and the dtype.
#define RLK_GW_NARROW(SHAPE, TYPE, OUTS, A, B, REGS)                                             \
  asm volatile("wgmma.mma_async.sync.aligned." SHAPE ".f32." TYPE "." TYPE " {" OUTS "}, " A ", " B \
               ", 1, 1, 1, 0, 0;"                                                                  \
               : REGS(d)                                                                           \
               : "l"(desc_a), "l"(desc_b))

template <int N, bool kHalf>
__device__ __forceinline__ void wgmma_gemm(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b) {
#ifdef RLK_NO_SM90A
  __trap();
#else
  if constexpr (N == 8 && kHalf) {
    RLK_GW_NARROW("m64n8k16", "f16", "%0, %1, %2, %3", "%4", "%5", RLK_GW_REGS4);
  } else if constexpr (N == 8) {
    RLK_GW_NARROW("m64n8k16", "bf16", "%0, %1, %2, %3", "%4", "%5", RLK_GW_REGS4);
  } else if constexpr (N == 16 && kHalf) {
    RLK_GW_NARROW("m64n16k16", "f16", "%0, %1, %2, %3, %4, %5, %6, %7", "%8", "%9", RLK_GW_REGS8);
  } else if constexpr (N == 16) {
    RLK_GW_NARROW("m64n16k16", "bf16", "%0, %1, %2, %3, %4, %5, %6, %7", "%8", "%9", RLK_GW_REGS8);
  } else if constexpr (N == 32 && kHalf) {
    RLK_GW_NARROW("m64n32k16", "f16",
                  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15", "%16",
                  "%17", RLK_GW_REGS16);
  } else if constexpr (N == 32) {
    RLK_GW_NARROW("m64n32k16", "bf16",
                  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15", "%16",
                  "%17", RLK_GW_REGS16);
  } else if constexpr (N == 64 || N == 128) {
    wgmma_ss<N, kHalf>(d, desc_a, desc_b);
  } else {
    static_assert(N == 256, "wgmma_gemm: N is 8, 16, 32, 64, 128 or 256");
    wgmma_m64n256k16<kHalf>(d, desc_a, desc_b);
  }
#endif
}

#undef RLK_GW_NARROW
#undef RLK_GW_REGS16
#undef RLK_GW_REGS8
#undef RLK_GW_REGS4

}  // namespace rl_engine::cuda::ptx
