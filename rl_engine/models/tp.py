"""Tensor-parallel boundaries (Megatron's f and g) and the vocab-parallel selected-token log-prob.

Each collective goes through the router, so the module's route decides whether it is the fixed
rank-order collective (R) or the process group's native one (P).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from rl_engine.ops import logp as logp_ops
from rl_engine.runtime.routing import Router


@dataclass(frozen=True, slots=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: object = None


class _CopyToTP(torch.autograd.Function):
    """Forward identity; backward sums the gradient over the TP ranks (column-parallel input)."""

    @staticmethod
    def forward(ctx, x, router, module, tp):
        ctx.router, ctx.module, ctx.tp = router, module, tp
        return x

    @staticmethod
    def backward(ctx, grad):
        return ctx.router.collective(ctx.module, "all_reduce", grad.contiguous(), ctx.tp.group), None, None, None


class _ReduceFromTP(torch.autograd.Function):
    """Forward sums the row-parallel partials over the TP ranks; backward identity."""

    @staticmethod
    def forward(ctx, x, router, module, tp):
        return router.collective(module, "all_reduce", x, tp.group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None


def copy_to_tp(x, router: Router, module: str, tp: TPGroup):
    return x if tp.size == 1 else _CopyToTP.apply(x, router, module, tp)


def reduce_from_tp(x, router: Router, module: str, tp: TPGroup):
    return x if tp.size == 1 else _ReduceFromTP.apply(x, router, module, tp)


class _RVocabParallelLogp(torch.autograd.Function):
    """rl_engine's tree-merged log-prob over a vocab shard; shard roots gathered in rank order."""

    @staticmethod
    def forward(ctx, hidden, weight, target, start, tiles, router, tp):
        m, s, t = router.logp_partial("logp", hidden, weight, target, start, tiles)
        roots = router.collective("logp", "all_gather", torch.stack([m, s, t])[None], tp.group)
        logp, lse = router.logp_combine("logp", roots[:, 0], roots[:, 1], roots[:, 2])
        ctx.save_for_backward(hidden, weight, target, lse)
        ctx.start, ctx.router, ctx.tp = start, router, tp
        return logp

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, target, lse = ctx.saved_tensors
        gh, gw = ctx.router.logp_backward("logp", grad, hidden, weight, target, lse, ctx.start)
        gh = ctx.router.collective("logp", "all_reduce", gh, ctx.tp.group)
        return gh.to(hidden.dtype), gw.to(weight.dtype), None, None, None, None, None


class _PVocabParallelLogp(torch.autograd.Function):
    """Megatron's vocab-parallel cross entropy: local logits, max/sum/target all-reduces."""

    @staticmethod
    def forward(ctx, hidden, weight, target, start, router, tp):
        import torch.distributed as dist

        router.count_production("logp", "production.torch.log_softmax")
        logits = torch.nn.functional.linear(hidden, weight).float()
        local_max = logits.max(dim=-1).values
        dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=tp.group)
        shifted = logits - local_max[:, None]
        sumexp = shifted.exp().sum(-1)
        in_shard = (target >= start) & (target < start + weight.shape[0])
        idx = (target - start).clamp(0, weight.shape[0] - 1)
        tgt = torch.where(in_shard, shifted.gather(-1, idx[:, None])[:, 0], torch.zeros_like(sumexp))
        sumexp = router.collective("logp", "all_reduce", sumexp, tp.group)
        tgt = router.collective("logp", "all_reduce", tgt, tp.group)
        ctx.save_for_backward(hidden, weight, shifted, sumexp, in_shard, idx)
        ctx.router, ctx.tp = router, tp
        return tgt - sumexp.log()

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, shifted, sumexp, in_shard, idx = ctx.saved_tensors
        dlogits = -shifted.exp() / sumexp[:, None]
        dlogits.scatter_add_(-1, idx[:, None], in_shard.float()[:, None])
        dlogits = (dlogits * grad[:, None]).to(hidden.dtype)
        gh = ctx.router.collective("logp", "all_reduce", dlogits @ weight, ctx.tp.group)
        return gh, dlogits.t() @ hidden, None, None, None, None


def selected_logp(router: Router, hidden, weight, target, *, vocab: int, tp: TPGroup):
    """fp32 log p(target) of each row; weight is this rank's LM-head shard."""
    if tp.size == 1:
        return router.selected_logp("logp", hidden, weight, target)
    start, _, tiles = logp_ops.shard_range(vocab, tp.rank, tp.size)
    r = functools.partial(_RVocabParallelLogp.apply, hidden, weight, target, start, tiles, router, tp)
    p = functools.partial(_PVocabParallelLogp.apply, hidden, weight, target, start, router, tp)
    return router.split("logp", r, p)
