"""Routes every module's ops to rl_engine's kernels (R) or their production twins (P).

One Router per worker and side. It decides each module's implementation once, before any work:
in strict mode an R route that cannot run raises RouteUnavailable naming the op and the reason; in
audit mode it runs the production twin and records fallback=true. Call counts of R routes are the
deltas of the launch counters kept inside the extension, not the router's own intent.

Every R/P choice is made here: models, engines and gates call a Router method and never an op's
det_* or production_* function, nor edit a record. An op split over ranks gives the router both of
its implementations (`split`), built of this router's methods.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from rl_engine.distributed import collectives, p2p
from rl_engine.errors import BadInput
from rl_engine.ops import attention as attn_ops
from rl_engine.ops import counters, linear, logp, norm, rope, swiglu
from rl_engine.runtime import requirements
from rl_engine.runtime.plan import MODULES, Plan

log = logging.getLogger("rl_engine.route")


def trace_range(module: str):
    """The profiler range every routed op of a module runs in, `rlk.<module>`: the trace gate finds
    by it which kernels a module launched, so a production kernel inside an R module's range is
    seen for what it is."""
    return torch.profiler.record_function(f"rlk.{module}")


class RouteUnavailable(BadInput, RuntimeError):
    """A strict R route cannot run its rl_engine kernel (exit code 2)."""


@dataclass(kw_only=True, slots=True)
class ModuleRecord:
    module: str
    case: str
    requested: str
    actual: str
    fallback: bool = False
    fallback_reason: str | None = None
    call_counts: collections.Counter = field(default_factory=collections.Counter)
    shapes: dict[str, set] = field(default_factory=lambda: collections.defaultdict(set))

    @property
    def implementation(self) -> str:
        return "rlkernel" if self.actual == "R" else "production"

    def as_dict(self) -> dict[str, Any]:
        return {
            "module": self.module, "case": self.case, "requested": self.requested,
            "actual": self.actual, "implementation": self.implementation,
            "backend_ids": sorted(self.call_counts), "call_counts": dict(sorted(self.call_counts.items())),
            "fallback": self.fallback, "fallback_reason": self.fallback_reason,
            "shapes": {k: sorted(v) for k, v in sorted(self.shapes.items())},
        }


class Router:
    def __init__(self, plan: Plan, *, side: str, engine: str, device: torch.device | str = "cpu"):
        self.plan, self.side, self.engine = plan, side, engine
        self.device = torch.device(device)
        self.records: dict[str, ModuleRecord] = {}
        self._counting = False
        for module in MODULES:
            requested = plan.impl(module, side)
            record = ModuleRecord(module=module, case=plan.case(module), requested=requested,
                                  actual=requested)
            if requested == "R":
                reason = requirements.missing(module, side, self.device)
                if reason is not None:
                    if plan.mode == "strict":
                        raise RouteUnavailable(
                            f"strict {side} route of module {module} cannot run: {reason}")
                    record.actual, record.fallback, record.fallback_reason = "P", True, reason
            self.records[module] = record
            log.info("[rl-engine][route] engine=%s side=%s module=%s requested=%s actual=%s "
                     "fallback=%s pid=%d", engine, side, module, requested, record.actual,
                     str(record.fallback).lower(), os.getpid())

    def is_r(self, module: str) -> bool:
        return self.records[module].actual == "R"

    def any_r(self) -> bool:
        """Whether any module of this side runs R: then the byte-moving collectives outside the
        modules (weight gathers) use the fixed-order transport too, so an all-R run shows no
        production collective; an all-P run keeps the production ones."""
        return any(r.actual == "R" for r in self.records.values())

    def note(self, module: str, key: str, value: int) -> None:
        """Adds a shape fact (rows seen, decode batch size, ...) to the module's record."""
        self.records[module].shapes[key].add(int(value))

    def _run(self, module: str, r_fn, p_fn, p_backend: str, *args):
        record = self.records[module]
        with trace_range(module):
            if record.actual == "P":
                record.call_counts[p_backend] += 1
                return p_fn(*args)
            with self.kernels(module):
                return r_fn(*args)

    @contextlib.contextmanager
    def kernels(self, module: str):
        """Attributes the extension launches made inside the block to the module's record; an R
        block that launched nothing is an error, since its result did not come from our kernels.
        A block inside another (a routed op recomputed in an R backward that is counted as a
        whole) counts nothing itself: the outer block counts every launch once."""
        if self._counting:
            yield
            return
        before = counters.read()
        self._counting = True
        try:
            yield
        finally:
            self._counting = False
        ran = counters.delta(before, counters.read())
        if not ran:
            raise RouteUnavailable(f"module {module}: the R route returned without launching an "
                                   "rl_engine kernel")
        for (kernel, device), n in ran.items():
            self.records[module].call_counts[counters.backend_id(kernel, device)] += n

    def linear(self, module: str, x, w, bias=None):
        return self._run(module, linear.det_linear, linear.production_linear,
                         "production.torch.linear", x, w, bias)

    def logits(self, module: str, hidden, lm_head):
        """Sampling logits ``hidden @ lm_head^T`` of this rank's vocab shard. On R it is det_gemm,
        whose k order does not depend on the row count, so a sequence's logits, and the token
        drawn from them, are the same whichever sequences share its decode batch."""
        return self.linear(module, hidden, lm_head)

    def rmsnorm(self, module: str, x, w, eps: float):
        return self._run(module, norm.det_rmsnorm, norm.production_rmsnorm,
                         "production.torch.rms_norm", x, w, eps)

    def rope(self, module: str, x, positions, theta: float):
        return self._run(module, rope.det_rope, rope.production_rope, "production.torch.rope",
                         x, positions, theta)

    def swiglu(self, module: str, gate_up):
        return self._run(module, swiglu.det_swiglu, swiglu.production_swiglu,
                         "production.torch.swiglu", gate_up)

    def attention(self, module: str, q, k, v, cu_q, cu_k, q_pos, scale: float):
        self.note(module, "query_rows", q.shape[0])
        return self._run(module, lambda *a: attn_ops.det_attention(*a, self._kv_block(module, q))[0],
                         attn_ops.production_attention, "production.sdpa",
                         q, k, v, cu_q, cu_k, q_pos, scale)

    def attention_decode(self, module: str, q, k_cache, v_cache, block_table, seq_lens, scale: float):
        self.note(module, "decode_batch", q.shape[0])
        return self._run(module,
                         lambda *a: attn_ops.det_attention_decode(*a, self._kv_block(module, q)),
                         attn_ops.production_attention_decode, "production.split_kv_decode",
                         q, k_cache, v_cache, block_table, seq_lens, scale)

    def _kv_block(self, module: str, q, block: int | None = None) -> int:
        """The KV block of an R attention call (given, or kv_block_size of q's head_dim), noted in
        the module's record so that each side's readback says which size it ran."""
        block = attn_ops.block_of(q, block)
        self.note(module, "kv_block", block)
        return block

    def selected_logp(self, module: str, hidden, weight, target):
        return self._run(module, logp.det_selected_logp, logp.production_selected_logp,
                         "production.torch.log_softmax", hidden, weight, target)

    def collective(self, module: str, kind: str, x, group):
        """all_reduce / all_gather / reduce_scatter with the module's implementation."""
        fixed = self.is_r(module)
        fn = getattr(collectives, kind)
        record = self.records[module]
        record.call_counts[collectives.backend_id(kind, x, fixed)] += 1
        with trace_range(module):
            if fixed and kind != "all_gather":
                with self.kernels(module):
                    return fn(x, group, fixed=True)
            return fn(x, group, fixed=fixed)

    def split(self, module: str, r_fn, p_fn, *args):
        """An op split over ranks (context-parallel attention, vocab-parallel log-prob): only the
        caller knows the split, so it gives both implementations and the router picks one. Each is
        built of this router's methods, which count it: the R one of the R-only ops below and
        `collective`, the P one of routed ops and `collective`, or it passes p_backend to
        `count_production` for the torch-native work it does itself."""
        with trace_range(module):
            return (r_fn if self.is_r(module) else p_fn)(*args)

    def count_production(self, module: str, p_backend: str) -> None:
        """Counts one torch-native call of a P route's split op (a P route has no kernel counter);
        on an R route it is an error, since R calls are read from the kernels' counters."""
        if self.is_r(module):
            raise RuntimeError(f"module {module}: a production call was made on its R route")
        self.records[module].call_counts[p_backend] += 1

    def _r_only(self, module: str, fn, *args):
        """A kernel of the R route that has no production twin (pieces of a split op)."""
        if not self.is_r(module):
            raise RuntimeError(f"module {module}: {fn.__name__} runs only on an R route")
        with trace_range(module), self.kernels(module):
            return fn(*args)

    def production_attention(self, module: str, q, k, v, cu_q, cu_k, q_pos, scale: float):
        """P only: `attention` of one CP rank's queries against K/V gathered over CP. Not noted as
        query_rows (the caller notes cp_query_rows); on an R route the CP split needs the
        chunked backward built of the R-only ops instead."""
        if self.is_r(module):
            raise RuntimeError(f"module {module}: production attention on its R route")
        return self._run(module, None, attn_ops.production_attention, "production.sdpa",
                         q, k, v, cu_q, cu_k, q_pos, scale)

    def attention_lse(self, module: str, q, k, v, cu_q, cu_k, q_pos, scale: float,
                      block: int | None = None):
        """R only: (out, fp32 lse), for a backward that the caller splits into query chunks.
        block: the KV block, which the backward's query chunks must equal (None: kv_block_size of
        q's head_dim)."""
        return self._r_only(module, attn_ops.det_attention, q, k, v, cu_q, cu_k, q_pos, scale,
                            self._kv_block(module, q, block))

    def attention_backward(self, module: str, grad_out, q, k, v, out, lse, cu_q, cu_k, q_pos,
                           scale: float, block: int | None = None):
        """R only: dq and the fp32 dk/dv partials of these query rows, in chunks of `block`."""
        return self._r_only(module, attn_ops.det_attention_backward, grad_out, q, k, v, out, lse,
                            cu_q, cu_k, q_pos, scale, self._kv_block(module, q, block))

    def sum_in_order(self, module: str, parts: list):
        """R only: the fp32 sum of parts in list order (the rank-order sum kernel)."""
        return self._r_only(module, collectives.sum_in_order, parts)

    def logp_partial(self, module: str, hidden, weight, target, start: int, tiles: int):
        """R only: (max, sumexp, target logit) of one vocab shard's subtree."""
        return self._r_only(module, logp.partial, hidden, weight, target, start, tiles)

    def logp_combine(self, module: str, maxes, sumexps, target_logits):
        """R only: (logp, lse) from the shard roots, in shard order."""
        return self._r_only(module, logp.combine, maxes, sumexps, target_logits)

    def logp_backward(self, module: str, grad, hidden, weight, target, lse, start: int):
        """R only: fp32 (d hidden, d weight shard) of the selected log-prob."""
        return self._r_only(module, logp.backward, grad, hidden, weight, target, lse, start)

    def point_to_point(self, module: str, kind: str, x, group, **kwargs):
        """all_gather / all_to_all over the p2p_reference transport: moves bytes, adds nothing, and
        is counted under its own backend id (x: a tensor, or the list all_to_all sends)."""
        first = x[0] if isinstance(x, (list, tuple)) else x
        self.records[module].call_counts[p2p.backend_id(first)] += 1
        with trace_range(module):
            return getattr(p2p, kind)(x, group=group, **kwargs)

    def gather_bytes(self, x, group):
        """An all-gather outside the modules (full weights from TP shards): it moves bytes only, so
        its result is the same either way; fixed-order whenever any module is R (see any_r)."""
        return collectives.all_gather(x, group, fixed=self.any_r())

    def sum_gradients(self, flat, group):
        """The sum of flat over the gradient group. Fixed (any module R): a reduce-scatter then an
        all-gather of the reduced shards, the data flow of Megatron's distributed optimizer; every
        element is still one rank-order fp32 sum, so the bits equal a fixed-order all-reduce."""
        fixed = self.any_r()
        world = dist.get_world_size(group)
        if not fixed or world == 1:
            return collectives.all_reduce(flat, group, fixed=fixed)
        n = flat.numel()
        padded = torch.cat([flat, flat.new_zeros((-n) % world)])
        shard = collectives.reduce_scatter(padded, group)
        return collectives.all_gather(shard, group)[:n]

    def module_records(self) -> list[dict[str, Any]]:
        return [r.as_dict() for r in self.records.values()]
