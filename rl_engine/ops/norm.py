"""RMSNorm: ``out[i] = x[i] / RMS(x) * w[i]``; rl_engine's kernel and the production F.rms_norm."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rl_engine.ops import _lib


def det_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _lib.ops().rmsnorm(x, weight, eps)[0]


def production_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _setup(ctx, inputs, output):
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])


def _backward(ctx, grad_out, _grad_rstd):
    x, weight, rstd = ctx.saved_tensors
    grad_x, grad_w = _lib.ops().rmsnorm_backward(grad_out, x, weight, rstd)
    return grad_x, grad_w.to(weight.dtype), None


if _lib.available():
    torch.library.register_autograd("rl_engine::rmsnorm", _backward, setup_context=_setup)
