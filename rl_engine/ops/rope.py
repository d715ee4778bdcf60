"""Rotary embedding at absolute positions (Qwen3: rotate-half, not interleaved)."""

from __future__ import annotations

import torch

from rl_engine.ops import _lib


def det_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x [T, heads, D] rotated by ``positions[T] * theta^(-2i/D)``; fp32 math, one downcast."""
    return _lib.ops().rope(x, positions, theta)


def production_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """The Hugging Face Qwen3 formula: cos/sin rounded to the activation dtype first."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=x.device).float() / d))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(x.dtype)[:, None, :], emb.sin().to(x.dtype)[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _setup(ctx, inputs, output):
    _, positions, theta = inputs
    ctx.save_for_backward(positions)
    ctx.theta = theta


def _backward(ctx, grad_out):
    (positions,) = ctx.saved_tensors
    return _lib.ops().rope_backward(grad_out, positions, ctx.theta), None, None


if _lib.available():
    torch.library.register_autograd("rl_engine::rope", _backward, setup_context=_setup)
