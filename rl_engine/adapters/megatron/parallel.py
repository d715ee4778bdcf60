"""Megatron's parallel state inside the process group the launcher opened, and the matching
rl_engine layout.

Megatron's default order "tp-cp-ep-dp-pp" numbers ranks TP fastest, then CP, then DP, which is
the built-in trainer's numbering (engines/train/layout.py): Megatron's TP, CP and DP groups and
rl_engine's hold the same ranks. Megatron's own modules (the embedding, the P routes' stock
modules, the vocab-parallel cross entropy) use Megatron's groups; rl_engine's fixed-order
collectives use the layout's.
"""

from __future__ import annotations

from importlib import metadata

from rl_engine.engines.train import layout as layout_mod


def initialise(tp: int, cp: int, dp: int) -> layout_mod.Layout:
    """Initialises Megatron's model-parallel state for TP x CP x DP (once per process) and returns
    rl_engine's layout of the same ranks."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    layout_mod.check_world(tp, cp, dp, dist.get_world_size())
    if parallel_state.model_parallel_is_initialized():
        have = (parallel_state.get_tensor_model_parallel_world_size(),
                parallel_state.get_context_parallel_world_size())
        if have != (tp, cp):
            raise ValueError(f"Megatron's parallel state of this process is TP x CP = {have}, "
                             f"not {(tp, cp)}; one process serves one layout")
    else:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                                 context_parallel_size=cp)
    lay = layout_mod.build(tp, cp, dp)
    mine = (parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_context_parallel_rank(), parallel_state.get_data_parallel_rank())
    if mine != (lay.tp_rank, lay.cp_rank, lay.dp_rank):
        raise RuntimeError(f"Megatron places rank {lay.rank} at (tp, cp, dp) = {mine}, rl_engine's "
                           f"layout at {(lay.tp_rank, lay.cp_rank, lay.dp_rank)}")
    return lay


def megatron_core_version() -> str:
    return metadata.version("megatron-core")
