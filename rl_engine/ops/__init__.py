"""Thin Python wrappers over torch.ops.rl_engine (the R implementations) and, behind the same
interface, their production twins (the P implementations).

Importing this package registers the fake kernels and every op's autograd formula, so a backward
through torch.ops.rl_engine.<op> works however the op was reached.
"""

from rl_engine.ops import _lib

if _lib.available():
    from rl_engine.ops import fake  # noqa: F401  (registers the fake kernels)
    from rl_engine.ops import attention, linear, logp, norm, rope, swiglu  # noqa: F401  (autograd)
