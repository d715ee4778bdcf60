"""Context parallelism: attention over Megatron's load-balanced chunks, and the row exchange that
makes the R route's results equal the CP=1 computation bit for bit.

Each CP rank holds chunks r and 2CP-1-r of every sequence (packing.py). Its queries see the whole
causal prefix through an all-gather of K/V over the CP group. In the R backward, every local query
chunk (one attention block of positions) is its own attention_bwd call, whose fp32 dK/dV is exactly
that chunk's partial; the partials of all ranks are gathered and each key row adds them in global
chunk order, which is the order one CP=1 call adds them in (a fixed-order reduce-scatter).

Weight gradients are sums over token rows, and a CP rank holds only some rows; a per-rank partial
rounded to bf16 and summed over ranks is not the CP=1 sum. So on R routes RowOrderedRouter computes
each weight's gradient from the micro-batch's rows gathered in CP=1 order, on one owner CP rank
(round robin over the weights), with the op's own backward; the other CP ranks contribute zeros,
which the fixed-order CP x DP all-reduce adds exactly. P routes keep per-rank partials.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from rl_engine.engines.train.packing import MicroBatch
from rl_engine.runtime.routing import Router


class RowExchange:
    """Where the rows of a micro-batch live: owned[r] lists the global row ids CP rank r holds (in
    its local order); gather() returns the rows listed in `order`, on every rank."""

    def __init__(self, owned: list[torch.Tensor], order: torch.Tensor, rank: int, group,
                 device: torch.device | str = "cpu"):
        self.rank, self.group = rank, group
        self.width = max(1, max(int(o.numel()) for o in owned))
        slot = {g: r * self.width + i
                for r, ids in enumerate(owned) for i, g in enumerate(ids.tolist())}
        place = {g: i for i, g in enumerate(order.tolist())}
        self.index = torch.tensor([slot[g] for g in order.tolist()], dtype=torch.long,
                                  device=device)
        self.mine = torch.tensor([place[g] for g in owned[rank].tolist()], dtype=torch.long,
                                 device=device)

    def gather(self, x: torch.Tensor, router: Router, module: str) -> torch.Tensor:
        pad = x.new_zeros((self.width - x.shape[0], *x.shape[1:]))
        return router.collective(module, "all_gather", torch.cat([x, pad]), self.group)[self.index]


class GatherRows(torch.autograd.Function):
    """gather() with autograd. replicated: every rank computes the same function of the gathered
    rows, so a rank's rows get their gradient as is; otherwise the gradients of all ranks add up."""

    @staticmethod
    def forward(ctx, x, exchange, router, module, replicated):
        ctx.exchange, ctx.router, ctx.module, ctx.replicated = exchange, router, module, replicated
        return exchange.gather(x, router, module)

    @staticmethod
    def backward(ctx, grad):
        ex = ctx.exchange
        if not ctx.replicated:
            grad = ctx.router.collective(ctx.module, "all_reduce", grad.contiguous(), ex.group)
        return grad[ex.mine], None, None, None, None


class PackedAttention:
    """CP=1: the routed attention over whole packed sequences."""

    def __init__(self, router: Router, mb: MicroBatch, scale: float):
        self.router, self.scale = router, scale
        dev = router.device
        self.cu, self.positions = mb.cu_seqlens().to(dev), mb.positions(0).to(dev)
        router.note("attention", "cp_query_rows", int(self.positions.numel()))

    def attend(self, layer, q, k, v):
        return self.router.attention("attention", q, k, v, self.cu, self.cu, self.positions,
                                     self.scale)


