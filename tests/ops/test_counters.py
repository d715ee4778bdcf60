"""The launch counters that readbacks report: rl_engine/ops/counters.py names the rows of
include/rl_engine/kernel_ids.h in the same order, and each op launch adds one to its own row only,
so a readback's call counts say which kernels really ran."""

import re
from pathlib import Path

import pytest
import torch

from rl_engine.ops import attention, counters, linear
from seeded import randn

HEADER = Path(__file__).resolve().parents[2] / "include" / "rl_engine" / "kernel_ids.h"


def header_kernels() -> list[str]:
    """The KernelId enumerators before kNumKernels, kCamelCase turned into snake_case."""
    body = re.search(r"enum\s+KernelId\s*:\s*int\s*\{(.*?)\};", HEADER.read_text(), re.S).group(1)
    names = [re.match(r"\s*(k\w+)", item).group(1) for item in body.split(",") if item.strip()]
    assert names[-1] == "kNumKernels"
    return [re.sub(r"(?<!^)(?=[A-Z])", "_", n[1:]).lower() for n in names[:-1]]


def test_python_names_follow_the_header_enum(rl_ops):
    assert list(counters.KERNELS) == header_kernels()
    assert tuple(rl_ops.kernel_counters().shape) == (len(counters.KERNELS), len(counters.DEVICES))
    assert set(counters.FAMILY) == set(counters.KERNELS)


def launches(ops):
    """One call of every op, by counter name."""
    x, w = randn(4, 16, seed=1), randn(8, 16, seed=2)
    dy = randn(4, 8, seed=3)
    nw = randn(16, seed=4)
    out, rstd = ops.rmsnorm(x, nw, 1e-6)
    q, k, v = randn(5, 2, 8, seed=5), randn(5, 1, 8, seed=6), randn(5, 1, 8, seed=7)
    cu, pos = torch.tensor([0, 5], dtype=torch.int32), torch.arange(5)
    a_out, lse = ops.attention_fwd(q, k, v, cu, cu, pos, 0.3, 8)
    k_cache, v_cache = k.view(5, 1, 1, 8), v.view(5, 1, 1, 8)  # five pages of one slot
    table, seq_lens = torch.arange(5, dtype=torch.int32)[None], torch.tensor([5], dtype=torch.int32)
    target = torch.tensor([0, 3, 7, 1])
    m, s, t = ops.linear_logp_partial(x, w, target, 0, 8, 1)
    logp_lse = ops.logp_combine(m[None], s[None], t[None])[1]
    return {
        "det_gemm": lambda: ops.det_gemm(x, w, None),
        "det_gemm_grad_input": lambda: ops.det_gemm_grad_input(dy, w),
        "det_gemm_grad_weight": lambda: ops.det_gemm_grad_weight(dy, x),
        "rmsnorm": lambda: ops.rmsnorm(x, nw, 1e-6),
        "rmsnorm_backward": lambda: ops.rmsnorm_backward(out, x, nw, rstd),
        "rope": lambda: ops.rope(q, pos, 10_000.0),
        "rope_backward": lambda: ops.rope_backward(q, pos, 10_000.0),
        "swiglu": lambda: ops.swiglu(x),
        "swiglu_backward": lambda: ops.swiglu_backward(x[:, :8], x),
        "attention_fwd": lambda: ops.attention_fwd(q, k, v, cu, cu, pos, 0.3, 8),
        "attention_decode": lambda: ops.attention_decode(q[4:], k_cache, v_cache, table, seq_lens,
                                                         0.3, 1),
        "attention_bwd": lambda: ops.attention_bwd(a_out, q, k, v, a_out, lse, cu, cu, pos, 0.3, 8, 8),
        "linear_logp_partial": lambda: ops.linear_logp_partial(x, w, target, 0, 8, 1),
        "logp_combine": lambda: ops.logp_combine(m[None], s[None], t[None]),
        "linear_logp_backward": lambda: ops.linear_logp_backward(randn(4), x, w, target, logp_lse, 0),
        "rank_order_sum": lambda: ops.rank_order_sum(randn(3, 4)),
    }


def test_every_kernel_has_a_launch_here(rl_ops):
    assert set(launches(rl_ops)) == set(counters.KERNELS) - set(counters.CUDA_ONLY)


@pytest.mark.parametrize("kernel", [k for k in counters.KERNELS if k not in counters.CUDA_ONLY])
def test_each_op_increments_exactly_its_counter(rl_ops, kernel):
    call = launches(rl_ops)[kernel]  # setup launches other kernels; they are not counted below
    before = counters.read()
    call()
    assert counters.delta(before, counters.read()) == {(kernel, "cpu"): 1}


def test_reset_clears_every_counter(rl_ops):
    rl_ops.det_gemm(randn(2, 4), randn(3, 4), None)
    counters.reset()
    assert set(counters.read().values()) == {0}


def test_wrapper_backward_launches_only_what_it_needs():
    """det_linear's backward: grad_input always, grad_weight for the weight and again for the
    bias, nothing for a frozen weight; det_attention's backward is one attention_bwd."""
    x = randn(4, 16, seed=1).requires_grad_()
    w, b = randn(8, 16, seed=2).requires_grad_(), randn(8, seed=3).requires_grad_()
    for params, expect in (((x, w, b), {"det_gemm_grad_input": 1, "det_gemm_grad_weight": 2}),
                           ((x, w.detach(), None), {"det_gemm_grad_input": 1})):
        out = linear.det_linear(*params)
        before = counters.read()
        torch.autograd.grad(out.sum(), [p for p in params if p is not None and p.requires_grad])
        assert counters.delta(before, counters.read()) == {(k, "cpu"): n for k, n in expect.items()}

    q = randn(5, 2, 8, seed=5).requires_grad_()
    k, v = randn(5, 1, 8, seed=6).requires_grad_(), randn(5, 1, 8, seed=7).requires_grad_()
    cu, pos = torch.tensor([0, 5], dtype=torch.int32), torch.arange(5)
    out = attention.det_attention(q, k, v, cu, cu, pos, 0.3, 8)[0]
    before = counters.read()
    torch.autograd.grad(out.sum(), (q, k, v))
    assert counters.delta(before, counters.read()) == {("attention_bwd", "cpu"): 1}
