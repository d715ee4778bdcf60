"""Thin Python wrappers over torch.ops.rl_engine (the R implementations) and, behind the same
interface, their production twins (the P implementations)."""

from rl_engine.ops import _lib

if _lib.available():
    from rl_engine.ops import fake  # noqa: F401  (registers the fake kernels)
