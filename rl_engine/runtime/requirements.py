"""Which extension ops each module's R route needs, and whether they can run on a device.

The model for this check is a backend-requirement gate: it runs before any work, names the op and
the reason, and has no escape hatch.
"""

from __future__ import annotations

import torch

from rl_engine.ops import _lib

_FORWARD = {
    "attention": ("rmsnorm", "det_gemm", "rope", "attention_fwd", "rank_order_sum"),
    "ffn": ("rmsnorm", "det_gemm", "swiglu", "rank_order_sum"),
    "logp": ("rmsnorm", "linear_logp_partial", "logp_combine", "rank_order_sum"),
}
_TRAINING = {
    "attention": ("det_gemm_grad_input", "det_gemm_grad_weight", "rmsnorm_backward",
                  "rope_backward", "attention_bwd"),
    "ffn": ("det_gemm_grad_input", "det_gemm_grad_weight", "rmsnorm_backward", "swiglu_backward"),
    "logp": ("rmsnorm_backward", "linear_logp_backward"),
}
# The rollout's logp route also computes the sampling logits (det_gemm on R).
_ROLLOUT = {"attention": ("attention_decode",), "ffn": (), "logp": ("det_gemm",)}


def required_ops(module: str, side: str) -> tuple[str, ...]:
    extra = _TRAINING if side == "training" else _ROLLOUT
    return _FORWARD[module] + extra[module]


def missing(module: str, side: str, device: torch.device) -> str | None:
    """None when every op of the route can run on device, else the reason it cannot."""
    if not _lib.available():
        return ("rl_engine._C is not built or does not load; build it with "
                "`pip install --no-build-isolation -e .`")
    key = "CUDA" if device.type == "cuda" else "CPU"
    if device.type == "cuda":
        if not _lib.ops().det_gemm_sm90_compiled():
            return "the sm_90a kernels are not compiled into rl_engine._C (rebuild with RLK_BUILD_CUDA=1)"
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) != (9, 0):
            return f"the GPU is sm_{major}{minor}; rl_engine's CUDA kernels need Hopper (sm_90)"
    for op in required_ops(module, side):
        if not torch._C._dispatch_has_kernel_for_dispatch_key(f"rl_engine::{op}", key):
            return f"rl_engine::{op} has no {key} kernel in this build"
    return None
