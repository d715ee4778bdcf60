"""Kernel families: the one place that maps a traced event name to the family it belongs to.

CUDA kernel symbols carry their family as `rlk_<family>_...`; on the CPU the profiler records each
extension op as a `rl_engine::<op>` event. Reference collectives (NCCL kernels, gloo / c10d op
events) are the production payload paths that an all-R plan must not use on CUDA.
"""

from __future__ import annotations

import re

FAMILIES: tuple[str, ...] = (
    "det_gemm", "rmsnorm", "rope", "swiglu", "attention_fwd", "attention_bwd", "attention_decode",
    "linear_logp", "ipc_all_gather", "ipc_reduce_scatter", "ipc_all_reduce",
)
COLLECTIVE_FAMILIES: tuple[str, ...] = ("ipc_all_gather", "ipc_reduce_scatter", "ipc_all_reduce")
# The CPU's fixed-order reductions sum gathered payloads with this op; it has no CUDA symbol.
CPU_ONLY_FAMILIES: tuple[str, ...] = ("rank_order_sum",)
# The plain fp32 GEMM kernel (no tensor cores), which runs only for fp32 operands: a bf16 or
# fp16 model under an R plan must never launch it, so it is counted apart from det_gemm.
CUDA_ONLY_FAMILIES: tuple[str, ...] = ("det_gemm_f32",)

# A CUDA kernel belongs to a family when its (demangled or short) name contains the pattern.
# Longest first, so that no family's pattern can claim a kernel of a family it prefixes
# (rlk_det_gemm_f32_kernel is det_gemm_f32, not det_gemm).
CUDA_PATTERNS: tuple[tuple[str, str], ...] = tuple(sorted(
    ((f"rlk_{family}_", family) for family in (*FAMILIES, *CUDA_ONLY_FAMILIES)),
    key=lambda p: -len(p[0])))

# Every op of csrc/schema.cpp that does work, by the family its launches count toward.
CPU_OPS: dict[str, str] = {
    "rl_engine::det_gemm": "det_gemm",
    "rl_engine::det_gemm_grad_input": "det_gemm",
    "rl_engine::det_gemm_grad_weight": "det_gemm",
    "rl_engine::rmsnorm": "rmsnorm",
    "rl_engine::rmsnorm_backward": "rmsnorm",
    "rl_engine::rope": "rope",
    "rl_engine::rope_backward": "rope",
    "rl_engine::swiglu": "swiglu",
    "rl_engine::swiglu_backward": "swiglu",
    "rl_engine::attention_fwd": "attention_fwd",
    "rl_engine::attention_bwd": "attention_bwd",
    "rl_engine::attention_decode": "attention_decode",
    "rl_engine::linear_logp_partial": "linear_logp",
    "rl_engine::logp_combine": "linear_logp",
    "rl_engine::linear_logp_backward": "linear_logp",
    "rl_engine::rank_order_sum": "rank_order_sum",
}

# Production collective payloads: NCCL kernels on CUDA (ncclKernel_*, ncclDevKernel_*), and the
# process-group op events of gloo / NCCL / c10d in a CPU trace.
REFERENCE_CUDA = re.compile(r"nccl", re.IGNORECASE)
REFERENCE_CPU = re.compile(r"^(gloo:|nccl:|c10d::)")

# Families each module's R implementation launches, per device and side. A family outside this
# table for the module is not evidence of that module's route.
_CPU_MODULE = {
    "attention": {"training": ("det_gemm", "rmsnorm", "rope", "attention_fwd", "attention_bwd"),
                  "rollout": ("det_gemm", "rmsnorm", "rope", "attention_fwd", "attention_decode")},
    "ffn": {"training": ("det_gemm", "rmsnorm", "swiglu"),
            "rollout": ("det_gemm", "rmsnorm", "swiglu")},
    # The rollout's logp route also computes the sampling logits with det_gemm.
    "logp": {"training": ("rmsnorm", "linear_logp"),
             "rollout": ("det_gemm", "rmsnorm", "linear_logp")},
}
# The CUDA gate asks only for the families whose kernels carry an `rlk_` symbol on sm90.
_CUDA_MODULE = {
    "attention": {"training": ("det_gemm", "attention_fwd", "attention_bwd"),
                  "rollout": ("det_gemm", "attention_fwd", "attention_decode")},
    "ffn": {"training": ("det_gemm", "swiglu"), "rollout": ("det_gemm", "swiglu")},
    "logp": {"training": ("linear_logp",), "rollout": ("det_gemm", "linear_logp")},
}


def module_families(module: str, side: str, device: str) -> tuple[str, ...]:
    table = _CUDA_MODULE if device == "cuda" else _CPU_MODULE
    return table[module][side]


