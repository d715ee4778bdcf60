"""Autograd through the Python wrappers of rl_engine/ops: in fp32 the gradients of every R wrapper
match torch autograd of its production twin, two runs give the same gradient bits, and
torch.library.opcheck passes on each differentiable op with inputs that require grad, so that its
autograd registration and AOT-dispatch sub-tests really run a backward."""

import pytest
import torch

from rl_engine.ops import attention, linear, logp, norm, rope, swiglu
from seeded import randn

HQ, HKV, D = 8, 4, 64
EPS = 1e-6
THETA = 1_000_000.0
# fp32 on both sides: the R kernels and torch sum in different orders, so results agree to a few
# ulps of the largest term; nothing else separates them.
TOL = dict(rtol=1e-5, atol=1e-5)
OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor",
                 "test_aot_dispatch_dynamic")


def leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def grads(fn, inputs, seed=99):
    """Gradients of sum(fn(*inputs) * g) for a fixed random g, with fresh leaves each call."""
    xs = leaves(*inputs)
    out = fn(*xs)
    g = randn(*out.shape, seed=seed, dtype=out.dtype)
    return torch.autograd.grad(out, xs, g)


def check(r_fn, p_fn, inputs):
    r = grads(r_fn, inputs)
    p = grads(p_fn, inputs)
    for got, want in zip(r, p):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, **TOL)
    again = grads(r_fn, inputs)
    assert all(torch.equal(a, b) for a, b in zip(r, again)), "gradient bits changed between runs"


@pytest.mark.parametrize("with_bias", [False, True])
def test_det_linear_grads(with_bias):
    # Leading dims [2, 19] are flattened to rows; K = 100 leaves a tail after the 8-wide lanes.
    x, w, b = randn(2, 19, 100, seed=1), randn(48, 100, seed=2, scale=0.1), randn(48, seed=3)
    if with_bias:
        check(linear.det_linear, linear.production_linear, (x, w, b))
    else:
        check(lambda x, w: linear.det_linear(x, w), lambda x, w: linear.production_linear(x, w),
              (x, w))


def test_det_rmsnorm_grads():
    x, w = randn(3, 11, 256, seed=4), randn(256, seed=5)
    check(lambda x, w: norm.det_rmsnorm(x, w, EPS), lambda x, w: norm.production_rmsnorm(x, w, EPS),
          (x, w))


def test_det_rope_grads():
    x = randn(37, HQ, D, seed=6)
    pos = torch.randint(0, 40_000, (37,), generator=torch.Generator().manual_seed(7))
    # Positions up to 4e4 check that the backward rotates by the same absolute angles.
    check(lambda x: rope.det_rope(x, pos, THETA), lambda x: rope.production_rope(x, pos, THETA),
          (x,))


def test_det_swiglu_grads():
    # Gates out to +-12 cover silu's saturated tails as well as its curved middle.
    check(swiglu.det_swiglu, swiglu.production_swiglu, (randn(29, 2 * 96, seed=8, scale=4.0),))


def packed(lens, seed=10):
    t = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    pos = torch.cat([torch.arange(n) for n in lens])
    q, k, v = randn(t, HQ, D, seed=seed), randn(t, HKV, D, seed=seed + 1), randn(t, HKV, D, seed=seed + 2)
    return (q, k, v), (cu, cu.clone(), pos)


@pytest.mark.parametrize("block", [attention.kv_block_size(D), 16])
def test_det_attention_grads(block):
    # 70 spans two 64-key blocks (five 16-key ones) with a partial last block; 1 is a lone token.
    (q, k, v), (cu_q, cu_k, pos) = packed([70, 1, 33])
    scale = D ** -0.5
    check(lambda q, k, v: attention.det_attention(q, k, v, cu_q, cu_k, pos, scale, block)[0],
          lambda q, k, v: attention.production_attention(q, k, v, cu_q, cu_k, pos, scale),
          (q, k, v))