class ContextParallelAttention:
    """CP>1: this rank's query chunks against the whole prefix, K/V all-gathered over CP."""

    def __init__(self, router: Router, mb: MicroBatch, exchange: RowExchange, scale: float):
        rank, cp, block = exchange.rank, mb.cp, mb.block
        self.router, self.exchange, self.scale, self.block = router, exchange, scale, block
        # The geometry is worked out on the CPU (Python loops over rows), then moved once.
        dev = router.device
        q_pos = mb.positions(rank)
        self.cu_q, self.cu_k = mb.cu_seqlens(rank).to(dev), mb.cu_seqlens().to(dev)
        self.q_pos = q_pos.to(dev)
        router.note("attention", "cp_query_rows", int(q_pos.numel()))
        units = [[mb.units(r, b) for b in range(len(mb.lengths))] for r in range(cp)]
        self.calls_max = max(len(u) for per_rank in units for u in per_rank)
        # Backward call j of this rank: the j-th local query chunk of every sequence.
        starts = mb.cu_seqlens(rank).tolist()
        self.calls = []
        for j in range(max(len(u) for u in units[rank])):
            rows, counts = [], []
            for b, seq_units in enumerate(units[rank]):
                mine = [i for i in range(starts[b], starts[b + 1])
                        if j < len(seq_units) and int(q_pos[i]) // block == seq_units[j]]
                rows += mine
                counts.append(len(mine))
            rows_t = torch.tensor(rows, dtype=torch.long)
            cu = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
            self.calls.append((rows_t.to(dev), cu.to(dev), q_pos[rows_t].to(dev)))
        # For each key row this rank holds, where each global chunk's partial sits in the gathered
        # [CP * calls_max * Tk] partials, in global chunk order; chunks past a sequence's end point
        # at an appended zero row (adding +0 leaves a sum unchanged).
        source = {}
        for r in range(cp):
            for b, seq_units in enumerate(units[r]):
                for j, u in enumerate(seq_units):
                    source[(b, u)] = r * self.calls_max + j
        width = max(mb.num_units(b) for b in range(len(mb.lengths)))
        zero_row = cp * self.calls_max * mb.total
        index = []
        for b, rr in enumerate(mb.ranges[rank]):
            for s, e in rr:
                for p in range(s, e):
                    g = mb.offsets[b] + p
                    index.append([source[(b, u)] * mb.total + g if u < mb.num_units(b) else zero_row
                                  for u in range(width)])
        self.dkv_index = (torch.tensor(index, dtype=torch.long).reshape(-1, width).t().contiguous()
                          .to(dev))

    def attend(self, layer, q, k, v):
        return self.router.split("attention", _RContextParallelAttention.apply, self._production,
                                 q, k, v, self)

    def _production(self, q, k, v, _):
        r = self.router
        k_all = GatherRows.apply(k, self.exchange, r, "attention", False)
        v_all = GatherRows.apply(v, self.exchange, r, "attention", False)
        return r.production_attention("attention", q, k_all, v_all, self.cu_q, self.cu_k,
                                      self.q_pos, self.scale)


class _RContextParallelAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cpa):
        r, ex = cpa.router, cpa.exchange
        k_all, v_all = ex.gather(k, r, "attention"), ex.gather(v, r, "attention")
        out, lse = r.attention_lse("attention", q, k_all, v_all, cpa.cu_q, cpa.cu_k, cpa.q_pos,
                                   cpa.scale, cpa.block)
        ctx.save_for_backward(q, k_all, v_all, out, lse)
        ctx.cpa, ctx.kv_dtype = cpa, k.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k_all, v_all, out, lse = ctx.saved_tensors
        cpa, r = ctx.cpa, ctx.cpa.router
        grad_out = grad_out.contiguous()
        dq = torch.empty_like(q)
        parts = torch.zeros((cpa.calls_max, *k_all.shape[:1], 2, *k_all.shape[1:]),
                            device=k_all.device)
        for j, (rows, cu_q, pos) in enumerate(cpa.calls):
            dq[rows], parts[j, :, 0], parts[j, :, 1] = r.attention_backward(
                "attention", grad_out[rows], q[rows], k_all, v_all, out[rows], lse[rows], cu_q,
                cpa.cu_k, pos, cpa.scale, cpa.block)
        gathered = r.collective("attention", "all_gather", parts, cpa.exchange.group)
        flat = torch.cat([gathered.flatten(0, 1), gathered.new_zeros((1, *gathered.shape[2:]))])
        ordered = flat[cpa.dkv_index]  # [chunks, own key rows, 2, Hkv, D]
        if ordered.shape[0] > 1:
            dkv = r.sum_in_order("attention", list(ordered))
        else:
            dkv = ordered[0]
        return dq, dkv[:, 0].to(ctx.kv_dtype), dkv[:, 1].to(ctx.kv_dtype), None


