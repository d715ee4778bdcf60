"""The TP x CP x DP layout of the training ranks and their process groups.

Ranks are numbered Megatron's way: TP fastest, then CP, then DP, so rank = tp + TP * (cp + CP * dp).
Gradients are reduced over CP x DP (the ranks that hold the same weight shard); that group lists
its ranks in increasing order, so a fixed-order reduction over it adds DP replicas in DP order and,
inside each, CP ranks in CP order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


def check_world(tp: int, cp: int, dp: int, world: int) -> None:
    for name, value in (("TP", tp), ("CP", cp), ("DP", dp)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    if tp * cp * dp != world:
        raise ValueError(f"TP={tp} x CP={cp} x DP={dp} = {tp * cp * dp} training ranks, but the "
                         f"world has {world}; ACTOR_GPUS must equal TP x CP x DP")


def coords(rank: int, tp: int, cp: int) -> tuple[int, int, int]:
    """(tp_rank, cp_rank, dp_rank) of a global rank."""
    return rank % tp, (rank // tp) % cp, rank // (tp * cp)


def global_rank(tp_rank: int, cp_rank: int, dp_rank: int, tp: int, cp: int) -> int:
    return tp_rank + tp * (cp_rank + cp * dp_rank)


@dataclass(frozen=True, slots=True)
class Layout:
    tp: int
    cp: int
    dp: int
    rank: int
    tp_group: object
    cp_group: object
    dp_group: object
    grad_group: object  # CP x DP: the ranks holding the same TP shard

    @property
    def tp_rank(self) -> int:
        return coords(self.rank, self.tp, self.cp)[0]

    @property
    def cp_rank(self) -> int:
        return coords(self.rank, self.tp, self.cp)[1]

    @property
    def dp_rank(self) -> int:
        return coords(self.rank, self.tp, self.cp)[2]

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.dp


def _my_group(members: list[list[int]], rank: int):
    """Creates every group (each rank must call new_group for all of them, in the same order) and
    returns the one holding `rank`."""
    mine = None
    for ranks in members:
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    assert mine is not None
    return mine


def build(tp: int, cp: int, dp: int) -> Layout:
    """The layout of this process inside the initialised default process group."""
    world, rank = dist.get_world_size(), dist.get_rank()
    check_world(tp, cp, dp, world)
    r = lambda t, c, d: global_rank(t, c, d, tp, cp)  # noqa: E731
    tp_groups = [[r(t, c, d) for t in range(tp)] for d in range(dp) for c in range(cp)]
    cp_groups = [[r(t, c, d) for c in range(cp)] for d in range(dp) for t in range(tp)]
    dp_groups = [[r(t, c, d) for d in range(dp)] for c in range(cp) for t in range(tp)]
    grad_groups = [sorted(r(t, c, d) for d in range(dp) for c in range(cp)) for t in range(tp)]
    return Layout(tp=tp, cp=cp, dp=dp, rank=rank, tp_group=_my_group(tp_groups, rank),
                  cp_group=_my_group(cp_groups, rank), dp_group=_my_group(dp_groups, rank),
                  grad_group=_my_group(grad_groups, rank))
