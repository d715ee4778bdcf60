// wgmma shapes of the Hopper attention (sm_90a): m64nNk16 with N = 64 or 128, bf16/fp16 operands and
// fp32 accumulators in the m64nN fragment layout (warp w of the warpgroup holds rows 16w..16w+15 in
// the layout of an m16n8k16 C fragment per n8 tile). Two forms: both operands in shared memory
// (K-major), and A from registers (the m16n8k16 A fragment layout per warp) with B in shared memory.
// Every call accumulates (scale-d = 1): a zeroed accumulator is zeroed by the caller, as the
// mma.sync kernels do, so both give a row the same sequence of operations.
#pragma once

#include <cstdint>

#include "rl_engine/cuda/ptx.cuh"

namespace rl_engine::cuda::ptx {

// Descriptor of an N-major (transposed) tile written by TMA with 128-byte swizzle: 64-element panels
// of the N dimension `panel_bytes` apart (leading byte offset), 8-row groups of K 1024 bytes apart.
__device__ __forceinline__ uint64_t smem_desc_sw128_mn(uint32_t addr, uint32_t panel_bytes) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) |
         (static_cast<uint64_t>((panel_bytes >> 4) & 0x3FFF) << 16) |
         (static_cast<uint64_t>(1024 >> 4) << 32) | (1ull << 62);
}

#define RLK_WG_OUTS32 \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define RLK_WG_REGS32(d) \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define RLK_WG_OUTS64 \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define RLK_WG_REGS64(d) \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
  "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
  "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
  "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

// d[64 x N] += a[64 x 16] . b[N x 16]^T, both in shared memory, K-major unless kTA / kTB make that
// operand MN-major (16-bit types only; the descriptor must describe the layout it names).
template <int N, bool kHalf, bool kTA = false, bool kTB = false>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b) {
#ifdef RLK_NO_SM90A
  __trap();
#else
  if constexpr (N == 64 && kHalf) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {" RLK_WG_OUTS32 "}, %32, %33, 1, 1, 1, %34, %35;"
                 : RLK_WG_REGS32(d) : "l"(desc_a), "l"(desc_b), "n"(int{kTA}), "n"(int{kTB}));
  } else if constexpr (N == 64) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" RLK_WG_OUTS32 "}, %32, %33, 1, 1, 1, %34, %35;"
                 : RLK_WG_REGS32(d) : "l"(desc_a), "l"(desc_b), "n"(int{kTA}), "n"(int{kTB}));
  } else if constexpr (N == 128 && kHalf) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {" RLK_WG_OUTS64 "}, %64, %65, 1, 1, 1, %66, %67;"
                 : RLK_WG_REGS64(d) : "l"(desc_a), "l"(desc_b), "n"(int{kTA}), "n"(int{kTB}));
  } else if constexpr (N == 128) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" RLK_WG_OUTS64 "}, %64, %65, 1, 1, 1, %66, %67;"
                 : RLK_WG_REGS64(d) : "l"(desc_a), "l"(desc_b), "n"(int{kTA}), "n"(int{kTB}));
  } else {
    static_assert(N == 64 || N == 128, "wgmma_ss: N is 64 or 128");
  }
#endif
}

// d[64 x N] += a[64 x 16] . b[16 x N], a in registers, b in shared memory N-major, or K-major
// where kTB is false.
template <int N, bool kHalf, bool kTB = true>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b) {
#ifdef RLK_NO_SM90A
  __trap();
#else
  if constexpr (N == 64 && kHalf) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {" RLK_WG_OUTS32 "}, {%32, %33, %34, %35}, %36, 1, 1, 1, %37;"
                 : RLK_WG_REGS32(d) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(int{kTB}));
  } else if constexpr (N == 64) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" RLK_WG_OUTS32 "}, {%32, %33, %34, %35}, %36, 1, 1, 1, %37;"
                 : RLK_WG_REGS32(d) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(int{kTB}));
  } else if constexpr (N == 128 && kHalf) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {" RLK_WG_OUTS64 "}, {%64, %65, %66, %67}, %68, 1, 1, 1, %69;"
                 : RLK_WG_REGS64(d) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(int{kTB}));
  } else if constexpr (N == 128) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" RLK_WG_OUTS64 "}, {%64, %65, %66, %67}, %68, 1, 1, 1, %69;"
                 : RLK_WG_REGS64(d) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(int{kTB}));
  } else {
    static_assert(N == 64 || N == 128, "wgmma_rs: N is 64 or 128");
  }
#endif
}

#undef RLK_WG_OUTS32
#undef RLK_WG_REGS32
#undef RLK_WG_OUTS64
#undef RLK_WG_REGS64

}  // namespace rl_engine::cuda::ptx
