"""The Hopper attention kernels: decode equals prefill rows bitwise (any page table, any batch),
chunked and packed prefill equal full and lone prefill, the backward repeats bit for bit and its
context-parallel use (a rank's query chunks against the gathered prefix, dK/dV added in chunk
order) equals one call; every output within a stated tolerance of a float64 torch reference.
Skipped without a Hopper GPU."""

import functools
import math

import pytest
import torch

from rl_engine.ops import counters
import seeded

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not HOPPER, reason="needs a Hopper (sm_90) CUDA GPU")]

DEV = "cuda"
HQ, HKV = 8, 2  # GQA: four q heads per kv head
# Relative Frobenius error against float64. out: bf16 P in the PV product and one rounding of the
# result (about 2^-9 each); grads: bf16 P and dS and, for dq, one rounding. lse is fp32 throughout.
REL_OUT, REL_GRAD, LSE_ATOL = 1e-2, 2e-2, 1e-4


@pytest.fixture
def ops(rl_ops):
    assert rl_ops.det_gemm_sm90_compiled(), "the extension was built without its sm_90a kernels"
    return rl_ops


randn = functools.partial(seeded.randn, device=DEV)


def i32(values):
    return torch.tensor(values, dtype=torch.int32, device=DEV)


def packed(lens, d, dtype=torch.bfloat16, seed=0, heads=(HQ, HKV)):
    """q, k, v of full-prefill sequences packed back to back, cu_seqlens and positions."""
    hq, hkv = heads
    cu = i32([0, *torch.tensor(lens).cumsum(0).tolist()])
    pos = torch.cat([torch.arange(n) for n in lens]).to(DEV)
    t = sum(lens)
    return (randn(t, hq, d, dtype=dtype, seed=seed), randn(t, hkv, d, dtype=dtype, seed=seed + 1),
            randn(t, hkv, d, dtype=dtype, seed=seed + 2), cu, cu.clone(), pos)


def reference(q, k, v, cu_q, cu_k, pos, scale):
    """Causal attention in float64, one sequence at a time; differentiable in q, k, v."""
    outs, lses = [], []
    for b in range(cu_q.numel() - 1):
        qs, qe, ks, ke = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        kb = k[ks:ke].repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        vb = v[ks:ke].repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        s = torch.einsum("qhd,khd->hqk", q[qs:qe], kb) * scale
        visible = torch.arange(ke - ks, device=DEV)[None, :] <= pos[qs:qe, None]
        s = s.masked_fill(~visible, -math.inf)
        outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), vb))
        lses.append(s.logsumexp(-1).T)
    return torch.cat(outs), torch.cat(lses)


def rel(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def fwd(ops, q, k, v, cu_q, cu_k, pos, block):
    return ops.attention_fwd(q, k, v, cu_q, cu_k, pos, q.shape[-1] ** -0.5, block)


def bwd(ops, do, q, k, v, out, lse, cu_q, cu_k, pos, block, chunk):
    return ops.attention_bwd(do, q, k, v, out, lse, cu_q, cu_k, pos, q.shape[-1] ** -0.5, block, chunk)


def paged(k_seq, v_seq, lens, page, shuffle, seed=7):
    """A paged cache holding sequence b's first lens[b] keys; every other slot is NaN, so a read
    past a sequence's length shows in the result. shuffle scatters the pages over a larger cache."""
    pages_of = [math.ceil(n / page) for n in lens]
    num_pages = sum(pages_of) + (5 if shuffle else 0)
    phys = (torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)) if shuffle
            else torch.arange(num_pages)).tolist()
    shape = (num_pages, page, *k_seq[0].shape[1:])
    k_cache = torch.full(shape, math.nan, dtype=k_seq[0].dtype, device=DEV)
    v_cache = torch.full(shape, math.nan, dtype=k_seq[0].dtype, device=DEV)
    table = torch.zeros(len(lens), max(pages_of) + 1, dtype=torch.int32)
    nxt = 0
    for b, n in enumerate(lens):
        for p in range(pages_of[b]):
            table[b, p] = phys[nxt]
            s, e = p * page, min(n, (p + 1) * page)
            k_cache[phys[nxt], : e - s] = k_seq[b][s:e]
            v_cache[phys[nxt], : e - s] = v_seq[b][s:e]
            nxt += 1
    return k_cache, v_cache, table.to(DEV), i32(lens)


