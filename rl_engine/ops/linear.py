"""y = x W^T: rl_engine's det_gemm (batch invariant) and its production twin F.linear."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rl_engine.ops import _lib


def det_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``y[m, n] = sum_k x[m, k] w[n, k] (+ b[n])``, one fixed k order whatever M is."""
    return _lib.ops().det_gemm(x, w, bias)


def production_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, w, bias)


def _setup(ctx, inputs, output):
    x, w, bias = inputs
    ctx.save_for_backward(x, w)
    ctx.has_bias = bias is not None


def _backward(ctx, grad_y):
    x, w = ctx.saved_tensors
    ops = _lib.ops()
    grad_x = ops.det_gemm_grad_input(grad_y, w) if ctx.needs_input_grad[0] else None
    grad_w = None
    if ctx.needs_input_grad[1]:
        grad_w = ops.det_gemm_grad_weight(grad_y, x).to(w.dtype)
    grad_b = None
    if ctx.has_bias and ctx.needs_input_grad[2]:
        ones = grad_y.new_ones((*grad_y.shape[:-1], 1))
        grad_b = ops.det_gemm_grad_weight(grad_y, ones)[:, 0].to(grad_y.dtype)
    return grad_x, grad_w, grad_b


if _lib.available():
    torch.library.register_autograd("rl_engine::det_gemm", _backward, setup_context=_setup)
