"""Launch counters kept inside the extension's kernels, read from Python.

KERNELS follows the enum of include/rl_engine/kernel_ids.h row for row.
"""

from __future__ import annotations

from rl_engine.ops import _lib

KERNELS: tuple[str, ...] = (
    "det_gemm", "det_gemm_grad_input", "det_gemm_grad_weight",
    "rmsnorm", "rmsnorm_backward", "rope", "rope_backward", "swiglu", "swiglu_backward",
    "attention_fwd", "attention_decode", "attention_bwd",
    "linear_logp_partial", "logp_combine", "linear_logp_backward",
    "rank_order_sum", "ipc_all_gather", "ipc_reduce_scatter", "ipc_all_reduce",
)
# Kernels with no CPU implementation: the IPC collectives move payloads between GPUs.
CUDA_ONLY: tuple[str, ...] = ("ipc_all_gather", "ipc_reduce_scatter", "ipc_all_reduce")
DEVICES: tuple[str, ...] = ("cpu", "cuda")

# The backend family each kernel belongs to (its backend id is rlkernel.<family>.<device>.v1).
FAMILY: dict[str, str] = {
    "det_gemm": "det_gemm", "det_gemm_grad_input": "det_gemm", "det_gemm_grad_weight": "det_gemm",
    "rmsnorm": "rmsnorm", "rmsnorm_backward": "rmsnorm", "rope": "rope", "rope_backward": "rope",
    "swiglu": "swiglu", "swiglu_backward": "swiglu",
    "attention_fwd": "attention", "attention_decode": "attention", "attention_bwd": "attention",
    "linear_logp_partial": "linear_logp", "logp_combine": "linear_logp",
    "linear_logp_backward": "linear_logp",
    "rank_order_sum": "collective", "ipc_all_gather": "collective",
    "ipc_reduce_scatter": "collective", "ipc_all_reduce": "collective",
}


def read() -> dict[tuple[str, str], int]:
    """{(kernel, device): launches} since load or the last reset."""
    table = _lib.ops().kernel_counters().tolist()
    return {(k, d): table[i][j] for i, k in enumerate(KERNELS) for j, d in enumerate(DEVICES)}


def delta(before: dict, after: dict) -> dict[tuple[str, str], int]:
    return {key: after[key] - before[key] for key in after if after[key] != before[key]}


def reset() -> None:
    _lib.ops().reset_kernel_counters()


def backend_id(kernel: str, device: str) -> str:
    tag = "sm90" if device == "cuda" else "cpu"
    return f"rlkernel.{FAMILY[kernel]}.{tag}.v1"
