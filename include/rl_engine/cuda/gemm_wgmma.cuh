// wgmma m64nNk16 of det_gemm for every tile width it uses (N = 8 ... 256), operands in shared
// memory (K-major; MN-major where kTA / kTB say so, at N >= 64), fp32 accumulators, scale-d = 1 (the
// caller zeroes them). The narrow widths serve the small-M tiles, 160 and 192 the shapes whose
// column count a 256-wide tile would leave a wave part-empty; every width gives an output element
// the same k16 step, so a row's bits do not depend on which width computed it.
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

// The wide shapes between 128 and 256 (the tiles that fit a wave of SMs better), immediates for the
// operand majors passed as "n" operands.
#define RLK_GW_R8(d, i) \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
      "+f"(d[i + 6]), "+f"(d[i + 7])
#define RLK_GW_REGS80(d) \
  RLK_GW_R8(d, 0), RLK_GW_R8(d, 8), RLK_GW_R8(d, 16), RLK_GW_R8(d, 24), RLK_GW_R8(d, 32), \
      RLK_GW_R8(d, 40), RLK_GW_R8(d, 48), RLK_GW_R8(d, 56), RLK_GW_R8(d, 64), RLK_GW_R8(d, 72)
#define RLK_GW_REGS96(d) RLK_GW_REGS80(d), RLK_GW_R8(d, 80), RLK_GW_R8(d, 88)
#define RLK_GW_OUTS80 \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, " \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79"
#define RLK_GW_OUTS96 \
  RLK_GW_OUTS80 ", %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
#define RLK_GW_WIDE(SHAPE, TYPE, OUTS, A, B, TA, TB, REGS)                                             \
  asm volatile("wgmma.mma_async.sync.aligned." SHAPE ".f32." TYPE "." TYPE " {" OUTS "}, " A ", " B  \
               ", 1, 1, 1, " TA ", " TB ";"                                                            \
               : REGS(d)                                                                           \
               : "l"(desc_a), "l"(desc_b), "n"(int{kTA}), "n"(int{kTB}))

template <int N, bool kHalf, bool kTA = false, bool kTB = false>
__device__ __forceinline__ void wgmma_gemm(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b) {
#ifdef RLK_NO_SM90A
  __trap();
#else
  static_assert(N >= 64 || !(kTA || kTB), "wgmma_gemm: MN-major operands only at N >= 64");
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
    wgmma_ss<N, kHalf, kTA, kTB>(d, desc_a, desc_b);
  } else if constexpr (N == 160 && kHalf) {
    RLK_GW_WIDE("m64n160k16", "f16", RLK_GW_OUTS80, "%80", "%81", "%82", "%83", RLK_GW_REGS80);
  } else if constexpr (N == 160) {
    RLK_GW_WIDE("m64n160k16", "bf16", RLK_GW_OUTS80, "%80", "%81", "%82", "%83", RLK_GW_REGS80);
  } else if constexpr (N == 192 && kHalf) {
    RLK_GW_WIDE("m64n192k16", "f16", RLK_GW_OUTS96, "%96", "%97", "%98", "%99", RLK_GW_REGS96);
  } else if constexpr (N == 192) {
    RLK_GW_WIDE("m64n192k16", "bf16", RLK_GW_OUTS96, "%96", "%97", "%98", "%99", RLK_GW_REGS96);
  } else {
    static_assert(N == 256, "wgmma_gemm: N is 8, 16, 32, 64, 128, 160, 192 or 256");
    wgmma_m64n256k16<kHalf, kTA, kTB>(d, desc_a, desc_b);
  }
#endif
}

#undef RLK_GW_WIDE
#undef RLK_GW_OUTS96
#undef RLK_GW_OUTS80
#undef RLK_GW_REGS96
#undef RLK_GW_REGS80
#undef RLK_GW_R8
#undef RLK_GW_NARROW
#undef RLK_GW_REGS16
#undef RLK_GW_REGS8
#undef RLK_GW_REGS4

}  // namespace rl_engine::cuda::ptx
