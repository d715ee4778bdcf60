"""The Hopper (sm_90a) kernels: bitwise batch invariance (torch.equal across batch sizes, row
positions and vocab splits), agreement with plain-torch references in float64 within stated
tolerances, launch counters, and the op contracts (opcheck). Skipped without a Hopper GPU."""

import functools
import math

import pytest
import torch
import torch.nn.functional as F

import seeded

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not HOPPER, reason="needs a Hopper (sm_90) CUDA GPU")]

DEV = "cuda"
# Relative Frobenius error against float64 references. bf16/fp16 outputs carry one rounding
# (2^-9 / 2^-12 relative); fp32 outputs only differ by summation order.
REL = {torch.bfloat16: 6e-3, torch.float16: 1e-3, torch.float32: 1e-5}


@pytest.fixture
def ops(rl_ops):
    assert rl_ops.det_gemm_sm90_compiled(), "the extension was built without its sm_90a kernels"
    return rl_ops


randn = functools.partial(seeded.randn, dtype=torch.bfloat16, device=DEV)


def rel(out, ref):
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


# ---------------------------------------------------------------- det_gemm
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_det_gemm_rows_do_not_depend_on_batch_or_position(ops, dtype):
    k, n = 520, 1000  # K not a multiple of the 64-wide k step, N not of the 256-wide tile
    x, w, bias = randn(8192, k, dtype=dtype, seed=1), randn(n, k, dtype=dtype, seed=2), randn(n, seed=3)
    y = ops.det_gemm(x, w, None)
    for m in (1, 2, 3, 16, 64, 257, 1024, 4096, 8192):
        assert torch.equal(ops.det_gemm(x[:m], w, None), y[:m]), m
        assert torch.equal(ops.det_gemm(x[8192 - m:], w, None), y[8192 - m:]), m
    perm = torch.randperm(8192, device=DEV)
    assert torch.equal(ops.det_gemm(x[perm], w, None), y[perm])
    assert rel(y, x.double() @ w.double().T) < REL[dtype]
    yb = ops.det_gemm(x[:300], w, bias)
    assert rel(yb, x[:300].double() @ w.double().T + bias.double()) < REL[dtype]
    assert torch.equal(ops.det_gemm(x[5:6], w, bias), yb[5:6])


# With M x N over this grid, plan_det_gemm on a 132-SM H200 picks every tile and split placement
# it can pick at K = 1000 (enumerated over M <= 9000, N <= 40000): swapped slabs of 16 and 32
# weight rows by 8, 16, 32 and 64 tokens and of 64 rows by 8, 16 and 32 tokens (1, 2 or 4 CTAs an
# SM, M below the token width), 64 rows by 32, 64 and 128 columns, 128 rows by 32, 64, 128, 160,
# 192 and 256 columns; rows that start mid-tile too. Up to N = 3072 K is split (4 ranges at N =
# 1024, 2 from 2048): the ranges meet across CTAs at decode sizes and up to M = 256 where the tiles
# make less than a wave (on swapped slabs and on 64- and 128-row tiles: 32 x 64 slabs and 64 x 64
# tiles at N = 576, 128 x 64 at N = 584), and within a CTA elsewhere, on every tile that keeps a
# second accumulator (128 rows by 32 at M = 300, by 64 at 520, by 128 and 160; 64 rows by 32, and
# by 64 at N = 264). Not reachable here: 128 x 160 across CTAs (K of 2048 and more) and the 16-row
# slabs unsplit (only products that keep K in one range); test_det_gemm_every_plan_gives_the_same_bits
# runs those and every other plan directly.
GEMM_TILE_NS = (264, 576, 584, 1024, 2048, 2176, 2560, 4096, 4232, 8448, 16896, 16904, 33792)
GEMM_ROW_MS = (1, 2, 3, 4, 8, 16, 17, 32, 33, 40, 64, 65, 128, 129, 192, 256, 300, 520, 522, 1000, 1024,
               4096, 4097, 8192)


