"""det_gemm and its two backward products on the CPU: bitwise batch invariance (a row's bits do
not depend on how many rows share the call nor on where it sits), bitwise thread invariance,
agreement with fp32 torch matmuls, and the op contracts (opcheck)."""

import pytest
import torch

from seeded import randn

K, N = 100, 48  # K is not a multiple of the 8 accumulation lanes, so the tail path runs too
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Tolerances against the fp32 torch reference rounded to the output dtype: the summation orders
# differ, so the fp32 values differ by a few ulps and the one downcast may land one ulp apart.
TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-4),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
}
FP32_TOL = TOL[torch.float32]


def embed(rows, offset, total, seed):
    """A batch of `total` random rows with `rows` placed at index `offset`."""
    big = randn(total, rows.shape[1], dtype=rows.dtype, seed=seed)
    big[offset:offset + rows.shape[0]] = rows
    return big


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 3, 7, 64, 257])
def test_rows_do_not_depend_on_the_batch(rl_ops, dtype, m):
    x = randn(m, K, dtype=dtype, seed=1)
    w = randn(N, K, dtype=dtype, seed=2)
    bias = randn(N, dtype=dtype, seed=3)
    dy = randn(m, N, dtype=dtype, seed=4)
    y_alone = rl_ops.det_gemm(x, w, bias)
    dx_alone = rl_ops.det_gemm_grad_input(dy, w)
    for offset in (0, 200):
        total = offset + m + 43
        y = rl_ops.det_gemm(embed(x, offset, total, seed=5), w, bias)
        dx = rl_ops.det_gemm_grad_input(embed(dy, offset, total, seed=6), w)
        assert torch.equal(y[offset:offset + m], y_alone), (m, offset)
        assert torch.equal(dx[offset:offset + m], dx_alone), (m, offset)


def test_row_at_index_0_equals_row_at_index_200(rl_ops):
    w = randn(N, K, seed=2)
    x = randn(300, K, seed=1)
    x[200] = x[0]
    y = rl_ops.det_gemm(x, w, None)
    assert torch.equal(y[200], y[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_forward_matches_fp32_matmul(rl_ops, dtype, with_bias):
    x = randn(257, K, dtype=dtype, seed=1)
    w = randn(N, K, dtype=dtype, seed=2)
    bias = randn(N, dtype=dtype, seed=3) if with_bias else None
    y = rl_ops.det_gemm(x, w, bias)
    ref = x.float() @ w.float().T
    if with_bias:
        ref = ref + bias.float()
    assert y.dtype == dtype and y.shape == (257, N)
    torch.testing.assert_close(y, ref.to(dtype), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_grads_match_fp32_matmuls(rl_ops, dtype):
    x = randn(257, K, dtype=dtype, seed=1)
    w = randn(N, K, dtype=dtype, seed=2)
    dy = randn(257, N, dtype=dtype, seed=4)
    dx = rl_ops.det_gemm_grad_input(dy, w)
    dw = rl_ops.det_gemm_grad_weight(dy, x)
    assert dx.dtype == dtype and dw.dtype == torch.float32
    torch.testing.assert_close(dx, (dy.float() @ w.float()).to(dtype), **TOL[dtype])
    torch.testing.assert_close(dw, dy.float().T @ x.float(), **FP32_TOL)


def test_grads_match_autograd_of_linear(rl_ops):
    x = randn(64, K, seed=1).requires_grad_()
    w = randn(N, K, seed=2).requires_grad_()
    bias = randn(N, seed=3)
    dy = randn(64, N, seed=4)
    torch.nn.functional.linear(x, w, bias).backward(dy)
    with torch.no_grad():
        y = rl_ops.det_gemm(x, w, bias)
        torch.testing.assert_close(y, torch.nn.functional.linear(x, w, bias), **FP32_TOL)
        torch.testing.assert_close(rl_ops.det_gemm_grad_input(dy, w), x.grad, **FP32_TOL)
        torch.testing.assert_close(rl_ops.det_gemm_grad_weight(dy, x), w.grad, **FP32_TOL)


def test_leading_dims_are_rows(rl_ops):
    x = randn(3, 5, K, dtype=torch.bfloat16, seed=1)
    w = randn(N, K, dtype=torch.bfloat16, seed=2)
    dy = randn(3, 5, N, dtype=torch.bfloat16, seed=4)
    assert torch.equal(rl_ops.det_gemm(x, w, None),
                       rl_ops.det_gemm(x.reshape(15, K), w, None).reshape(3, 5, N))
    assert torch.equal(rl_ops.det_gemm_grad_input(dy, w),
                       rl_ops.det_gemm_grad_input(dy.reshape(15, N), w).reshape(3, 5, K))
    assert torch.equal(rl_ops.det_gemm_grad_weight(dy, x),
                       rl_ops.det_gemm_grad_weight(dy.reshape(15, N), x.reshape(15, K)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_threads_do_not_change_bits(rl_ops, with_threads, dtype):
    x = randn(64, K, dtype=dtype, seed=1)
    w = randn(N, K, dtype=dtype, seed=2)
    bias = randn(N, dtype=dtype, seed=3)
    dy = randn(64, N, dtype=dtype, seed=4)

    def run():
        return (rl_ops.det_gemm(x, w, bias), rl_ops.det_gemm_grad_input(dy, w),
                rl_ops.det_gemm_grad_weight(dy, x))

    one, two = with_threads(1, run), with_threads(2, run)
    for a, b in zip(one, two):
        assert torch.equal(a, b)


def test_opcheck(rl_ops):
    x = randn(7, K, dtype=torch.bfloat16, seed=1)
    w = randn(N, K, dtype=torch.bfloat16, seed=2)
    bias = randn(N, dtype=torch.bfloat16, seed=3)
    dy = randn(7, N, dtype=torch.bfloat16, seed=4)
    torch.library.opcheck(rl_ops.det_gemm.default, (x, w, bias))
    torch.library.opcheck(rl_ops.det_gemm.default, (x, w, None))
    torch.library.opcheck(rl_ops.det_gemm_grad_input.default, (dy, w))
    torch.library.opcheck(rl_ops.det_gemm_grad_weight.default, (dy, x))
