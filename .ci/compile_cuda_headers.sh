#!/usr/bin/env bash
# Compiles every header in include/rl_engine/cuda/ for sm_90a in one small translation unit, so a
# kernel that does not compile cannot land. CI has nvcc but no GPU; without nvcc this says so and
# passes (the CPU build does not need the headers).
set -euo pipefail
cd "$(dirname "$0")/.."

NVCC="${NVCC:-$(command -v nvcc || true)}"
if [[ -z "$NVCC" && -x /usr/local/cuda/bin/nvcc ]]; then NVCC=/usr/local/cuda/bin/nvcc; fi
if [[ -z "$NVCC" ]]; then
  echo "compile_cuda_headers: nvcc not found; skipping the sm_90a header check"
  exit 0
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
tu="$work/all_headers.cu"
for h in include/rl_engine/cuda/*.cuh; do
  echo "#include \"${h#include/}\"" >> "$tu"
done
# Instantiate the templated kernels too: an error inside a template body only shows when used.
cat >> "$tu" <<'CU'
namespace rc = rl_engine::cuda;
cudaError_t rlk_check_gemm(const rc::GemmOperands& g, __nv_bfloat16* y, float* f, float* ws,
                           rc::LogpTileEpilogue lp, rc::DlogitEpilogue<__nv_bfloat16> dl) {
  const rc::StoreEpilogue<__nv_bfloat16> sb{y, g.n, nullptr, false, true};
  const rc::StoreEpilogue<float> sf{f, g.n, nullptr, true, true};
  const rc::GemmPlan plan = rc::plan_det_gemm(g.m, g.n, g.k, 132, true);
  cudaError_t e = rc::launch_det_gemm_planned(g, sb, plan, ws, 132, nullptr);
  if (e == cudaSuccess) e = rc::launch_det_gemm_planned(g, sf, plan, ws, 132, nullptr);
  if (e == cudaSuccess) e = rc::launch_det_gemm_sm90(g, lp, 132, nullptr);
  if (e == cudaSuccess) e = rc::launch_det_gemm_sm90(g, dl, 132, nullptr);
  return e == cudaSuccess ? rc::launch_det_gemm_f32(g, sf, nullptr) : e;
}
template __global__ void rc::rlk_rmsnorm_fwd_kernel<__nv_bfloat16, 128, 8>(
    const __nv_bfloat16*, const __nv_bfloat16*, __nv_bfloat16*, float*, int64_t, int, float, float);
template __global__ void rc::rlk_rmsnorm_bwd_kernel<__half, 16, 1>(
    const __half*, const __half*, const __half*, const float*, __half*, float*, int64_t, int, float, int, unsigned*, int);
template __global__ void rc::rlk_rope_kernel<float, 4>(const float*, const int64_t*, const float*, float,
                                                   float*, int64_t, int, int);
template __global__ void rc::rlk_swiglu_kernel<__nv_bfloat16, 8>(const __nv_bfloat16*, __nv_bfloat16*, int64_t, int);
template __global__ void rc::rlk_swiglu_bwd_kernel<__half, 1>(const __half*, const __half*, __half*, int64_t, int);
template __global__ void rc::rlk_det_gemm_transpose_kernel<__half>(const __half*, int64_t, int, int, __half*, int64_t, bool, bool);
template __global__ void rc::rlk_linear_logp_dlogit_kernel<__nv_bfloat16>(const float*, int64_t, int64_t, int, int64_t, int64_t,
                                                          const int64_t*, const float*, const float*, __nv_bfloat16*);
template cudaError_t rc::launch_rank_order_sum<__nv_bfloat16, 8>(const __nv_bfloat16*, int64_t, int64_t, float*, int, cudaStream_t);
template cudaError_t rc::launch_rank_order_sum<__half, 1>(const __half*, int64_t, int64_t, float*, int, cudaStream_t);
template cudaError_t rc::launch_rank_order_sum<float, 4>(const float*, int64_t, int64_t, float*, int, cudaStream_t);
template __global__ void rc::rlk_ipc_all_gather_kernel<__half, 8>(rc::IpcPeers, int, int, const __half*, int64_t, int64_t,
                                                              __half*, bool, bool, uint64_t*);
template __global__ void rc::rlk_ipc_reduce_scatter_kernel<float, 4>(rc::IpcPeers, int, int, const float*, int64_t, int64_t,
                                                                 float*, bool, bool, uint64_t*);
template __global__ void rc::rlk_ipc_all_reduce_kernel<__nv_bfloat16, 8>(rc::IpcPeers, int, int, const __nv_bfloat16*, int64_t,
                                                                     int64_t, __nv_bfloat16*, bool, bool, uint64_t*);
template cudaError_t rc::attn::launch_attention_fwd_wgmma<__nv_bfloat16, 128, 64>(const rc::attn::FwdParams&, int64_t,
                                                                               int64_t, int, cudaStream_t);
template cudaError_t rc::attn::launch_attention_fwd_wgmma<__half, 64, 128>(const rc::attn::FwdParams&, int64_t, int64_t,
                                                                        int, cudaStream_t);
template cudaError_t rc::attn::launch_attention_decode<__nv_bfloat16, 128, 32>(const rc::attn::DecodeParams&, int,
                                                                            cudaStream_t);
// head_dim 128 as its models run it (kv_block_size): blocks of 128, the forward's only path without
// the warpgroups' overlap.
template cudaError_t rc::attn::launch_attention_fwd_wgmma<__nv_bfloat16, 128, 128>(const rc::attn::FwdParams&, int64_t,
                                                                                int64_t, int, cudaStream_t);
template cudaError_t rc::attn::launch_attention_decode<__nv_bfloat16, 128, 128>(const rc::attn::DecodeParams&, int,
                                                                             cudaStream_t);
CU

"$NVCC" --version | tail -n 1
# The macros torch's CUDAExtension defines: no implicit half/bf16 conversions or operators.
"$NVCC" -std=c++17 -O3 --use_fast_math --expt-relaxed-constexpr -D__CUDA_NO_HALF_OPERATORS__ \
  -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__ \
  -gencode=arch=compute_90a,code=sm_90a -Iinclude -c "$tu" -o "$work/all_headers.o"
# The A/B program of benchmarks/kernel_ab.sh, whose build runs only on the GPU machine otherwise.
"$NVCC" -std=c++17 -O3 --use_fast_math --expt-relaxed-constexpr -DKERNEL_AB_NO_GEMM \
  -gencode=arch=compute_90a,code=sm_90a -Iinclude -Icsrc -c benchmarks/kernel_ab.cu -o "$work/kernel_ab.o"
echo "compile_cuda_headers: $(ls include/rl_engine/cuda/*.cuh | wc -l) headers and benchmarks/kernel_ab.cu compile for sm_90a"
