"""The Hopper rank_order_sum (the payload sum of the fixed-order collectives on CUDA) gives the CPU
kernel's bits for every input: fp32 rows of every magnitude, subnormals and signed zeros included,
through the 16-byte and the scalar path; bf16/fp16 inputs too. Skipped without a Hopper GPU."""

import pytest
import torch

from rl_engine.distributed import collectives
from rl_engine.ops import counters

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not HOPPER, reason="needs a Hopper (sm_90) CUDA GPU")]


@pytest.fixture
def ops(rl_ops):
    assert rl_ops.det_gemm_sm90_compiled(), "the extension was built without its sm_90a kernels"
    return rl_ops


def wild(ranks: int, numel: int, seed: int) -> torch.Tensor:
    """fp32 [ranks, numel] spanning 1e-42 (subnormal) to 1e30, both signs, with exact zeros of
    both signs: sums whose bits depend on the order and on subnormals being kept."""
    g = torch.Generator().manual_seed(seed)
    mant = torch.randn(ranks, numel, generator=g)
    scale = torch.pow(10.0, torch.randint(-42, 31, (ranks, numel), generator=g).float())
    x = mant * scale
    x.view(-1)[::11] = mant.view(-1)[::11] * 1e-40  # subnormal: below 1.2e-38
    zeros = torch.rand(ranks, numel, generator=g) < 0.05
    return torch.where(zeros, torch.where(mant > 0, 0.0, -0.0), x)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("ranks,numel", [(1, 12), (2, 4096), (3, 1000), (4, 4097), (8, 65536 + 3)])
def test_cuda_sum_is_the_cpu_sum_bit_for_bit(ops, ranks, numel):
    parts = wild(ranks, numel, seed=ranks * 7 + numel)
    assert (parts.abs() < torch.finfo(torch.float32).tiny).logical_and(parts != 0).any()
    cpu = ops.rank_order_sum(parts)
    gpu = ops.rank_order_sum(parts.cuda())
    assert gpu.is_cuda and gpu.dtype == torch.float32 and gpu.shape == (numel,)
    assert torch.equal(bits(gpu.cpu()), bits(cpu))


def test_misaligned_and_strided_inputs_take_the_scalar_path_with_the_same_bits(ops):
    flat = wild(1, 1 + 3 * 4096, seed=5)[0].cuda()
    misaligned = flat[1:].view(3, 4096)  # starts 4 bytes past a 16-byte boundary
    assert misaligned.data_ptr() % 16 != 0
    strided = wild(3, 2 * 512, seed=6).cuda()[:, ::2]
    for parts in (misaligned, strided):
        gpu, cpu = ops.rank_order_sum(parts), ops.rank_order_sum(parts.cpu())
        assert torch.equal(bits(gpu.cpu()), bits(cpu))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_sum_in_fp32_like_the_cpu(ops, dtype):
    parts = torch.randn(5, 3, 333, generator=torch.Generator().manual_seed(1)).to(dtype)
    gpu = ops.rank_order_sum(parts.cuda())
    assert gpu.dtype == torch.float32 and gpu.shape == (3, 333)
    assert torch.equal(bits(gpu.cpu()), bits(ops.rank_order_sum(parts)))


def test_the_order_is_rank_order_and_the_launch_is_counted(ops):
    parts = torch.tensor([[1e8], [1.0], [-1e8]], device="cuda")
    before = counters.read()
    assert ops.rank_order_sum(parts).item() == 0.0  # (1e8 + 1) rounds to 1e8 in fp32
    assert ops.rank_order_sum(parts[[0, 2, 1]]).item() == 1.0
    assert counters.delta(before, counters.read()) == {("rank_order_sum", "cuda"): 2}
    assert torch.equal(collectives.sum_in_order(list(parts)), ops.rank_order_sum(parts))


def test_opcheck(ops):
    torch.library.opcheck(ops.rank_order_sum.default, (torch.randn(3, 5, 8, device="cuda"),))
    torch.library.opcheck(ops.rank_order_sum.default,
                          (torch.randn(2, 7, device="cuda").bfloat16(),))
