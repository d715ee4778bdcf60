"""SwiGLU on a fused [gate | up] projection: ``out = silu(gate) * up``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rl_engine.ops import _lib


def det_swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    return _lib.ops().swiglu(gate_up)


def production_swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _backward(ctx, grad_out):
    (gate_up,) = ctx.saved_tensors
    return _lib.ops().swiglu_backward(grad_out, gate_up)


if _lib.available():
    torch.library.register_autograd("rl_engine::swiglu", _backward, setup_context=_setup)
