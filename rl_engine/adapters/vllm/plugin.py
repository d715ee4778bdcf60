"""The entry point vLLM loads in every process that builds a model (group vllm.general_plugins).

`register()` swaps vLLM's layer classes for rl_engine's by their in-tree names (RMSNorm,
RotaryEmbedding, SiluAndMul, the parallel linears, LogitsProcessor) and the CPU attention backend.
The replacements compute exactly what vLLM's own classes compute until a rollout rank binds a plan
to the worker (binding.attach); then each module on R runs rl_engine's ops. vLLM may load a plugin
more than once in a process, so registering twice is a no-op.
"""

from __future__ import annotations

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    from rl_engine.adapters.vllm import attention, layers

    layers.register()
    attention.register()
    _registered = True


def registered() -> bool:
    """Whether register() ran in this process (the worker reports it at attach)."""
    return _registered
