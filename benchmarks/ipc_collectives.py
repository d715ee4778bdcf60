"""Bus bandwidth of rl_engine's CUDA IPC collectives against NCCL on the same GPUs, same run.

All-reduce, all-gather and reduce-scatter of bf16 messages from 1 KiB to 256 MiB (the size is the
whole buffer: the all-reduce tensor, the gathered output, the scattered input). Bus bandwidth as
nccl-tests counts it: size / time * 2(N-1)/N for all-reduce, size / time * (N-1)/N for the others.
ratio = NCCL time / IPC time (above 1: ours is faster). Times are CUDA-event medians over
--repeats windows of --iters back-to-back calls, after warm-up, both ranks starting each window
together. Targets: at least 0.8x NCCL at 64 MiB and at least 1x at 256 KiB and below. Before it
is timed, every collective's output at every size is checked on every rank against a plain-torch
reference (the rank-order fp32 sum of the inputs gathered by NCCL, rounded once; for all-gather
the concatenation): `bitwise` in each row is the AND over ranks of `torch.equal`.

    python benchmarks/ipc_collectives.py [--gpus N] [--out results.json] [--repeats 7] [--iters 20]

--gpus defaults to every visible GPU. The JSON records the commit and dirty flag of the checkout.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

RESULT = Path(__file__).resolve().parent / "results" / "ipc_collectives.json"
KINDS = ("all_reduce", "all_gather", "reduce_scatter")
SIZES = tuple(1 << s for s in range(10, 29, 2))  # 1 KiB .. 256 MiB
TARGETS = {"ratio_at_64MiB": 0.8, "ratio_at_256KiB_and_below": 1.0}


def _timed(fn, repeats: int, iters: int) -> float:
    """Median microseconds of one call."""
    import torch

    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        _host_barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / iters)
    return statistics.median(times)


def _host_barrier() -> None:
    import torch.distributed as dist

    seen: list = [None] * dist.get_world_size()
    dist.all_gather_object(seen, 0)  # over gloo: no GPU work in the timed window


def _calls(kind: str, nbytes: int, world: int):
    """(ours, nccl, x): zero-argument calls on this rank's bf16 input x (NCCL's all-reduce works in
    place on x, so the reference check runs before NCCL is timed)."""
    import torch
    import torch.distributed as dist

    from rl_engine.distributed import collectives

    numel = nbytes // 2
    if kind == "all_reduce":
        x = torch.randn(numel, device="cuda").bfloat16()
        return (lambda: collectives.all_reduce(x, None), lambda: dist.all_reduce(x), x)
    if kind == "all_gather":
        x = torch.randn(numel // world, device="cuda").bfloat16()
        out = torch.empty(numel, device="cuda", dtype=torch.bfloat16)
        return (lambda: collectives.all_gather(x, None),
                lambda: dist.all_gather_into_tensor(out, x), x)
    x = torch.randn(numel, device="cuda").bfloat16()
    out = torch.empty(numel // world, device="cuda", dtype=torch.bfloat16)
    return (lambda: collectives.reduce_scatter(x, None),
            lambda: dist.reduce_scatter_tensor(out, x), x)


def _bitwise(kind: str, ours, x, rank: int, world: int) -> bool:
    """Whether ours() gives, on every rank, the plain-torch reference of the inputs x."""
    import torch
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x)  # moves bytes only
    if kind == "all_gather":
        ref = torch.cat(parts)
    else:
        total = parts[0].float()
        for p in parts[1:]:
            total = total + p.float()
        ref = total.to(x.dtype)
        if kind == "reduce_scatter":
            ref = ref.chunk(world)[rank]
    ok = torch.tensor([int(torch.equal(ours(), ref))], device="cuda")
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item())


def _rank(rank: int, world: int, repeats: int, iters: int) -> list[dict]:
    rows = []
    for kind in KINDS:
        factor = 2 * (world - 1) / world if kind == "all_reduce" else (world - 1) / world
        for nbytes in SIZES:
            ours, nccl, x = _calls(kind, nbytes, world)
            bitwise = _bitwise(kind, ours, x, rank, world)
            ipc_us = _timed(ours, repeats, iters)
            nccl_us = _timed(nccl, repeats, iters)
            rows.append({"kind": kind, "bytes": nbytes, "ipc_us": round(ipc_us, 2),
                         "nccl_us": round(nccl_us, 2),
                         "ipc_busbw_GBps": round(nbytes / ipc_us / 1e3 * factor, 1),
                         "nccl_busbw_GBps": round(nbytes / nccl_us / 1e3 * factor, 1),
                         "ratio": round(nccl_us / ipc_us, 3), "bitwise": bitwise})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=None, help="ranks, one GPU each (default: all)")
    parser.add_argument("--out", type=Path, default=RESULT)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()

    import torch

    from rl_engine.artifacts import files, provenance
    from rl_engine.engines.launch import launch

    world = args.gpus or torch.cuda.device_count()
    if world < 2 or world > torch.cuda.device_count() or world & (world - 1):
        raise SystemExit(f"--gpus {world}: need a power of two from 2 to "
                         f"{torch.cuda.device_count()} visible GPUs (the sizes are powers of two)")
    rows = launch(_rank, world, args=(args.repeats, args.iters), device="cuda", timeout=600)[0]
    for r in rows:
        print(f"{r['kind']:>15} {r['bytes']:>10} B  ipc {r['ipc_us']:9.2f} us "
              f"{r['ipc_busbw_GBps']:7.1f} GB/s  nccl {r['nccl_us']:9.2f} us "
              f"{r['nccl_busbw_GBps']:7.1f} GB/s  ratio {r['ratio']:.2f}")
    at64 = {r["kind"]: r["ratio"] for r in rows if r["bytes"] == 64 << 20}
    small = {f"{r['kind']}@{r['bytes']}": r["ratio"] for r in rows if r["bytes"] <= 256 << 10}
    verdict = {"ratio_at_64MiB": at64, "min_ratio_at_256KiB_and_below": min(small.values()),
               "meets_64MiB": all(v >= TARGETS["ratio_at_64MiB"] for v in at64.values()),
               "meets_small": min(small.values()) >= TARGETS["ratio_at_256KiB_and_below"],
               "bitwise": all(r["bitwise"] for r in rows)}
    print(verdict)
    src = provenance.source()
    files.write_json(args.out, {"commit": src["commit"], "dirty": src["dirty"],
                                "device": torch.cuda.get_device_name(0), "world": world,
                                "dtype": "bf16", "torch": torch.__version__,
                                "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                                "targets": TARGETS, "verdict": verdict, "rows": rows})


if __name__ == "__main__":
    main()