# (bf16, 128, 128, 128): head_dim 128 as its models run it, query chunks of one block. Three q heads
# a kv head: the dk/dv walk takes one head a step, where four take two at head_dim 64.
@pytest.mark.parametrize("dtype,d,block,chunk,heads", [
    (torch.bfloat16, 128, 128, 128, (HQ, HKV)), (torch.bfloat16, 128, 64, 64, (HQ, HKV)),
    (torch.bfloat16, 64, 16, 64, (HQ, HKV)), (torch.float16, 128, 32, 64, (HQ, HKV)),
    (torch.float16, 64, 128, 64, (HQ, HKV)), (torch.bfloat16, 64, 128, 40, (6, 2)),
    (torch.bfloat16, 128, 128, 40, (6, 2))])
def test_forward_and_backward_match_reference(ops, dtype, d, block, chunk, heads):
    q, k, v, cu_q, cu_k, pos = packed([1, 70, 200, 130], d, dtype, heads=heads)
    out, lse = fwd(ops, q, k, v, cu_q, cu_k, pos, block)
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = reference(qr, kr, vr, cu_q, cu_k, pos, d ** -0.5)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert rel(out, ref_out.detach()) < REL_OUT
    torch.testing.assert_close(lse.double(), ref_lse.detach(), rtol=0, atol=LSE_ATOL)

    do = randn(*q.shape, dtype=dtype, seed=9)
    dq, dk, dv = bwd(ops, do, q, k, v, out, lse, cu_q, cu_k, pos, block, chunk)
    ref = torch.autograd.grad(ref_out, (qr, kr, vr), do.double())
    assert dq.dtype == dtype and dk.dtype == dv.dtype == torch.float32
    for name, got, want in zip("dq dk dv".split(), (dq, dk, dv), ref):
        assert rel(got, want) < REL_GRAD, name


# Blocks of 64 and 128 keys prefill on wgmma, 16 and 32 on mma.sync; the decode runs mma.sync for
# every block size, so these also check that both products give a row the same bits.
@pytest.mark.parametrize("block,page", [(16, 16), (32, 16), (64, 16), (128, 8)])
@pytest.mark.parametrize("d", [64, 128])
def test_decode_equals_prefill_rows(ops, block, page, d):
    # The longest sequence spans five blocks of 128 keys: every tile of the decode's ring is
    # refilled at least once.
    lens = [1, 15, 16, 17, 64, 65, 130, 520]
    q, k, v, cu, _, pos = packed(lens, d, seed=3)
    out, lse = fwd(ops, q, k, v, cu, cu, pos, block)
    k_seq = [k[cu[b]:cu[b + 1]] for b in range(len(lens))]
    v_seq = [v[cu[b]:cu[b + 1]] for b in range(len(lens))]
    scale = d ** -0.5
    # A batch of 8 mixed lengths, token t_b of sequence b at block edges and inside blocks.
    visible = [1, 9, 16, 17, 40, 64, 129, 450]
    rows = [int(cu[b]) + n - 1 for b, n in enumerate(visible)]
    for shuffle in (False, True):
        dec_out, dec_lse = ops.attention_decode(q[rows], *paged(k_seq, v_seq, visible, page, shuffle),
                                                scale, block)
        assert torch.equal(dec_out, out[rows]) and torch.equal(dec_lse, lse[rows]), shuffle
    # Batch of 1: every token of the longest sequence decoded alone, on two page tables.
    b, n = 7, lens[7]
    for shuffle in (False, True):
        k_cache, v_cache, table, _ = paged([k_seq[b]], [v_seq[b]], [n], page, shuffle)
        for t in range(n):
            row = int(cu[b]) + t
            dec_out, dec_lse = ops.attention_decode(q[row:row + 1], k_cache, v_cache, table,
                                                    i32([t + 1]), scale, block)
            assert torch.equal(dec_out[0], out[row]) and torch.equal(dec_lse[0], lse[row]), (shuffle, t)
    # Every token of it in one batch sharing the pages.
    all_rows = list(range(int(cu[b]), int(cu[b + 1])))
    dec_out, dec_lse = ops.attention_decode(q[all_rows], k_cache, v_cache, table.expand(n, -1),
                                            i32(list(range(1, n + 1))), scale, block)
    assert torch.equal(dec_out, out[all_rows]) and torch.equal(dec_lse, lse[all_rows])