class _WeightTap(torch.autograd.Function):
    """Identity on y (computed with a detached weight); its backward gives the weight the gradient
    of fn over the gathered rows, on the owner rank only."""

    @staticmethod
    def forward(ctx, y, weight, router, module, kernels, exchange, owner, inputs, fn):
        ctx.save_for_backward(weight)
        ctx.args = (router, module, kernels, exchange, owner, tuple(t.detach() for t in inputs), fn)
        return y.view_as(y)

    @staticmethod
    def backward(ctx, dy):
        (weight,) = ctx.saved_tensors
        router, module, kernels, ex, owner, inputs, fn = ctx.args
        full = [ex.gather(t, router, module) for t in inputs]
        dy_full = ex.gather(dy.contiguous(), router, module)
        grad_w = None
        if ex.rank == owner:
            w = weight.detach().requires_grad_()
            launches = router.kernels(module) if kernels else contextlib.nullcontext()
            with torch.enable_grad(), launches:
                (grad_w,) = torch.autograd.grad(fn(*full, w), w, dy_full)
        return dy, grad_w, None, None, None, None, None, None, None


class _EmbeddingTap(TorchFunctionMode):
    """Routes the model's one F.embedding of `weight` through the weight tap (the embedding is
    not a routed op, so a function mode is the seam that reaches it)."""

    def __init__(self, router: RowOrderedRouter, weight: torch.Tensor):
        super().__init__()
        self.router, self.weight, self.hits = router, weight, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.embedding and len(args) >= 2 and args[1] is self.weight:
            self.hits += 1
            y = func(args[0], args[1].detach(), *args[2:], **kwargs)
            fn = lambda t, w: F.embedding(t, w, *args[2:], **kwargs)  # noqa: E731
            return self.router.tap("attention", y, args[1], (args[0],), fn, kernels=False)
        return func(*args, **kwargs)


class RowOrderedRouter(Router):
    """A training Router whose R-route weights (and the embedding, with the attention route) get
    their gradients in CP=1 row order while a row exchange is open; otherwise a plain Router."""

    exchange: RowExchange | None = None
    _taps = 0

    @contextlib.contextmanager
    def row_ordered(self, exchange: RowExchange, cp: int, embedding: torch.Tensor):
        self.exchange, self._taps, self._cp = exchange, 0, cp
        tapped = self.is_r("attention")
        mode = _EmbeddingTap(self, embedding) if tapped else contextlib.nullcontext()
        try:
            with mode:
                yield
        finally:
            self.exchange = None
        if tapped and mode.hits != 1:
            raise RuntimeError(f"the model looked up its embedding {mode.hits} times in one "
                               "forward; the row-ordered embedding gradient expects exactly one")

    def tap(self, module, y, weight, inputs, fn, *, kernels=True):
        owner = self._taps % self._cp
        self._taps += 1
        return _WeightTap.apply(y, weight, self, module, kernels, self.exchange, owner, inputs, fn)

    def _tapping(self, module, weight) -> bool:
        return self.exchange is not None and self.is_r(module) and weight.requires_grad

    def linear(self, module, x, w, bias=None):
        if bias is not None or not self._tapping(module, w):
            return super().linear(module, x, w, bias)
        y = super().linear(module, x, w.detach())
        return self.tap(module, y, w, (x,), functools.partial(Router.linear, self, module))

    def rmsnorm(self, module, x, w, eps):
        if not self._tapping(module, w):
            return super().rmsnorm(module, x, w, eps)
        fn = lambda x_, w_: Router.rmsnorm(self, module, x_, w_, eps)  # noqa: E731
        return self.tap(module, super().rmsnorm(module, x, w.detach(), eps), w, (x,), fn)
