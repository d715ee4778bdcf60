"""rmsnorm, rope and swiglu (forward and backward) on the CPU: agreement with plain torch (rope:
the Hugging Face Qwen3 formula) and with torch autograd, bitwise batch invariance, rope's
dependence on absolute position only, bitwise thread invariance, and the op contracts."""

import pytest
import torch
import torch.nn.functional as F

from seeded import randn

H = 100  # not a multiple of the 8 accumulation lanes, so the tail path runs too
HEADS, D = 3, 64
INTER = 40
EPS = 1e-6
THETA = 1_000_000.0
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Against fp32 torch rounded to the output dtype: reduction orders and libm cos/sin/exp differ
# by a few fp32 ulps, so the one downcast may land one ulp apart.
TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
}
FP32_TOL = TOL[torch.float32]


# Plain-torch references, in fp32.
def rmsnorm_ref(x, w):
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
    return x * rstd * w, rstd[..., 0]


def rope_ref(x, positions):
    """Qwen3RotaryEmbedding.forward + apply_rotary_pos_emb of Hugging Face, in fp32."""
    inv_freq = 1.0 / (THETA ** (torch.arange(0, D, 2, dtype=torch.float) / D))
    freqs = positions[:, None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
    rotated = torch.cat((-x[..., D // 2:], x[..., :D // 2]), dim=-1)
    return x * cos + rotated * sin


def swiglu_ref(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def positions_for(t, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 40_000, (t,), generator=g)


# Forward and backward against the references.
@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_matches_torch(rl_ops, dtype):
    x, w = randn(33, H, dtype=dtype, seed=1), randn(H, dtype=dtype, seed=2)
    out, rstd = rl_ops.rmsnorm(x, w, EPS)
    ref, ref_rstd = rmsnorm_ref(x.float(), w.float())
    assert out.dtype == dtype and rstd.dtype == torch.float32 and rstd.shape == (33,)
    torch.testing.assert_close(out, ref.to(dtype), **TOL[dtype])
    torch.testing.assert_close(rstd, ref_rstd, **FP32_TOL)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_backward_matches_autograd(rl_ops, dtype):
    x, w = randn(33, H, dtype=dtype, seed=1), randn(H, dtype=dtype, seed=2)
    g = randn(33, H, dtype=dtype, seed=3)
    xf, wf = x.float().requires_grad_(), w.float().requires_grad_()
    rmsnorm_ref(xf, wf)[0].backward(g.float())
    _, rstd = rl_ops.rmsnorm(x, w, EPS)
    dx, dw = rl_ops.rmsnorm_backward(g, x, w, rstd)
    assert dx.dtype == dtype and dw.dtype == torch.float32 and dw.shape == (H,)
    torch.testing.assert_close(dx, xf.grad.to(dtype), **TOL[dtype])
    torch.testing.assert_close(dw, wf.grad, rtol=1e-5, atol=1e-4)


def test_rmsnorm_qk_norm_shape(rl_ops):
    """q/k norm: x [T, heads, D] with weight [D] normalises each head, as rows."""
    x, w = randn(5, HEADS, D, dtype=torch.bfloat16, seed=1), randn(D, dtype=torch.bfloat16, seed=2)
    g = randn(5, HEADS, D, dtype=torch.bfloat16, seed=3)
    out, rstd = rl_ops.rmsnorm(x, w, EPS)
    flat_out, flat_rstd = rl_ops.rmsnorm(x.reshape(-1, D), w, EPS)
    assert rstd.shape == (5, HEADS)
    assert torch.equal(out, flat_out.reshape(5, HEADS, D)) and torch.equal(rstd.reshape(-1), flat_rstd)
    dx, dw = rl_ops.rmsnorm_backward(g, x, w, rstd)
    flat_dx, flat_dw = rl_ops.rmsnorm_backward(g.reshape(-1, D), x.reshape(-1, D), w, flat_rstd)
    assert torch.equal(dx, flat_dx.reshape(5, HEADS, D)) and torch.equal(dw, flat_dw)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_matches_hf_formula(rl_ops, dtype):
    x, pos = randn(33, HEADS, D, dtype=dtype, seed=1), positions_for(33)
    out = rl_ops.rope(x, pos, THETA)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out, rope_ref(x.float(), pos).to(dtype), **TOL[dtype])


def test_rope_matches_transformers_qwen3(rl_ops):
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    x, pos = randn(17, HEADS, D, seed=1), positions_for(17)
    inv_freq = 1.0 / (THETA ** (torch.arange(0, D, 2, dtype=torch.float) / D))
    emb = torch.cat([pos[:, None].float() * inv_freq] * 2, dim=-1)
    q, _ = apply_rotary_pos_emb(x, x, emb.cos(), emb.sin(), unsqueeze_dim=1)
    torch.testing.assert_close(rl_ops.rope(x, pos, THETA), q, **FP32_TOL)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_backward_matches_autograd(rl_ops, dtype):
    x, g = randn(33, HEADS, D, dtype=dtype, seed=1), randn(33, HEADS, D, dtype=dtype, seed=2)
    pos = positions_for(33)
    xf = x.float().requires_grad_()
    rope_ref(xf, pos).backward(g.float())
    dx = rl_ops.rope_backward(g, pos, THETA)
    assert dx.dtype == dtype
    torch.testing.assert_close(dx, xf.grad.to(dtype), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_matches_torch(rl_ops, dtype):
    gu = randn(33, 2 * INTER, dtype=dtype, seed=1) * 3
    out = rl_ops.swiglu(gu)
    assert out.dtype == dtype and out.shape == (33, INTER)
    torch.testing.assert_close(out, swiglu_ref(gu.float()).to(dtype), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_backward_matches_autograd(rl_ops, dtype):
    gu, g = randn(33, 2 * INTER, dtype=dtype, seed=1) * 3, randn(33, INTER, dtype=dtype, seed=2)
    guf = gu.float().requires_grad_()
    swiglu_ref(guf).backward(g.float())
    dgu = rl_ops.swiglu_backward(g, gu)
    assert dgu.dtype == dtype and dgu.shape == gu.shape
    torch.testing.assert_close(dgu, guf.grad.to(dtype), **TOL[dtype])


def test_swiglu_saturates_without_nan(rl_ops):
    gu = torch.tensor([[-200.0, 0.0, 200.0, 1.0, 1.0, 1.0]])
    out, dgu = rl_ops.swiglu(gu), rl_ops.swiglu_backward(torch.ones(1, 3), gu)
    assert torch.equal(out, torch.tensor([[0.0, 0.0, 200.0]]))
    assert torch.isfinite(dgu).all()


# Bitwise invariance.
def row_inputs(dtype, t, seed):
    """The per-row inputs of every row-wise op, t rows each."""
    return {"x": randn(t, H, dtype=dtype, seed=seed), "g": randn(t, H, dtype=dtype, seed=seed + 1),
            "q": randn(t, HEADS, D, dtype=dtype, seed=seed + 2), "pos": positions_for(t, seed=seed + 3),
            "gu": randn(t, 2 * INTER, dtype=dtype, seed=seed + 4),
            "dy": randn(t, INTER, dtype=dtype, seed=seed + 5)}


def run_row_ops(rl_ops, w, inp):
    """Every row-wise output, and rmsnorm's grad_weight (a sum over rows, so not row-wise)."""
    out, rstd = rl_ops.rmsnorm(inp["x"], w, EPS)
    dx, dw = rl_ops.rmsnorm_backward(inp["g"], inp["x"], w, rstd)
    rows = {"rmsnorm": out, "rstd": rstd, "rmsnorm_dx": dx,
            "rope": rl_ops.rope(inp["q"], inp["pos"], THETA),
            "rope_backward": rl_ops.rope_backward(inp["q"], inp["pos"], THETA),
            "swiglu": rl_ops.swiglu(inp["gu"]),
            "swiglu_backward": rl_ops.swiglu_backward(inp["dy"], inp["gu"])}
    return rows, dw


def place(rows, offset, filler):
    """The bigger batch `filler` with `rows` written at index `offset`."""
    out = filler.clone()
    out[offset:offset + rows.shape[0]] = rows
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 3, 64])
def test_rows_do_not_depend_on_the_batch(rl_ops, dtype, t):
    w = randn(H, dtype=dtype, seed=99)
    alone = row_inputs(dtype, t, seed=1)
    expected, _ = run_row_ops(rl_ops, w, alone)
    for offset in (0, 200):
        filler = row_inputs(dtype, offset + t + 29, seed=11)
        got, _ = run_row_ops(rl_ops, w, {k: place(v, offset, filler[k]) for k, v in alone.items()})
        for name, value in expected.items():
            assert torch.equal(got[name][offset:offset + t], value), (name, t, offset)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_depends_only_on_absolute_position(rl_ops, dtype):
    token = randn(1, HEADS, D, dtype=dtype, seed=1)
    p = 1234
    batch_a = randn(8, HEADS, D, dtype=dtype, seed=2)
    batch_a[0] = token[0]
    pos_a = torch.arange(p, p + 8)  # the token opens a sequence chunk at position p
    batch_b = randn(240, HEADS, D, dtype=dtype, seed=3)
    batch_b[200] = token[0]
    pos_b = positions_for(240, seed=4)
    pos_b[200] = p  # the same token, deep in a batch of unrelated sequences
    alone = rl_ops.rope(token, torch.tensor([p]), THETA)
    assert torch.equal(rl_ops.rope(batch_a, pos_a, THETA)[0], alone[0])
    assert torch.equal(rl_ops.rope(batch_b, pos_b, THETA)[200], alone[0])
    assert torch.equal(rl_ops.rope_backward(batch_b, pos_b, THETA)[200],
                       rl_ops.rope_backward(token, torch.tensor([p]), THETA)[0])
    # and the position does matter: the same token one step later rotates differently
    assert not torch.equal(rl_ops.rope(token, torch.tensor([p + 1]), THETA), alone)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_threads_do_not_change_bits(rl_ops, with_threads, dtype):
    w, inputs = randn(H, dtype=dtype, seed=99), row_inputs(dtype, 64, seed=1)
    one, dw_one = with_threads(1, lambda: run_row_ops(rl_ops, w, inputs))
    two, dw_two = with_threads(2, lambda: run_row_ops(rl_ops, w, inputs))
    for name in one:
        assert torch.equal(one[name], two[name]), name
    assert torch.equal(dw_one, dw_two)


def test_opcheck(rl_ops):
    dtype = torch.bfloat16
    x, w = randn(7, H, dtype=dtype, seed=1), randn(H, dtype=dtype, seed=2)
    g = randn(7, H, dtype=dtype, seed=3)
    _, rstd = rl_ops.rmsnorm(x, w, EPS)
    q, pos = randn(7, HEADS, D, dtype=dtype, seed=4), positions_for(7)
    gu, dy = randn(7, 2 * INTER, dtype=dtype, seed=5), randn(7, INTER, dtype=dtype, seed=6)
    torch.library.opcheck(rl_ops.rmsnorm.default, (x, w, EPS))
    torch.library.opcheck(rl_ops.rmsnorm_backward.default, (g, x, w, rstd))
    torch.library.opcheck(rl_ops.rope.default, (q, pos, THETA))
    torch.library.opcheck(rl_ops.rope_backward.default, (q, pos, THETA))
    torch.library.opcheck(rl_ops.swiglu.default, (gu,))
    torch.library.opcheck(rl_ops.swiglu_backward.default, (dy, gu))