# Up to 16 query heads per kv head the decode splits each block over its warps, above it gives
# each warp 16 heads: both kernels must give prefill rows.
@pytest.mark.parametrize("block", [64, 128])
@pytest.mark.parametrize("heads", [(2, 2), (32, 2), (40, 2), (64, 1)])
def test_decode_equals_prefill_rows_for_each_group_size(ops, heads, block):
    lens = [3, 70, 129]
    q, k, v, cu, _, pos = packed(lens, 128, seed=11, heads=heads)
    out, lse = fwd(ops, q, k, v, cu, cu, pos, block)
    rows = [int(cu[b]) + n - 1 for b, n in enumerate(lens)]
    k_seq = [k[cu[b]:cu[b + 1]] for b in range(len(lens))]
    v_seq = [v[cu[b]:cu[b + 1]] for b in range(len(lens))]
    dec_out, dec_lse = ops.attention_decode(q[rows], *paged(k_seq, v_seq, lens, 16, True),
                                            128 ** -0.5, block)
    assert torch.equal(dec_out, out[rows]) and torch.equal(dec_lse, lse[rows])


@pytest.mark.parametrize("block", [16, 64, 128])
def test_chunked_prefill_equals_full_prefill(ops, block):
    n = 300
    q, k, v, cu, _, pos = packed([n], 128, seed=5)
    out, lse = fwd(ops, q, k, v, cu, cu, pos, block)
    for bounds in ([0, 13, 77, 200, 300], [0, 128, 300]):
        for s, e in zip(bounds, bounds[1:]):
            c_out, c_lse = fwd(ops, q[s:e], k[:e], v[:e], i32([0, e - s]), i32([0, e]), pos[s:e], block)
            assert torch.equal(c_out, out[s:e]) and torch.equal(c_lse, lse[s:e]), (bounds, s)


@pytest.mark.parametrize("block", [64, 128])
def test_packed_batch_equals_each_sequence_alone(ops, block):
    lens = [70, 200, 1, 130]
    q, k, v, cu, _, pos = packed(lens, 128, seed=11)
    do = randn(*q.shape, dtype=q.dtype, seed=12)
    out, lse = fwd(ops, q, k, v, cu, cu, pos, block)
    grads = bwd(ops, do, q, k, v, out, lse, cu, cu, pos, block, block)
    for b, n in enumerate(lens):
        r = slice(int(cu[b]), int(cu[b + 1]))
        one = i32([0, n])
        o1, l1 = fwd(ops, q[r], k[r], v[r], one, one, pos[r], block)
        assert torch.equal(o1, out[r]) and torch.equal(l1, lse[r]), b
        alone = bwd(ops, do[r], q[r], k[r], v[r], o1, l1, one, one, pos[r], block, block)
        for a, together in zip(alone, grads):
            assert torch.equal(a, together[r]), b


# (128, 128): head_dim 128's kv_block_size, the one its models run with. At head_dim 64 the dk/dv
# walk takes two heads a step where the group splits into pairs (four or two q heads a kv head), one
# where it does not (three, or one); at head_dim 128 always one. Chunks of 40 rows end steps part
# way through.
@pytest.mark.parametrize("block,chunk", [(64, 64), (64, 40), (128, 128)])
@pytest.mark.parametrize("d,heads", [(128, (HQ, HKV)), (128, (3, 1)), (128, (2, 1)),
                                     (64, (HQ, HKV)), (64, (3, 1)), (64, (2, 2))])
