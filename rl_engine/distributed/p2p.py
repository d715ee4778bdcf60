"""The `p2p_reference` transport: point-to-point exchange of tensors with isend/irecv in one fixed
schedule (gloo on the CPU, NCCL on CUDA).

It moves bytes and never adds: a reduction over ranks is done by the caller, in an order it fixes,
on what exchange() delivered. So it gives the same bits as the fixed-order collectives
(`cpu_ag_rs`), and is the reference that a collective transport is checked against. The backend is
the process group's and must match the tensors' device; a mismatch is an error, never a silent
switch to another backend.

Schedule: in step s = 1 .. N-1, rank r sends to rank (r + s) % N and receives from (r - s) % N, one
step at a time, so every pair of ranks exchanges exactly once and no step waits on a later one.
"""

from __future__ import annotations

import collections

import torch
import torch.distributed as dist

TRANSPORT = "p2p_reference"
# Exchanges made in this process, by backend id.
CALLS: collections.Counter[str] = collections.Counter()


def backend_id(x: torch.Tensor) -> str:
    return f"{TRANSPORT}.{'nccl' if x.is_cuda else 'gloo'}"


def _check_backend(x: torch.Tensor, group) -> None:
    backend = str(dist.get_backend(group)).lower()
    want = "nccl" if x.is_cuda else "gloo"
    if want not in backend:
        raise RuntimeError(f"{TRANSPORT}: {x.device.type} tensors need a {want} process group; "
                           f"this group's backend is {backend!r}")


def exchange(send: list[torch.Tensor], recv: list[torch.Tensor], group) -> list[torch.Tensor]:
    """Rank r's send[p] lands in rank p's recv[r]; recv[r] of rank r is a copy of its own send[r].
    Every rank passes one tensor per rank of the group in each list, recv preallocated (contiguous)
    with the shape and dtype of what the peer sends. Returns recv."""
    group = group if group is not None else dist.group.WORLD
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if len(send) != world or len(recv) != world:
        raise ValueError(f"exchange needs {world} tensors to send and to receive, got "
                         f"{len(send)} and {len(recv)}")
    if not all(t.is_contiguous() for t in recv):
        raise ValueError("exchange receives into contiguous tensors only")
    CALLS[backend_id(recv[rank])] += 1
    recv[rank].copy_(send[rank])
    if world == 1:
        return recv
    _check_backend(recv[rank], group)
    for step in range(1, world):
        dst, src = (rank + step) % world, (rank - step) % world
        out = send[dst].contiguous()
        peer_dst, peer_src = dist.get_global_rank(group, dst), dist.get_global_rank(group, src)
        if out.is_cuda:
            # NCCL runs a lone send and recv in stream order, which deadlocks a ring; one batch
            # posts both at once.
            reqs = dist.batch_isend_irecv([
                dist.P2POp(dist.isend, out, peer_dst, group, tag=step),
                dist.P2POp(dist.irecv, recv[src], peer_src, group, tag=step)])
        else:
            reqs = [dist.isend(out, peer_dst, group=group, tag=step),
                    dist.irecv(recv[src], peer_src, group=group, tag=step)]
        for req in reqs:
            req.wait()
    return recv


def all_gather(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's x (equal shapes) concatenated along dim 0 in rank order, like
    collectives.all_gather, moved point to point."""
    world = dist.get_world_size(group)
    recv = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(world)]
    return torch.cat(exchange([x] * world, recv, group), dim=0)


def all_to_all(send: list[torch.Tensor], recv_shape: tuple[int, ...], group) -> torch.Tensor:
    """Rank r sends send[p] to rank p; returns what every rank sent to this one, stacked in rank
    order: [world, *recv_shape]. The caller reduces it in whatever fixed order it needs."""
    world = dist.get_world_size(group)
    ref = send[dist.get_rank(group)]
    recv = torch.empty((world, *recv_shape), dtype=ref.dtype, device=ref.device)
    exchange(send, list(recv.unbind(0)), group)
    return recv
