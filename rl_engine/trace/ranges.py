"""Which `rlk.<module>` range each event of a torch.profiler Chrome trace ran in.

The router runs every routed op inside `torch.profiler.record_function("rlk.<module>")`, which
the trace holds as a `user_annotation` event (pid, tid, ts, dur). On one thread these ranges and
the op events nest like a call stack, so an event belongs to the innermost range on its pid/tid
that contains its start.

Backward ops run later, from the autograd engine, outside any range. The profiler links each
forward op to the backward node it created with a `fwdbwd` flow (`ph` "s" at the forward op, "f"
at the node); the node's span inherits the range of its forward op, so the backward kernels of an
R module are held to that module's plan too.

A CUDA kernel is attributed through its launch: the kernel's `correlation` arg names the
`cuda_runtime` / `cuda_driver` call (cudaLaunchKernel, cuLaunchKernel, cudaGraphLaunch) that
launched it, and that call lies on the launching CPU thread. This is chosen over the
`gpu_user_annotation` spans on the GPU timeline because those mirror only the forward ranges:
backward kernels, launched from the autograd thread, have no GPU-side range at all, while their
launches do lie inside an inherited backward span. A kernel whose launch is not in the trace is
counted as unattributed.
"""

from __future__ import annotations

import bisect
import collections
from dataclasses import dataclass, field
from typing import Any, Iterable

PREFIX = "rlk."
_LAUNCH_CATS = ("cuda_runtime", "cuda_driver")


@dataclass(slots=True)
class _Thread:
    """The spans of one pid/tid, sorted by start, each with the index of its enclosing span."""

    starts: list[float] = field(default_factory=list)
    ends: list[float] = field(default_factory=list)
    modules: list[str] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)

    def module_at(self, ts: float) -> str | None:
        j = bisect.bisect_right(self.starts, ts) - 1
        while j >= 0 and self.ends[j] < ts:
            j = self.parents[j]
        return self.modules[j] if j >= 0 else None


def _index(spans: Iterable[tuple[Any, float, float, str]]) -> dict[Any, _Thread]:
    by_thread: dict[Any, list[tuple[float, float, str]]] = collections.defaultdict(list)
    for thread, start, end, module in spans:
        by_thread[thread].append((start, end, module))
    out: dict[Any, _Thread] = {}
    for thread, items in by_thread.items():
        t = out[thread] = _Thread()
        stack: list[int] = []
        for start, end, module in sorted(items, key=lambda s: (s[0], -s[1])):
            while stack and t.ends[stack[-1]] < start:
                stack.pop()
            t.parents.append(stack[-1] if stack else -1)
            stack.append(len(t.starts))
            t.starts.append(start)
            t.ends.append(end)
            t.modules.append(module)
    return out


def _thread(e: dict) -> tuple[Any, Any]:
    return e.get("pid"), e.get("tid")


def _span(e: dict) -> tuple[float, float]:
    ts = float(e.get("ts", 0))
    return ts, ts + float(e.get("dur", 0))


class Ranges:
    """The module of any (pid, tid, ts) of one trace: its `rlk.<module>` ranges and the backward
    spans that inherit them."""

    def __init__(self, events: list[dict]):
        direct = [(_thread(e), *_span(e), str(e["name"])[len(PREFIX):]) for e in events
                  if e.get("ph") == "X" and e.get("cat") == "user_annotation"
                  and str(e.get("name", "")).startswith(PREFIX)]
        self.counts = collections.Counter(module for *_, module in direct)
        forward = _index(direct)
        starts: dict[Any, str] = {}
        ends: dict[Any, tuple[Any, float]] = {}
        for e in events:
            if e.get("cat") != "fwdbwd":
                continue
            if e.get("ph") == "s":
                t = forward.get(_thread(e))
                module = t.module_at(float(e["ts"])) if t else None
                if module:
                    starts[e.get("id")] = module
            elif e.get("ph") == "f":
                ends[e.get("id")] = (_thread(e), float(e["ts"]))
        inherited = []
        if starts:
            wanted = {ends[i]: m for i, m in starts.items() if i in ends}
            for e in events:
                if e.get("ph") == "X" and e.get("cat") == "cpu_op":
                    module = wanted.get((_thread(e), float(e.get("ts", 0))))
                    if module:
                        inherited.append((_thread(e), *_span(e), module))
        self._threads = _index(direct + inherited)

    def module_at(self, thread: Any, ts: float) -> str | None:
        t = self._threads.get(thread)
        return t.module_at(ts) if t else None


def launches(events: list[dict]) -> dict[Any, tuple[Any, float]]:
    """correlation id -> (pid/tid, ts) of the CPU call that launched it."""
    out = {}
    for e in events:
        if e.get("cat") in _LAUNCH_CATS:
            corr = (e.get("args") or {}).get("correlation")
            if corr is not None:
                out[corr] = (_thread(e), float(e.get("ts", 0)))
    return out


def outermost(events: list[dict], family_of) -> list[tuple[dict, str]]:
    """(event, family) of the op events that have a family, leaving out those inside an event of
    the same family on their thread: aten::linear -> aten::matmul -> aten::mm is one GEMM call."""
    by_thread: dict[Any, list[tuple[float, float, dict, str]]] = collections.defaultdict(list)
    for e in events:
        family = family_of(str(e.get("name", "")))
        if family:
            by_thread[_thread(e)].append((*_span(e), e, family))
    out = []
    for items in by_thread.values():
        stack: list[tuple[float, str]] = []
        for start, end, e, family in sorted(items, key=lambda s: (s[0], -s[1])):
            while stack and stack[-1][0] < start:
                stack.pop()
            if all(f != family for _, f in stack):
                out.append((e, family))
            stack.append((end, family))
    return out