def test_backward_repeats_and_context_parallel_split_equals_one_call(ops, block, chunk, d, heads):
    n, cp = 4 * chunk, 2
    q, k, v, cu, _, pos = packed([n], d, seed=13, heads=heads)
    do = randn(*q.shape, dtype=q.dtype, seed=14)
    out, lse = fwd(ops, q, k, v, cu, cu, pos, block)
    full = bwd(ops, do, q, k, v, out, lse, cu, cu, pos, block, chunk)
    again = bwd(ops, do, q, k, v, out, lse, cu, cu, pos, block, chunk)
    assert all(torch.equal(a, b) for a, b in zip(full, again))

    chunk_rows = [torch.arange(c * chunk, (c + 1) * chunk, device=DEV) for c in range(2 * cp)]
    all_keys = i32([0, n])
    for rank in range(cp):  # load-balanced CP: rank r holds chunks r and 2cp-1-r
        rows = torch.cat([chunk_rows[rank], chunk_rows[2 * cp - 1 - rank]])
        r_out, r_lse = fwd(ops, q[rows], k, v, i32([0, rows.numel()]), all_keys, pos[rows], block)
        assert torch.equal(r_out, out[rows]) and torch.equal(r_lse, lse[rows]), rank
    dk = dv = None
    for c, rows in enumerate(chunk_rows):  # one call per chunk, partials added in chunk order
        dq_c, dk_c, dv_c = bwd(ops, do[rows], q[rows], k, v, out[rows], lse[rows],
                               i32([0, chunk]), all_keys, pos[rows], block, chunk)
        assert torch.equal(dq_c, full[0][rows]), c
        dk, dv = (dk_c, dv_c) if dk is None else (dk + dk_c, dv + dv_c)
    assert torch.equal(dk, full[1]) and torch.equal(dv, full[2])


def test_launches_are_counted(ops):
    q, k, v, cu, _, pos = packed([5], 64)
    before = counters.read()
    out, lse = fwd(ops, q, k, v, cu, cu, pos, 16)
    bwd(ops, out, q, k, v, out, lse, cu, cu, pos, 16, 16)
    ops.attention_decode(q[-1:], *paged([k], [v], [5], 8, shuffle=False), 0.125, 16)
    torch.cuda.synchronize()
    assert counters.delta(before, counters.read()) == {
        ("attention_fwd", "cuda"): 1, ("attention_bwd", "cuda"): 1, ("attention_decode", "cuda"): 1}


def test_opcheck(ops):
    q, k, v, cu, _, pos = packed([5, 3], 64)
    out, lse = fwd(ops, q, k, v, cu, cu, pos, 16)
    torch.library.opcheck(ops.attention_fwd, (q, k, v, cu, cu, pos, 0.125, 16))
    torch.library.opcheck(ops.attention_bwd, (out, q, k, v, out, lse, cu, cu, pos, 0.125, 16, 16))
    cache = paged([k[:5], k[5:]], [v[:5], v[5:]], [5, 3], 8, shuffle=True)
    torch.library.opcheck(ops.attention_decode, (q[[4, 7]], *cache, 0.125, 16))


def test_unsupported_inputs_raise_clear_errors(ops):
    q, k, v, cu, _, pos = packed([6], 64)
    with pytest.raises(RuntimeError, match="support head_dim 64 and 128, got 40"):
        fwd(ops, q[..., :40], k[..., :40], v[..., :40], cu, cu, pos, 16)
    with pytest.raises(RuntimeError, match="bf16 or fp16"):
        fwd(ops, q.float(), k.float(), v.float(), cu, cu, pos, 16)
    with pytest.raises(RuntimeError, match="kv_block_size 16, 32, 64 or 128, got 48"):
        fwd(ops, q, k, v, cu, cu, pos, 48)
    cache = paged([k], [v], [6], 8, shuffle=False)
    with pytest.raises(RuntimeError, match="kv_block_size .12. must be a positive multiple of page_size .8."):
        ops.attention_decode(q[-1:], *cache, 0.3, 12)
