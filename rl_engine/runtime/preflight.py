"""`rlk preflight`: is this checkout able to run the plan's R routes, before any real work?

Each check yields one line; the first failure stops the walk with its exit code (2: the build or the
plan must change; 3: the probe itself broke) and the fix. `require` is the same walk without the
probe, raising instead of yielding: what a step runs before it launches any rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from rl_engine.errors import BadInput
from rl_engine.runtime import requirements
from rl_engine.runtime.plan import MODULES, SIDES, Plan


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    ok: bool
    detail: str
    exit_code: int = 0


def _probe(plan: Plan, side: str, device: torch.device) -> dict[str, dict]:
    """Runs a few tiny tensors through every module of one side; returns the modules' records."""
    from rl_engine.runtime.routing import Router

    router = Router(plan, side=side, engine="builtin", device=device)
    g = torch.Generator().manual_seed(0)
    dt = torch.bfloat16
    rnd = lambda *s: torch.randn(*s, generator=g).to(dt).to(device)  # noqa: E731
    # head_dim 64: the smallest the CUDA attention kernels take (the CPU ones take any multiple of 8).
    h, heads, d, t = 128, 2, 64, 5
    x, w = rnd(t, h), rnd(h, h)
    pos = torch.arange(t, device=device)
    cu = torch.tensor([0, t], dtype=torch.int32, device=device)
    y = router.linear("attention", router.rmsnorm("attention", x, rnd(h), 1e-6), w)
    q = router.rope("attention", y.reshape(t, h // d, d)[:, :heads].contiguous(), pos, 1e6)
    k, v = rnd(t, heads, d), rnd(t, heads, d)
    q = q.detach().requires_grad_(side == "training")
    out = router.attention("attention", q, k, v, cu, cu, pos, d ** -0.5)
    if side == "training":
        out.float().sum().backward()
    else:
        from rl_engine.ops.attention import PAGE_SIZE

        cache_k = torch.zeros(1, PAGE_SIZE, heads, d, dtype=dt, device=device)
        cache_v = torch.zeros_like(cache_k)
        cache_k[0, :t], cache_v[0, :t] = k, v
        table = torch.zeros(1, 1, dtype=torch.int32, device=device)
        router.attention_decode("attention", q[-1:].detach(), cache_k, cache_v, table,
                                torch.tensor([t], dtype=torch.int32, device=device), d ** -0.5)
    router.swiglu("ffn", router.linear("ffn", router.rmsnorm("ffn", x, rnd(h), 1e-6), rnd(2 * h, h)))
    hidden = router.rmsnorm("logp", x, rnd(h), 1e-6)
    router.selected_logp("logp", hidden, rnd(300, h), torch.arange(t, device=device))
    return {m: router.records[m].as_dict() for m in MODULES}


def require(plan: Plan, device: str = "cpu") -> None:
    """Raises (exit code 2) when a strict R route of the plan cannot run on device: no GPU visible,
    a GPU that is not Hopper, kernels not built. Launches nothing, so a step fails at once instead
    of in each of its workers."""
    from rl_engine.runtime.routing import RouteUnavailable

    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise BadInput("--device cuda: no CUDA device is visible; use --device cpu")
    if plan.mode != "strict":
        return  # audit: a route that cannot run falls back, and its readback says so
    for side in SIDES:
        for module in MODULES:
            if plan.impl(module, side) == "R":
                reason = requirements.missing(module, side, dev)
                if reason is not None:
                    raise RouteUnavailable(f"strict {side} route of module {module} cannot run "
                                           f"on {dev.type}: {reason}")


def run(plan: Plan, device: str = "cpu") -> Iterator[Check]:
    import rl_engine
    from rl_engine.artifacts.provenance import SOURCE_ROOT
    from rl_engine.ops import _lib

    here = Path(rl_engine.__file__).resolve()
    yield Check("rl_engine imports from this checkout", here.is_relative_to(SOURCE_ROOT), str(here.parent),
                0 if here.is_relative_to(SOURCE_ROOT) else 2)
    if not _lib.available():
        yield Check("rl_engine._C loads", False, "not built: run `pip install --no-build-isolation -e .`", 2)
        return
    from rl_engine import _C

    yield Check("rl_engine._C loads", True, Path(_C.__file__).name)
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        yield Check("CUDA device", False, "no CUDA device is visible; use --device cpu", 2)
        return
    for side in SIDES:
        for module in MODULES:
            if plan.impl(module, side) != "R":
                continue
            reason = requirements.missing(module, side, dev)
            name = f"{side} {module}: R ops registered for {dev.type}"
            yield Check(name, reason is None, reason or ", ".join(requirements.required_ops(module, side)),
                        0 if reason is None else 2)
            if reason is not None:
                return
    for side in SIDES:
        try:
            records = _probe(plan, side, dev)
        except Exception as exc:  # noqa: BLE001 - any probe failure is reported, with its type
            yield Check(f"{side} probe", False, f"{type(exc).__name__}: {exc}", 3)
            return
        for module, rec in records.items():
            counted = sum(n for b, n in rec["call_counts"].items() if b.startswith("rlkernel."))
            if rec["actual"] == "R" and counted == 0:
                yield Check(f"{side} {module} probe", False, "the R route launched no rl_engine kernel", 3)
                return
            yield Check(f"{side} {module} probe", True,
                        f"{rec['implementation']} ({counted} kernel launches)")
