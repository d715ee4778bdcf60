"""Fixed-order collectives: every rank gets the same bits, equal to a rank-order fp32 sum computed
in one process, at every message size; the native (production) ones are only close."""

import pytest
import torch

from rl_engine.distributed import collectives
from rl_engine.engines.launch import launch

SIZES = (1, 3, 17, 4096 + 5)


def _inputs(rank: int, size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * size + rank)
    # Mixed magnitudes make the sum order visible in the last bits.
    return (torch.randn(size, generator=g) * 10.0 ** torch.randint(-3, 4, (size,), generator=g)).bfloat16()


def _reference(world: int, size: int) -> torch.Tensor:
    acc = _inputs(0, size).float()
    for r in range(1, world):
        acc = acc + _inputs(r, size).float()
    return acc


def _collect(rank: int, world: int) -> dict:
    out = {}
    for size in SIZES:
        x = _inputs(rank, size)
        out[("all_reduce", size)] = collectives.all_reduce(x, None)
        out[("all_gather", size)] = collectives.all_gather(x[None], None)
        padded = torch.cat([x, x.new_zeros((-size) % world)])
        out[("reduce_scatter", size)] = collectives.reduce_scatter(padded, None)
        out[("native_all_reduce", size)] = collectives.all_reduce(x, None, fixed=False)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_fixed_order_collectives_are_rank_order_sums_on_every_rank(world):
    results = launch(_collect, world)
    for size in SIZES:
        ref = _reference(world, size)
        for rank, res in enumerate(results):
            assert torch.equal(res[("all_reduce", size)], ref.bfloat16())
            assert torch.equal(res[("all_gather", size)],
                               torch.stack([_inputs(r, size) for r in range(world)]))
            share = -(-size // world)
            padded = torch.cat([ref, ref.new_zeros((-size) % world)])
            assert torch.equal(res[("reduce_scatter", size)],
                               padded[rank * share:(rank + 1) * share].bfloat16())
            # The native sum rounds to bf16 after every add: within a few bf16 ulps of the
            # magnitudes it added, but not the fixed-order bits.
            scale = sum(_inputs(r, size).float().abs() for r in range(world))
            err = (res[("native_all_reduce", size)].float() - ref).abs()
            assert bool((err <= scale * world * 2.0 ** -7).all())


def test_rank_order_sum_adds_in_rank_order_in_fp32(rl_ops):
    parts = torch.tensor([[1e8], [1.0], [-1e8]], dtype=torch.float32)
    # (1e8 + 1) - 1e8 == 0 in fp32; any other order gives 1.
    assert rl_ops.rank_order_sum(parts).item() == 0.0
    assert rl_ops.rank_order_sum(parts[[0, 2, 1]]).item() == 1.0
    torch.library.opcheck(rl_ops.rank_order_sum.default, (torch.randn(3, 5, 2).bfloat16(),))


def test_sum_in_order_is_the_same_rank_order_sum():
    parts = [torch.randn(7).bfloat16() for _ in range(3)]
    want = (parts[0].float() + parts[1].float()) + parts[2].float()
    assert torch.equal(collectives.sum_in_order(parts), want)


def test_transport_record_names_what_carried_the_fixed_collectives():
    saved = dict(collectives.CALLS)
    try:
        collectives.CALLS.clear()
        collectives.CALLS["production.nccl.all_reduce"] += 1
        assert collectives.transport_record()["communication_backend"] is None
        collectives.CALLS["rlkernel.collective.all_gather.cpu.v1"] += 1
        assert collectives.transport_record()["communication_backend"] == "cpu_ag_rs"
        collectives.CALLS["rlkernel.collective.all_reduce.cuda_ipc.v1"] += 1
        record = collectives.transport_record()
        assert record == {"communication_backend": "cpu_ag_rs,cuda_ag_rs", "fallback_allowed": False,
                          "fallback": False}
    finally:
        collectives.CALLS.clear()
        collectives.CALLS.update(saved)


def test_ipc_collectives_refuse_a_dtype_they_do_not_sum():
    from rl_engine.distributed import cuda_ipc

    comm = cuda_ipc.Communicator.__new__(cuda_ipc.Communicator)  # no GPU needed for the check
    with pytest.raises(TypeError, match="bf16, fp16 or fp32"):
        comm.run("all_reduce", torch.ones(4, dtype=torch.int64))
