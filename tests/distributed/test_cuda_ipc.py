"""The CUDA IPC collectives on two GPUs: all-gather, reduce-scatter and all-reduce give bitwise the
same result on both ranks, equal to a rank-order fp32 sum computed with plain torch on one GPU, at
sizes from 1 element to 256 MiB (odd sizes, sizes that are not a multiple of 16 bytes, a
misaligned input), run after run and replayed from a CUDA graph; integer tensors (token ids,
positions) all-gathered byte for byte. Skipped without two Hopper GPUs."""

import pytest
import torch

from rl_engine.distributed import collectives
from rl_engine.engines.launch import launch
from rl_engine.ops import counters

HOPPER2 = (torch.cuda.is_available() and torch.cuda.device_count() >= 2
           and torch.cuda.get_device_capability() == (9, 0))
pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not HOPPER2, reason="needs two Hopper (sm_90) CUDA GPUs")]

WORLD = 2
MIB = 1 << 20
# (dtype, elements per rank); the last ones are 256 MiB messages.
CASES = ((torch.bfloat16, 1), (torch.bfloat16, 3), (torch.float16, 7), (torch.float32, 5),
         (torch.bfloat16, 4097), (torch.float32, 65536 + 3), (torch.bfloat16, MIB + 9),
         (torch.float16, 16 * MIB), (torch.bfloat16, 128 * MIB), (torch.float32, 64 * MIB))


def _inputs(rank: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(7919 * numel + rank)
    # Mixed magnitudes make the order of the sum visible in the last bits.
    x = torch.randn(numel, generator=g, device="cuda")
    x = x * 10.0 ** torch.randint(-3, 4, (numel,), generator=g, device="cuda")
    return x.to(dtype)


def _rank_order_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """Plain torch: fp32 adds in rank order, one rounding to the parts' dtype."""
    acc = parts[0].float()
    for p in parts[1:]:
        acc = acc + p.float()
    return acc.to(parts[0].dtype)


def _check(rank: int, world: int) -> list[str]:
    """Failures seen on this rank; each rank recomputes every rank's inputs for the references."""
    bad = []
    for dtype, numel in CASES:
        parts = [_inputs(r, dtype, numel) for r in range(world)]
        x = parts[rank]
        ref = _rank_order_sum(parts)
        gathered = torch.cat(parts)
        share = -(-numel // world)
        padded = torch.cat([ref, ref.new_zeros(share * world - numel)])
        xs = torch.cat([x, x.new_zeros(share * world - numel)])
        for attempt in range(2):
            got = {"all_reduce": collectives.all_reduce(x, None),
                   "all_gather": collectives.all_gather(x, None),
                   "reduce_scatter": collectives.reduce_scatter(xs, None)}
            want = {"all_reduce": ref, "all_gather": gathered,
                    "reduce_scatter": padded[rank * share:(rank + 1) * share]}
            for kind in got:
                if not torch.equal(got[kind], want[kind]):
                    bad.append(f"rank {rank} {kind} {dtype} x{numel} attempt {attempt}")
        del parts, x, ref, gathered, padded, xs
    # A tensor that starts 2 bytes into its storage takes the scalar path; same bits.
    base = _inputs(rank, torch.bfloat16, 1001)
    want = torch.cat([_inputs(r, torch.bfloat16, 1001)[1:] for r in range(world)])
    if not torch.equal(collectives.all_gather(base[1:], None), want):
        bad.append(f"rank {rank} misaligned all_gather")
    # Token ids and positions travel as bytes: int64, int32 and an odd int16 count (2-byte words).
    for dtype, shape in ((torch.int64, (5, 3)), (torch.int32, (7,)), (torch.int16, (3,)), (torch.int64, ())):
        ids = [torch.arange(r * 1000, r * 1000 + max(1, torch.Size(shape).numel()), device="cuda")
               .mul(-(1 << 40)).to(dtype).reshape(shape) for r in range(world)]
        got = collectives.all_gather(ids[rank], None)
        want = torch.cat([i.reshape(-1, *shape[1:]) if shape else i.reshape(1) for i in ids])
        if not torch.equal(got, want):
            bad.append(f"rank {rank} all_gather {dtype} {tuple(shape)}")
    # Captured once, replayed with new data in the same input buffer.
    static = _inputs(rank, torch.bfloat16, 4 * MIB)
    collectives.all_reduce(static, None)  # grows the buffers before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = collectives.all_reduce(static, None)
    for n in (4 * MIB, 4 * MIB + 1):
        parts = [_inputs(r, torch.bfloat16, n)[:4 * MIB] for r in range(world)]
        static.copy_(parts[rank])
        graph.replay()
        if not torch.equal(out, _rank_order_sum(parts)):
            bad.append(f"rank {rank} graph replay {n}")
    return bad


def test_ipc_collectives_are_rank_order_sums_on_both_ranks():
    failures = launch(_check, WORLD, device="cuda", timeout=600)
    assert failures == [[], []]


def _backends(rank: int, world: int) -> tuple[dict, dict]:
    collectives.CALLS.clear()
    before = counters.read()
    x = torch.ones(8, device="cuda")
    collectives.all_reduce(x, None)
    collectives.all_gather(x, None)
    collectives.reduce_scatter(x, None)
    return dict(collectives.CALLS), counters.delta(before, counters.read())


def test_ipc_collectives_report_their_backend_ids_and_count_their_launches():
    # The routing layer requires an R collective to show a counted rl_engine launch.
    calls, launched = launch(_backends, WORLD, device="cuda", timeout=300)[0]
    kinds = ("all_reduce", "all_gather", "reduce_scatter")
    assert calls == {f"rlkernel.collective.{k}.cuda_ipc.v1": 1 for k in kinds}
    assert launched == {(f"ipc_{k}", "cuda"): 1 for k in kinds}