def test_det_gemm_every_tile_gives_the_same_bits(ops):
    k = 1000  # 16 K blocks, not a multiple of the 2 or 4 blocks a narrow tile's stage holds
    x, w = randn(8192, k, seed=11), randn(max(GEMM_TILE_NS), k, seed=12)
    for n in GEMM_TILE_NS:
        y = ops.det_gemm(x, w[:n], None)  # the large-M tiles; the order depends on N and K alone
        assert rel(y[:64], x[:64].double() @ w[:n].double().T) < REL[torch.bfloat16]
        for m in GEMM_ROW_MS:
            for off in sorted({0, 1, 8192 - m}):
                if off + m > 8192:
                    continue
                out = ops.det_gemm(x[off:off + m], w[:n], None)
                assert torch.equal(out, y[off:off + m]), (n, m, off)


# K in 4 ranges; in one; in 6 at an odd N (the range sums' single-column stores); in 4 at an N
# narrower than one 128 x 256 tile.
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n, k", [(1000, 1000), (4232, 520), (1001, 2600), (264, 1000)])
def test_det_gemm_every_plan_gives_the_same_bits(ops, n, k, dtype):
    """Every plan det_gemm could run (_det_gemm_plans: each tile, swapped up to M = 256, and where K
    is split the ranges meeting across CTAs or within them) gives det_gemm's rows, at token counts
    on both sides of each change of the tile choice, for rows that start mid-tile, so
    benchmarks/det_gemm_plans.py may time them all and the tile choice may take any of them."""
    x, w = randn(1100, k, dtype=dtype, seed=13), randn(n, k, dtype=dtype, seed=14)
    y = ops.det_gemm(x, w, None)
    split = gemm_split(n, k)[0] > 1
    for m in (1, 3, 17, 40, 64, 100, 129, 256, 1000):
        off = 1100 - m - 5  # five rows short of the end: no tile starts at the first row
        xm = x[off:off + m]
        flat = ops._det_gemm_plans(xm, w)
        plans = [tuple(flat[i:i + 4]) for i in range(0, len(flat), 4)]
        assert len(set(plans)) == len(plans) == 9 + 3 * (m <= 256) + 6 * split, (m, plans)
        for plan in plans:
            assert torch.equal(ops._det_gemm_on_plan(xm, w, list(plan)), y[off:off + m]), (m, plan)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_det_gemm_zero_rows_keep_their_sign_on_every_plan(ops, dtype):
    """Rows of x that are all +0 or all -0 against a weight of both signs make every product a signed
    zero, and a plan that started a K range or added the ranges otherwise (from d = a . b rather
    than a zeroed accumulator, or -0 range sums added without a +0) would give -0 where another
    gives +0. Every plan must give the pick's bits, compared as integers (torch.equal takes -0 for
    +0). K in 5 and in 6 ranges."""
    for n, k in ((1024, 2560), (1000, 4096)):
        x, w = randn(1100, k, dtype=dtype, seed=15), randn(n, k, dtype=dtype, seed=16)
        x[::3] = 0.0
        x[1::3] = -0.0
        assert torch.signbit(x[1::3]).all() and not torch.signbit(x[::3]).any()
        y = ops.det_gemm(x, w, None)
        assert not y[::3].any() and not y[1::3].any()
        for m in (40, 256, 300, 1000):
            xm = x[:m]
            flat = ops._det_gemm_plans(xm, w)
            plans = [tuple(flat[i:i + 4]) for i in range(0, len(flat), 4)]
            for plan in plans:
                out = ops._det_gemm_on_plan(xm, w, list(plan))
                assert torch.equal(out.view(torch.int16), y[:m].view(torch.int16)), (n, k, m, plan)


def test_det_gemm_on_plan_refuses_what_it_cannot_run(ops):
    x, w = randn(4, 64), randn(4096, 64)
    with pytest.raises(RuntimeError, match=r"not a plan of x .*take one that _det_gemm_plans lists"):
        ops._det_gemm_on_plan(x, w, [64, 128, 0, 1])  # K in one range: nothing meets across CTAs
    with pytest.raises(RuntimeError, match=r"plan is \[bm, bn, swapped, across\]"):
        ops._det_gemm_on_plan(x, w, [64, 128])
    with pytest.raises(RuntimeError, match="bf16 or fp16 x and w of one dtype"):
        ops._det_gemm_plans(x.float(), w.float())