def test_det_attention_chunked_prefill_grads():
    """Queries 40..69 of a 70-token sequence against all 70 keys (a second prefill chunk): the
    gradient of keys that only earlier queries would see is exactly zero, as in SDPA."""
    (q, k, v), _ = packed([70], seed=20)
    q = q[40:]
    cu_q, cu_k = torch.tensor([0, 30], dtype=torch.int32), torch.tensor([0, 70], dtype=torch.int32)
    pos = torch.arange(40, 70)
    scale = D ** -0.5
    check(lambda q, k, v: attention.det_attention(q, k, v, cu_q, cu_k, pos, scale)[0],
          lambda q, k, v: attention.production_attention(q, k, v, cu_q, cu_k, pos, scale),
          (q, k, v))


@pytest.mark.parametrize("vocab", [1000, 1024])
def test_det_selected_logp_grads(vocab):
    # 1000 is not a whole number of 256-id tiles, so the padded tile of the tree is exercised.
    hidden, weight = randn(40, 64, seed=11), randn(vocab, 64, seed=12, scale=0.3)
    target = torch.randint(0, vocab, (40,), generator=torch.Generator().manual_seed(13))
    check(lambda h, w: logp.det_selected_logp(h, w, target),
          lambda h, w: logp.production_selected_logp(h, w, target), (hidden, weight))


def opcheck_cases():
    bf16 = torch.bfloat16
    (q, k, v), (cu_q, cu_k, pos) = packed([6, 11], seed=30)
    rope_pos = torch.tensor([0, 5, 9, 40_000, 3])
    return {
        "det_gemm": ("det_gemm", [(randn(5, 16, seed=1), randn(8, 16, seed=2), randn(8, seed=3)),
                                  (randn(2, 5, 16, seed=1, dtype=bf16), randn(8, 16, seed=2), None)],
                     {1}),
        "rmsnorm": ("rmsnorm", [(randn(5, 16, seed=4), randn(16, seed=5), EPS)], set()),
        "rope": ("rope", [(randn(5, 2, 16, seed=6), rope_pos, THETA),
                          (randn(5, 2, 16, seed=6, dtype=bf16), rope_pos, THETA)], set()),
        "swiglu": ("swiglu", [(randn(5, 32, seed=7),), (randn(5, 32, seed=7, dtype=bf16),)], set()),
        "attention_fwd": ("attention_fwd", [(q, k, v, cu_q, cu_k, pos, D ** -0.5, 8),
                                            (q.to(bf16), k.to(bf16), v.to(bf16), cu_q, cu_k, pos,
                                             D ** -0.5, 8)], {1}),
    }


@pytest.mark.parametrize("name", list(opcheck_cases()))
def test_opcheck_with_autograd(rl_ops, name):
    """Float tensor inputs require grad (indices in `frozen` only in the second, mixed-dtype case,
    so a frozen weight or key is covered too)."""
    op_name, arg_sets, frozen = opcheck_cases()[name]
    op = getattr(rl_ops, op_name).default
    for n, args in enumerate(arg_sets):
        args = tuple(
            a.requires_grad_(not (n == 1 and i in frozen))
            if isinstance(a, torch.Tensor) and a.is_floating_point() else a
            for i, a in enumerate(args))
        assert any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
        torch.library.opcheck(op, args, test_utils=OPCHECK_TESTS)


def test_ops_carry_an_autograd_kernel(rl_ops):
    """The wrapper modules register a real backward: a requires-grad output's grad_fn runs our
    backward op, not the not-implemented fallback that would return None gradients."""
    for op in ("det_gemm", "rmsnorm", "rope", "swiglu", "attention_fwd"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"rl_engine::{op}", "Autograd"), op
    x, w = leaves(randn(3, 4, seed=1))[0], randn(5, 4, seed=2)
    (gx,) = torch.autograd.grad(rl_ops.det_gemm(x, w, None).sum(), (x,), allow_unused=True)
    assert gx is not None
    torch.testing.assert_close(gx, w.sum(0).expand(3, 4), **TOL)
