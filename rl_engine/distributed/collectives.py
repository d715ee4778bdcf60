"""Fixed-order collectives over a torch.distributed process group.

The R collectives sum in rank order 0..N-1 in fp32 at every message size, so every rank gets the
same bits and the bits do not depend on the transport's algorithm choice. On the CPU (transport
`cpu_ag_rs`) the payload is exchanged by gloo's all-gather, which only moves bytes, and summed by
the extension's rank_order_sum kernel. On CUDA (transport `cuda_ag_rs`) rl_engine's own kernels
move and sum the payload over CUDA IPC (distributed/cuda_ipc.py); there is no fallback to NCCL.
The production twins are the process group's native collectives.
"""

from __future__ import annotations

import collections

import torch
import torch.distributed as dist

from rl_engine.distributed import cuda_ipc
from rl_engine.ops import _lib

# Launches of each collective payload path in this process, by backend id.
CALLS: collections.Counter[str] = collections.Counter()


def _device_tag(x: torch.Tensor) -> str:
    return "cuda_ipc" if x.is_cuda else "cpu"


def backend_id(kind: str, x: torch.Tensor, fixed: bool) -> str:
    if fixed:
        return f"rlkernel.collective.{kind}.{_device_tag(x)}.v1"
    return f"production.{'nccl' if x.is_cuda else 'gloo'}.{kind}"


def _gather_list(x: torch.Tensor, group) -> list[torch.Tensor]:
    world = dist.get_world_size(group)
    x = x.contiguous()  # NCCL sends and receives dense row-major buffers only
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    return parts


def all_gather(x: torch.Tensor, group, *, fixed: bool = True) -> torch.Tensor:
    """Concatenation of every rank's x along dim 0, in rank order (no arithmetic)."""
    CALLS[backend_id("all_gather", x, fixed)] += 1
    if dist.get_world_size(group) == 1:
        return x
    if fixed and x.is_cuda:
        return cuda_ipc.all_gather(x, group)
    return torch.cat(_gather_list(x, group), dim=0)


def all_reduce(x: torch.Tensor, group, *, fixed: bool = True) -> torch.Tensor:
    """Sum of x over ranks; fixed: in rank order in fp32, then one rounding to x's dtype."""
    CALLS[backend_id("all_reduce", x, fixed)] += 1
    if dist.get_world_size(group) == 1:
        return x
    if not fixed:
        out = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=group)
        return out
    if x.is_cuda:
        return cuda_ipc.all_reduce(x, group)
    parts = torch.stack(_gather_list(x, group))
    return _lib.ops().rank_order_sum(parts).to(x.dtype)


def reduce_scatter(x: torch.Tensor, group, *, fixed: bool = True) -> torch.Tensor:
    """This rank's equal share (along dim 0) of the sum of x over ranks."""
    CALLS[backend_id("reduce_scatter", x, fixed)] += 1
    world = dist.get_world_size(group)
    if world == 1:
        return x
    if x.shape[0] % world:
        raise ValueError(f"reduce_scatter needs dim 0 ({x.shape[0]}) divisible by {world} ranks")
    rank = dist.get_rank(group)
    share = x.shape[0] // world
    if not fixed:
        if not x.is_cuda:  # gloo has no reduce-scatter: its all-reduce, then this rank's share
            full = x.clone()
            dist.all_reduce(full, group=group)
            return full[rank * share:(rank + 1) * share].clone()
        out = torch.empty((share, *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
        return out
    if x.is_cuda:
        return cuda_ipc.reduce_scatter(x, group)
    parts = torch.stack([p[rank * share:(rank + 1) * share] for p in _gather_list(x, group)])
    return _lib.ops().rank_order_sum(parts).to(x.dtype)


def sum_in_order(parts: list[torch.Tensor]) -> torch.Tensor:
    """fp32 sum of parts in list order (the rank-order sum without communication)."""
    if len(parts) == 1:
        return parts[0].float()
    return _lib.ops().rank_order_sum(torch.stack([p.float() for p in parts]))


def transport_record() -> dict:
    """What carried this process's fixed-order collectives: `cuda_ag_rs` (CUDA IPC), `cpu_ag_rs`
    (gloo) or None when none ran. There is no fallback path, so a collective that did not run on
    these transports shows as a production backend id in CALLS, never as a fallback here."""
    names = sorted({cuda_ipc.TRANSPORT if ".cuda_ipc." in k else "cpu_ag_rs"
                    for k in CALLS if k.startswith("rlkernel.collective.")})
    return {"communication_backend": ",".join(names) or None, "fallback_allowed": False,
            "fallback": False}