def gemm_split(n, k):
    """choose_gemm_split of det_gemm.cuh: the K ranges' count and length (in K elements). Up to
    N = 3072, about 6144 / N ranges (at most 8) of whole 256-wide units; wider N, one range."""
    units = -(-k // 256)
    want = min(1 if n > 3072 else -(-6144 // n), 8, units)
    per = -(-units // want)
    return -(-units // per), 256 * per


# K in 6 ranges (5 of 768, then 256); 3 (1024, 1024, 552); 3 (256, 256, 8); 6 at an odd N (the
# workspace's single-column stores); 8.
@pytest.mark.parametrize("n, k", [(1024, 4096), (2560, 2600), (1000, 520), (1001, 2600), (640, 4096)])
def test_det_gemm_adds_its_k_ranges_in_order(ops, n, k):
    """Every row of det_gemm is its K ranges' sums added in range order, then rounded once: the
    same bits whether the ranges meet across CTAs (small M) or in one CTA (large M). Each range's
    sum is taken from det_gemm_grad_weight (fp32 out) on a 4096-row weight, whose K is one range."""
    splits, span = gemm_split(n, k)
    assert splits > 1
    x, w, bias = randn(8192, k, seed=31), randn(n, k, seed=32), randn(n, seed=33)
    wide = torch.cat([w, torch.zeros(4096 - n, k, dtype=w.dtype, device=DEV)])
    total = None
    for s in range(splits):
        ks = slice(s * span, min(k, (s + 1) * span))
        part = ops.det_gemm_grad_weight(x[:, ks].T, wide[:, ks].T)[:, :n]  # [8192, n] fp32
        total = part if total is None else total + part
    y = ops.det_gemm(x, w, None)
    assert torch.equal(y, total.to(torch.bfloat16))
    for m in (1, 3, 8, 17, 32, 64, 256, 1000, 4097):
        for off in (0, 8192 - m):
            assert torch.equal(ops.det_gemm(x[off:off + m], w, None), y[off:off + m]), (m, off)
    assert torch.equal(ops.det_gemm(x[:300], w, bias), (total[:300] + bias.float()).to(torch.bfloat16))
    assert rel(y, x.double() @ w.double().T) < REL[torch.bfloat16]


def test_det_gemm_reads_its_inputs_only_once_they_are_written(ops):
    """A det_gemm launch may start while the kernel before it still runs (programmatic dependent
    launch) and must wait for it before touching memory. Chains in which every GEMM reads the
    output of the kernel just before it (another det_gemm, or a torch kernel), launched back to back
    and replayed from a CUDA graph, give the bits of the same chain with a synchronize between
    calls."""
    def chain(x, sync):
        outs = []
        for i in range(24):
            x = ops.det_gemm(x if i % 3 else x.neg(), w, None)
            outs.append(x)
            if sync:
                torch.cuda.synchronize()
        return outs

    # At N = 1024 (K in 4 ranges): swapped weight-stream tiles at 3 tokens (they let the next
    # launch in early) and 64 x 32 tiles at 64, each writing range sums that one more kernel adds
    # up; 128 x 64 tiles that add their own ranges at 1024. At N = 4096 (one range): swapped tiles
    # at 3 tokens that let the next GEMM in early, 64 x 128 tiles at 256.
    for n, m in ((1024, 3), (1024, 64), (1024, 1024), (4096, 3), (4096, 256)):
        w = randn(n, n, scale=n ** -0.5, seed=21)
        x = randn(m, n, seed=22)
        ref = chain(x, sync=True)
        assert all(torch.equal(a, b) for a, b in zip(chain(x, sync=False), ref)), (n, m)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            chain(x, sync=False)  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = chain(x, sync=False)
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(outs, ref)), (n, m)


def pitched(t, extra=1):
    """t's values in rows one element longer: transposed views of it are not 16-byte aligned, so the
    backward products read them through a transposed copy instead of in place."""
    buf = torch.empty(t.shape[0], t.shape[1] + extra, dtype=t.dtype, device=t.device)
    return buf[:, :t.shape[1]].copy_(t)


def test_det_gemm_backward_reads_transposed_operands_with_the_same_bits(ops):
    """The backward products pass transposed views; the 128- and 256-column tiles read them in place
    (MN-major), every other tile through a transposed copy. Over every tile the choice can make,
    the two must give the bits of det_gemm on K-major copies. K = 1000 is not a multiple of the
    64-wide K block, so the zero fill past K is in play too."""
    red = 1000
    w = randn(red, max(GEMM_TILE_NS), seed=13)  # [N, K] of the forward: dx = dy . w
    wt = w.t().contiguous()
    dy = randn(8192, red, seed=14)
    for n in GEMM_TILE_NS:
        for m in GEMM_ROW_MS:
            for off in sorted({0, 8192 - m}):
                dx = ops.det_gemm_grad_input(dy[off:off + m], w[:, :n])
                assert torch.equal(dx, ops.det_gemm(dy[off:off + m], wt[:n], None)), (n, m, off)
    wp = pitched(w[:, :4096])
    assert torch.equal(ops.det_gemm_grad_input(dy, wp), ops.det_gemm_grad_input(dy, w[:, :4096]))
    # dw = dy^T x: the GEMM's rows are dy's columns and its columns x's, each a transposed view.
    for rows, n, k in ((red, 4096, 4096), (red, 1024, 8448), (red, 8448, 1024), (4097, 2560, 2560),
                       (red, 640, 256), (64, 200, 4096)):
        g, x = randn(rows, n, seed=15), randn(rows, k, seed=16)
        dw = ops.det_gemm_grad_weight(g, x)
        assert torch.equal(dw, ops.det_gemm_grad_weight(pitched(g), pitched(x))), (rows, n, k)
        assert torch.equal(dw[:64], ops.det_gemm_grad_weight(g[:, :64], x)), (rows, n, k)
    assert rel(dw, g.double().T @ x.double()) < 1e-5


def test_det_gemm_fp32_path_is_invariant_and_exact(ops):
    x, w = randn(300, 70, dtype=torch.float32, seed=4), randn(90, 70, dtype=torch.float32, seed=5)
    y = ops.det_gemm(x, w, None)
    for m in (1, 3, 64, 257):
        assert torch.equal(ops.det_gemm(x[:m], w, None), y[:m])
    assert rel(y, x.double() @ w.double().T) < REL[torch.float32]


def test_det_gemm_backward_products(ops):
    m, n, k = 1027, 776, 264
    x, w, dy = randn(m, k, seed=6), randn(n, k, seed=7), randn(m, n, seed=8)
    dx = ops.det_gemm_grad_input(dy, w)
    assert rel(dx, dy.double() @ w.double()) < REL[torch.bfloat16]
    for rows in (1, 3, 64, 1000):
        assert torch.equal(ops.det_gemm_grad_input(dy[:rows], w), dx[:rows])
        assert torch.equal(ops.det_gemm_grad_input(dy[m - rows:], w), dx[m - rows:])
    dw = ops.det_gemm_grad_weight(dy, x)
    assert dw.dtype == torch.float32
    assert rel(dw, dy.double().T @ x.double()) < 1e-5  # exact bf16 products, fp32 sums
    assert torch.equal(ops.det_gemm_grad_weight(dy, x), dw)
    ones = torch.ones(m, 1, dtype=torch.bfloat16, device=DEV)  # the bias gradient of ops.linear
    assert rel(ops.det_gemm_grad_weight(dy, ones)[:, 0], dy.double().sum(0)) < 1e-5


# ---------------------------------------------------------------- rmsnorm / rope / swiglu
@pytest.mark.parametrize("h", [128, 768, 1001, 4096, 5120])
def test_rmsnorm_forward_and_backward(ops, h):
    rows, eps = 777, 1e-6
    x, w, g = randn(rows, h, seed=9), randn(h, seed=10), randn(rows, h, seed=11)
    out, rstd = ops.rmsnorm(x, w, eps)
    xd = x.double().requires_grad_()
    ref = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * w.double()
    assert rel(out, ref) < REL[torch.bfloat16]
    assert rel(rstd, torch.rsqrt(x.double().pow(2).mean(-1) + eps)) < 2e-6
    for m in (1, 3, 100):
        o2, r2 = ops.rmsnorm(x[rows - m:], w, eps)
        assert torch.equal(o2, out[rows - m:]) and torch.equal(r2, rstd[rows - m:])
    dx, dw = ops.rmsnorm_backward(g, x, w, rstd)
    wd = w.double().requires_grad_()
    ref = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * wd
    ref_dx, ref_dw = torch.autograd.grad(ref, (xd, wd), g.double())
    assert rel(dx, ref_dx) < 1e-2 and rel(dw, ref_dw) < 1e-4
    assert torch.equal(ops.rmsnorm_backward(g[:5], x[:5], w, rstd[:5])[0], dx[:5])
    assert torch.equal(ops.rmsnorm_backward(g, x, w, rstd)[1], dw)


def fan_in(level, width=32):
    """One level of the column tree: each row adds `width` consecutive rows of `level` in order."""
    out = []
    for i in range(0, level.shape[0], width):
        s = torch.zeros_like(level[0])
        for row in level[i:i + width]:
            s = s + row
        out.append(s)
    return torch.stack(out)


# 17 rows are two chunks, one group each, in one level; 513 rows are 33 groups in two levels, the
# last of a single row; 16901 rows are 1057 chunks, two a group (16901 >= 2 x 8192): 529 groups in
# two levels; 40017 rows are 2502 chunks, four a group: 626 groups in three (626 -> 20 -> 1), the
# last group two chunks (one of a single row) and two empty ones, the upper levels added in place
# by the last block of each column slice. 1001 bf16 columns make one group a block (V = 1, G =
# 512); 1000 make eight (V = 8, G = 32), each with its own running sum. Both leave the last column
# slice of 128 partly empty.
@pytest.mark.parametrize("rows, subs, h", [(17, 1, 1001), (513, 1, 1001), (16901, 2, 1001),
                                           (40017, 4, 1001), (16901, 2, 1000), (40017, 4, 1000)])
def test_rmsnorm_grad_weight_is_the_fixed_chunk_tree(ops, rows, subs, h):
    """grad_weight sums each group's `subs` 16-row chunks in order, then adds the group partials
    32 at a time in order, level by level: the same tree built here from the op's own one-chunk
    grad_weights, bit for bit; grad_x is the one-chunk calls' rows. `subs` is rms_bwd_subs
    (rmsnorm.cuh): 1, 2 or 4 chunks a group, the most that leave 512 groups."""
    x, w, g = randn(rows, h, seed=21), randn(h, seed=22), randn(rows, h, seed=23)
    _, rstd = ops.rmsnorm(x, w, 1e-6)
    dx, dw = ops.rmsnorm_backward(g, x, w, rstd)
    chunks = [ops.rmsnorm_backward(g[c:c + 16], x[c:c + 16], w, rstd[c:c + 16]) for c in range(0, rows, 16)]
    assert torch.equal(dx, torch.cat([c[0] for c in chunks]))
    ref = torch.stack([c[1] for c in chunks])
    if subs > 1:
        ref = fan_in(ref, subs)
    ref = fan_in(ref)
    while ref.shape[0] > 1:
        ref = fan_in(ref)
    assert torch.equal(dw, ref[0])


def rope_reference(x, pos, theta, sign=1.0):
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=DEV).float() / d))
    ang = (pos.float()[:, None] * inv[None]).double()  # the fp32 angle, then exact trigonometry
    c, s = ang.cos()[:, None], sign * ang.sin()[:, None]
    x1, x2 = x.double()[..., : d // 2], x.double()[..., d // 2:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)


@pytest.mark.parametrize("d", [128, 64, 6])
def test_rope_forward_and_backward(ops, d):
    t, heads, theta = 513, 12, 1e6  # one full group of 8 heads and one partial group
    x = randn(t, heads, d, seed=12)
    pos = torch.randint(0, 40000, (t,), device=DEV)
    out = ops.rope(x, pos, theta)
    assert rel(out, rope_reference(x, pos, theta)) < REL[torch.bfloat16]
    perm = torch.randperm(t, device=DEV)
    assert torch.equal(ops.rope(x[perm], pos[perm], theta), out[perm])
    assert torch.equal(ops.rope(x[7:8], pos[7:8], theta), out[7:8])
    xf = x.float()
    back = ops.rope_backward(ops.rope(xf, pos, theta), pos, theta)
    assert rel(back, xf) < 1e-5
    assert rel(ops.rope_backward(x, pos, theta), rope_reference(x, pos, theta, -1.0)) < REL[torch.bfloat16]


@pytest.mark.parametrize("inter", [1536, 100, 7])
def test_swiglu_forward_and_backward(ops, inter):
    gu, dy = randn(301, 2 * inter, seed=13, scale=3.0), randn(301, inter, seed=14)
    out = ops.swiglu(gu)
    gd = gu.double().requires_grad_()
    ref = F.silu(gd[:, :inter]) * gd[:, inter:]
    assert rel(out, ref) < REL[torch.bfloat16]
    assert torch.equal(ops.swiglu(gu[300:]), out[300:])
    grad = ops.swiglu_backward(dy, gu)
    assert rel(grad, torch.autograd.grad(ref, gd, dy.double())[0]) < 1e-2
    assert torch.equal(ops.swiglu_backward(dy[:2], gu[:2]), grad[:2])


# ---------------------------------------------------------------- linear_logp
def logp_reference(hidden, weight, target):
    logits = hidden.double() @ weight.double().T
    return torch.log_softmax(logits, -1).gather(-1, target[:, None])[:, 0]


def split_logp(ops, hidden, weight, target, tile, world):
    v = weight.shape[0]
    total = 1 << max(0, math.ceil(math.log2(math.ceil(v / tile))))
    per = total // world
    parts = []
    for r in range(world):
        start = min(v, r * per * tile)
        stop = min(v, start + per * tile)
        parts.append(ops.linear_logp_partial(hidden, weight[start:stop], target, start, tile, per))
    return ops.logp_combine(*(torch.stack(p) for p in zip(*parts)))


@pytest.mark.parametrize("tile", [64, 128, 256, 512])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_linear_logp_splits_and_token_counts(ops, tile, dtype):
    t, h, v = 300, 256, 3000
    hidden, weight = randn(t, h, dtype=dtype, seed=15), randn(v, h, dtype=dtype, seed=16, scale=0.2)
    target = torch.randint(0, v, (t,), device=DEV)
    logp, lse = split_logp(ops, hidden, weight, target, tile, 1)
    assert (logp - logp_reference(hidden, weight, target)).abs().max().item() < 1e-4
    for world in (2, 4):
        lp, ls = split_logp(ops, hidden, weight, target, tile, world)
        assert torch.equal(lp, logp) and torch.equal(ls, lse), world
    for m in (1, 7, 128):
        lp, ls = split_logp(ops, hidden[t - m:], weight, target[t - m:], tile, 2)
        assert torch.equal(lp, logp[t - m:]) and torch.equal(ls, lse[t - m:]), m


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_linear_logp_backward(ops, dtype):
    t, h, v = 200, 64, 9003  # two vocab chunks of the backward, the second 811 ids (padded rows)
    hidden, weight = randn(t, h, dtype=dtype, seed=17), randn(v, h, dtype=dtype, seed=18, scale=0.3)
    target, grad = torch.randint(0, v, (t,), device=DEV), randn(t, dtype=torch.float32, seed=19)
    _, lse = split_logp(ops, hidden, weight, target, 256, 1)
    gh, gw = ops.linear_logp_backward(grad, hidden, weight, target, lse, 0)
    hd, wd = hidden.double().requires_grad_(), weight.double().requires_grad_()
    ref_h, ref_w = torch.autograd.grad((logp_reference(hd, wd, target) * grad.double()).sum(), (hd, wd))
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # 16-bit: dlogit is rounded once, as in production
    assert rel(gh, ref_h) < tol and rel(gw, ref_w) < tol
    gh2, gw2 = ops.linear_logp_backward(grad[:9], hidden[:9], weight, target[:9], lse[:9], 0)
    assert torch.equal(gh2, gh[:9])
    assert torch.equal(ops.linear_logp_backward(grad, hidden, weight, target, lse, 0)[1], gw)



def test_linear_logp_backward_of_vocab_shards(ops):
    """Each shard's backward (its vocab_start past 0, most targets in other shards) gives the
    unsplit call's grad_weight rows bit for bit; the shards' grad_hidden add up to the unsplit one.
    H = 523: rows that are no multiple of a tile, so grad_hidden's chunk adds reach the partial
    last column block."""
    t, h, v = 1000, 523, 20000  # shards of 5000 ids: a whole 8192-id chunk nowhere
    hidden, weight = randn(t, h, seed=26), randn(v, h, seed=27, scale=0.1)
    target, grad = torch.randint(0, v, (t,), device=DEV), randn(t, dtype=torch.float32, seed=28)
    _, lse = split_logp(ops, hidden, weight, target, 256, 1)
    gh, gw = ops.linear_logp_backward(grad, hidden, weight, target, lse, 0)
    parts = [ops.linear_logp_backward(grad, hidden, weight[s:s + 5000], target, lse, s)
             for s in range(0, v, 5000)]
    assert torch.equal(torch.cat([p[1] for p in parts]), gw)
    assert rel(sum(p[0] for p in parts), gh) < 1e-5
    assert torch.equal(ops.linear_logp_backward(grad[:9], hidden[:9], weight, target[:9], lse[:9], 0)[0],
                       gh[:9])
    hd, wd = hidden.double().requires_grad_(), weight.double().requires_grad_()
    ref_h, ref_w = torch.autograd.grad((logp_reference(hd, wd, target) * grad.double()).sum(), (hd, wd))
    assert rel(gh, ref_h) < 1e-2 and rel(gw, ref_w) < 1e-2


def test_linear_logp_backward_reads_transposed_operands_with_the_same_bits(ops):
    """At these sizes the backward's two gradient GEMMs run on 128- and 256-column tiles that read
    the transposed dlogit, weight and hidden in place. Inputs whose rows are one element longer
    force transposed copies instead; the gradients must not change by a bit, and nine tokens alone
    (small tiles, copies) must get their rows' bits."""
    t, h, v = 4096, 1024, 9000  # chunks of 8192 and 808 vocab rows
    hidden, weight = randn(t, h, seed=23), randn(v, h, seed=24, scale=0.1)
    target, grad = torch.randint(0, v, (t,), device=DEV), randn(t, dtype=torch.float32, seed=25)
    _, lse = split_logp(ops, hidden, weight, target, 256, 1)
    gh, gw = ops.linear_logp_backward(grad, hidden, weight, target, lse, 0)
    gh_c, gw_c = ops.linear_logp_backward(grad, pitched(hidden), pitched(weight), target, lse, 0)
    assert torch.equal(gh, gh_c) and torch.equal(gw, gw_c)
    assert torch.equal(ops.linear_logp_backward(grad[:9], hidden[:9], weight, target[:9], lse[:9], 0)[0],
                       gh[:9])
    hd, wd = hidden.double().requires_grad_(), weight.double().requires_grad_()
    ref_h, ref_w = torch.autograd.grad((logp_reference(hd, wd, target) * grad.double()).sum(), (hd, wd))
    assert rel(gh, ref_h) < 1e-2 and rel(gw, ref_w) < 1e-2


# ---------------------------------------------------------------- contracts
def test_counters_count_cuda_launches(ops):
    from rl_engine.ops import counters

    before = counters.read()
    ops.det_gemm(randn(4, 64), randn(8, 64), None)
    ops.swiglu(randn(4, 16))
    assert counters.delta(before, counters.read()) == {("det_gemm", "cuda"): 1, ("swiglu", "cuda"): 1}


def test_opcheck(ops):
    x, w, b = randn(5, 64), randn(24, 64), randn(24)
    torch.library.opcheck(ops.det_gemm, (x, w, b))
    torch.library.opcheck(ops.det_gemm_grad_input, (randn(5, 24), w))
    torch.library.opcheck(ops.det_gemm_grad_weight, (randn(5, 24), x))
    out, rstd = ops.rmsnorm(x, w[0], 1e-6)
    torch.library.opcheck(ops.rmsnorm, (x, w[0], 1e-6))
    torch.library.opcheck(ops.rmsnorm_backward, (x, x, w[0], rstd))
    q, pos = randn(5, 2, 8), torch.arange(5, device=DEV)
    torch.library.opcheck(ops.rope, (q, pos, 1e4))
    torch.library.opcheck(ops.rope_backward, (q, pos, 1e4))
    torch.library.opcheck(ops.swiglu, (x,))
    torch.library.opcheck(ops.swiglu_backward, (randn(5, 32), x))
    wv, tgt = randn(300, 64), torch.randint(0, 300, (5,), device=DEV)
    torch.library.opcheck(ops.linear_logp_partial, (x, wv, tgt, 0, 64, 8))
    m, s, tl = ops.linear_logp_partial(x, wv, tgt, 0, 64, 8)
    torch.library.opcheck(ops.logp_combine, (m[None], s[None], tl[None]))
    lse = ops.logp_combine(m[None], s[None], tl[None])[1]
    torch.library.opcheck(ops.linear_logp_backward, (randn(5, dtype=torch.float32), x, wv, tgt, lse, 0))