def cuda_family(name: str) -> str | None:
    """The family of a CUDA kernel name, or None for a kernel that is not rl_engine's."""
    for pattern, family in CUDA_PATTERNS:
        if pattern in name:
            return family
    return None


def cpu_family(name: str) -> str | None:
    """The family of a CPU op event name, or None for an op that is not rl_engine's."""
    return CPU_OPS.get(name)


def is_reference_collective(name: str, device: str) -> bool:
    if device == "cuda":
        return bool(REFERENCE_CUDA.search(name))
    return bool(REFERENCE_CPU.match(name))


# Production kernel families: the torch-native and vendor kernels that P routes launch. Under an R
# route none may run inside that module's `rlk.<module>` range. A name is tried against the
# rl_engine patterns first, so an `rlk_` symbol is never taken for a production kernel, and then
# in this order: the attention libraries before the norm, softmax and GEMM patterns, since their
# names also mention softmax, GEMM tiles and cutlass.
PRODUCTION_CUDA: tuple[tuple[str, re.Pattern[str]], ...] = (
    # torch's memory-efficient SDPA (fmha_cutlassF_bf16_aligned_64x64_rf_sm80, fmha_cutlassB_...).
    ("efficient_sdpa", re.compile(r"fmha_cutlass|efficient_attention", re.IGNORECASE)),
    # cuDNN's fused attention (cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_..., and
    # the older fmha_* kernels).
    ("cudnn_sdpa", re.compile(r"cudnn|sm\d+_flash_[fb]prop|fmha", re.IGNORECASE)),
    # flash-attention (pytorch_flash::flash_fwd_kernel, flash_fwd_splitkv_kernel,
    # flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel, flash_bwd_dot_do_o_kernel; FA3's FlashAttn*).
    ("flash_sdpa", re.compile(r"pytorch_flash|flash_fwd|flash_bwd|FlashAttn", re.IGNORECASE)),
    # torch's layer-norm kernels, which F.rms_norm also runs (vectorized_layer_norm_kernel,
    # RowwiseMomentsCUDAKernel, GammaBetaBackward..., cuComputeGradInput).
    ("torch_norm", re.compile(r"rms_?norm|layer_?norm|RowwiseMoments|GammaBetaBackward|"
                              r"cuComputeGradInput|cuComputePartGradGammaBeta|cuComputeGradGammaBeta",
                              re.IGNORECASE)),
    # softmax_warp_forward, cunn_SoftMaxForward, LogSoftMaxForwardEpilogue, ...
    ("torch_softmax", re.compile(r"softmax", re.IGNORECASE)),
    # cuBLAS / cuBLASLt: sm90_xmma_gemm_*, nvjet_*, ampere_bf16_s16816gemm_*, cutlass_80_tensorop_
    # *gemm*, gemv2T_kernel, gemvx, splitKreduce_kernel.
    ("cublas_gemm", re.compile(r"gemm|gemv|nvjet|xmma|cublas|cutlass|splitKreduce", re.IGNORECASE)),
)

# The CPU twins are op events: ops that only a P route calls inside a module's range. Backward
# ops (aten::_scaled_dot_product_flash_attention_for_cpu_backward, aten::_log_softmax_backward_data,
# aten::_fused_rms_norm_backward) fall under the same prefixes.
PRODUCTION_CPU: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("aten_gemm", re.compile(r"^aten::(linear|mm|addmm|matmul|bmm|baddbmm|addbmm)$")),
    ("aten_sdpa", re.compile(r"^aten::(scaled_dot_product_attention|_scaled_dot_product_)")),
    ("aten_norm", re.compile(r"^aten::(rms_norm|_fused_rms_norm|layer_norm|native_layer_norm)")),
    ("aten_softmax", re.compile(r"^aten::(_?log_softmax|_?softmax)")),
)
PRODUCTION_FAMILIES: dict[str, tuple[str, ...]] = {
    "cuda": tuple(f for f, _ in PRODUCTION_CUDA), "cpu": tuple(f for f, _ in PRODUCTION_CPU)}


def rl_engine_family(name: str, device: str) -> str | None:
    return cuda_family(name) if device == "cuda" else cpu_family(name)


def production_family(name: str, device: str) -> str | None:
    """The production family of a kernel (cuda) or op event (cpu) name, or None. An rl_engine
    kernel is never production, whatever else its name mentions."""
    if rl_engine_family(name, device):
        return None
    for family, pattern in PRODUCTION_CUDA if device == "cuda" else PRODUCTION_CPU:
        if pattern.search(name):
            return family
    return None
