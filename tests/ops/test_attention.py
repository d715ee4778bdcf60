"""attention_fwd, attention_decode and attention_bwd on the CPU: agreement with a plain-torch causal
reference, bitwise equality of decode and prefill rows whatever the page table, of chunked and full
prefill, of packed and lone sequences, of the backward across query-chunk splits and threads, the
op contracts (opcheck) and the input checks."""

import math

import pytest
import torch

from rl_engine.ops import counters
from seeded import randn

HQ, HKV = 8, 4  # GQA: two q heads per kv head
BLOCK = 16  # kv_block_size; also the backward's query chunk
LENS = [23, 40, 9]  # a packed batch; 40 spans three KV blocks with a partial last one
# Against the fp32 reference: fp32 differs by summation order only; bf16 outputs carry one
# rounding of the result, and dq/dk/dv also inherit the bf16 rounding of the saved `out`.
FWD_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1e-2, atol=1e-2)}
BWD_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}


def packed(lens, d, dtype, seed=0):
    """q, k, v of full-prefill sequences packed back to back, with cu_seqlens and positions."""
    t = sum(lens)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    pos = torch.cat([torch.arange(n) for n in lens])
    q = randn(t, HQ, d, dtype=dtype, seed=seed)
    k = randn(t, HKV, d, dtype=dtype, seed=seed + 1)
    v = randn(t, HKV, d, dtype=dtype, seed=seed + 2)
    return q, k, v, cu, cu.clone(), pos


def reference(q, k, v, cu_q, cu_k, pos, scale):
    """Causal attention in fp32 torch, one sequence at a time; differentiable in q, k, v."""
    outs, lses = [], []
    for b in range(cu_q.numel() - 1):
        qb = q[cu_q[b]:cu_q[b + 1]].float()
        kb = k[cu_k[b]:cu_k[b + 1]].float().repeat_interleave(HQ // HKV, dim=1)
        vb = v[cu_k[b]:cu_k[b + 1]].float().repeat_interleave(HQ // HKV, dim=1)
        s = torch.einsum("qhd,khd->hqk", qb, kb) * scale
        visible = torch.arange(kb.shape[0])[None, :] <= pos[cu_q[b]:cu_q[b + 1], None]
        s = s.masked_fill(~visible, -math.inf)
        outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), vb))
        lses.append(s.logsumexp(-1).T)
    return torch.cat(outs), torch.cat(lses)


def fwd(ops, q, k, v, cu_q, cu_k, pos, block=BLOCK):
    return ops.attention_fwd(q, k, v, cu_q, cu_k, pos, q.shape[-1] ** -0.5, block)


def bwd(ops, do, q, k, v, out, lse, cu_q, cu_k, pos, chunk=BLOCK):
    return ops.attention_bwd(do, q, k, v, out, lse, cu_q, cu_k, pos, q.shape[-1] ** -0.5, BLOCK,
                             chunk)


def paged(k_seq, v_seq, lens, page, shuffle, seed=7):
    """A paged cache holding sequence b's first lens[b] keys; every other slot is NaN, so a read past
    a sequence's length shows up in the result. shuffle scatters the logical pages over a larger
    cache in random order; otherwise they are contiguous in sequence order."""
    pages_of = [math.ceil(n / page) for n in lens]
    num_pages = sum(pages_of) + (5 if shuffle else 0)
    phys = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)) if shuffle \
        else torch.arange(num_pages)
    shape = (num_pages, page, *k_seq[0].shape[1:])
    k_cache = torch.full(shape, math.nan, dtype=k_seq[0].dtype)
    v_cache = torch.full(shape, math.nan, dtype=k_seq[0].dtype)
    table = torch.zeros(len(lens), max(pages_of) + 1, dtype=torch.int32)  # one spare column
    nxt = 0
    for b, n in enumerate(lens):
        for p in range(pages_of[b]):
            table[b, p] = int(phys[nxt])
            rows = slice(p * page, min(n, (p + 1) * page))
            k_cache[table[b, p], : rows.stop - rows.start] = k_seq[b][rows]
            v_cache[table[b, p], : rows.stop - rows.start] = v_seq[b][rows]
            nxt += 1
    return k_cache, v_cache, table, torch.tensor(lens, dtype=torch.int32)


DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 40])
def test_forward_and_backward_match_reference(rl_ops, dtype, d):
    q, k, v, cu_q, cu_k, pos = packed(LENS, d, dtype)
    out, lse = fwd(rl_ops, q, k, v, cu_q, cu_k, pos)
    qr, kr, vr = (t.float().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = reference(qr, kr, vr, cu_q, cu_k, pos, d ** -0.5)
    assert out.dtype == dtype and lse.dtype == torch.float32
    torch.testing.assert_close(out.float(), ref_out.detach(), **FWD_TOL[dtype])
    torch.testing.assert_close(lse, ref_lse.detach(), **FWD_TOL[torch.float32])

    do = randn(*q.shape, dtype=dtype, seed=9)
    dq, dk, dv = bwd(rl_ops, do, q, k, v, out, lse, cu_q, cu_k, pos)
    ref_dq, ref_dk, ref_dv = torch.autograd.grad(ref_out, (qr, kr, vr), do.float())
    assert dq.dtype == dtype and dk.dtype == dv.dtype == torch.float32
    torch.testing.assert_close(dq.float(), ref_dq, **BWD_TOL[dtype])
    torch.testing.assert_close(dk, ref_dk, **BWD_TOL[dtype])
    torch.testing.assert_close(dv, ref_dv, **BWD_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page", [8, 16])
@pytest.mark.parametrize("d", [64, 40])
def test_decode_equals_prefill_rows(rl_ops, dtype, page, d):
    lens = [1, 17, 33, 40, 8]
    q, k, v, cu_q, cu_k, pos = packed(lens, d, dtype, seed=3)
    out, lse = fwd(rl_ops, q, k, v, cu_q, cu_k, pos)
    k_seq = [k[cu_k[b]:cu_k[b + 1]] for b in range(len(lens))]
    v_seq = [v[cu_k[b]:cu_k[b + 1]] for b in range(len(lens))]
    scale = d ** -0.5
    # Batch of 5 mixed lengths: token t_b of sequence b, with t_b at block edges and inside blocks.
    visible = [1, 16, 17, 40, 5]
    rows = [int(cu_q[b]) + n - 1 for b, n in enumerate(visible)]
    for shuffle in (False, True):
        cache = paged(k_seq, v_seq, visible, page, shuffle)
        dec_out, dec_lse = rl_ops.attention_decode(q[rows], *cache, scale, BLOCK)
        assert torch.equal(dec_out, out[rows]), shuffle
        assert torch.equal(dec_lse, lse[rows]), shuffle
    # Batch of 1: every token of the longest sequence, decoded alone.
    b = 3
    for shuffle in (False, True):
        for t in range(lens[b]):
            cache = paged([k_seq[b]], [v_seq[b]], [t + 1], page, shuffle, seed=t)
            row = int(cu_q[b]) + t
            dec_out, dec_lse = rl_ops.attention_decode(q[row:row + 1], *cache, scale, BLOCK)
            assert torch.equal(dec_out[0], out[row]), (shuffle, t)
            assert torch.equal(dec_lse[0], lse[row]), (shuffle, t)


@pytest.mark.parametrize("dtype", DTYPES)
def test_chunked_prefill_equals_full_prefill(rl_ops, dtype):
    n = 45
    q, k, v, cu_q, cu_k, pos = packed([n], 64, dtype, seed=5)
    out, lse = fwd(rl_ops, q, k, v, cu_q, cu_k, pos)
    for bounds in ([0, 13, 30, 45], [0, 32, 45]):
        for s, e in zip(bounds, bounds[1:]):
            # Each chunk's queries see the full key prefix 0..e-1 (what a KV cache holds by then).
            c_out, c_lse = fwd(rl_ops, q[s:e], k[:e], v[:e], torch.tensor([0, e - s], dtype=torch.int32),
                               torch.tensor([0, e], dtype=torch.int32), pos[s:e])
            assert torch.equal(c_out, out[s:e]), (bounds, s)
            assert torch.equal(c_lse, lse[s:e]), (bounds, s)


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_batch_equals_each_sequence_alone(rl_ops, dtype):
    q, k, v, cu_q, cu_k, pos = packed(LENS, 40, dtype, seed=11)
    do = randn(*q.shape, dtype=dtype, seed=12)
    out, lse = fwd(rl_ops, q, k, v, cu_q, cu_k, pos)
    dq, dk, dv = bwd(rl_ops, do, q, k, v, out, lse, cu_q, cu_k, pos)
    for b, n in enumerate(LENS):
        r = slice(int(cu_q[b]), int(cu_q[b + 1]))
        cu = torch.tensor([0, n], dtype=torch.int32)
        o1, l1 = fwd(rl_ops, q[r], k[r], v[r], cu, cu, pos[r])
        assert torch.equal(o1, out[r]) and torch.equal(l1, lse[r]), b
        grads = bwd(rl_ops, do[r], q[r], k[r], v[r], o1, l1, cu, cu, pos[r])
        for alone, together in zip(grads, (dq[r], dk[r], dv[r])):
            assert torch.equal(alone, together), b


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_is_invariant_to_runs_query_chunk_splits_and_threads(rl_ops, dtype, with_threads):
    n, cut = 45, 2 * BLOCK  # the split sits on a query-chunk boundary
    q, k, v, cu_q, cu_k, pos = packed([n], 64, dtype, seed=13)
    do = randn(*q.shape, dtype=dtype, seed=14)
    out, lse = fwd(rl_ops, q, k, v, cu_q, cu_k, pos)
    full = bwd(rl_ops, do, q, k, v, out, lse, cu_q, cu_k, pos)
    again = bwd(rl_ops, do, q, k, v, out, lse, cu_q, cu_k, pos)
    assert all(torch.equal(a, b) for a, b in zip(full, again))

    def one_side(s, e):
        cq, ck = torch.tensor([0, e - s], dtype=torch.int32), torch.tensor([0, e], dtype=torch.int32)
        return bwd(rl_ops, do[s:e], q[s:e], k[:e], v[:e], out[s:e], lse[s:e], cq, ck, pos[s:e])

    dq_a, dk_a, dv_a = one_side(0, cut)
    dq_b, dk_b, dv_b = one_side(cut, n)
    dk = torch.zeros_like(full[1])
    dv = torch.zeros_like(full[2])
    dk[:cut] += dk_a  # chunk order: the earlier queries' partials first
    dv[:cut] += dv_a
    dk += dk_b
    dv += dv_b
    assert torch.equal(torch.cat([dq_a, dq_b]), full[0])
    assert torch.equal(dk, full[1]) and torch.equal(dv, full[2])

    for threads in (1, 2):
        got = with_threads(threads, lambda: bwd(rl_ops, do, q, k, v, out, lse, cu_q, cu_k, pos))
        assert all(torch.equal(a, b) for a, b in zip(got, full)), threads


def test_forward_and_decode_are_thread_invariant(rl_ops, with_threads):
    q, k, v, cu_q, cu_k, pos = packed(LENS, 64, torch.bfloat16, seed=15)
    k_seq = [k[cu_k[b]:cu_k[b + 1]] for b in range(len(LENS))]
    v_seq = [v[cu_k[b]:cu_k[b + 1]] for b in range(len(LENS))]
    cache = paged(k_seq, v_seq, LENS, 8, shuffle=True)
    last = (cu_q[1:] - 1).long()
    results = []
    for threads in (1, 2):
        results.append(with_threads(threads, lambda: (
            *fwd(rl_ops, q, k, v, cu_q, cu_k, pos),
            *rl_ops.attention_decode(q[last], *cache, 64 ** -0.5, BLOCK))))
    assert all(torch.equal(a, b) for a, b in zip(*results))
    assert torch.equal(results[0][2], results[0][0][last])  # decode == prefill's last rows


def test_launches_are_counted(rl_ops):
    q, k, v, cu_q, cu_k, pos = packed([5], 8, torch.float32)
    before = counters.read()
    out, lse = fwd(rl_ops, q, k, v, cu_q, cu_k, pos)
    bwd(rl_ops, out, q, k, v, out, lse, cu_q, cu_k, pos)
    rl_ops.attention_decode(q[-1:], *paged([k], [v], [5], 8, shuffle=False), 0.3, BLOCK)
    assert counters.delta(before, counters.read()) == {
        ("attention_fwd", "cpu"): 1, ("attention_bwd", "cpu"): 1, ("attention_decode", "cpu"): 1}


def test_opcheck(rl_ops):
    q, k, v, cu_q, cu_k, pos = packed([5, 3], 16, torch.float32)
    out, lse = fwd(rl_ops, q, k, v, cu_q, cu_k, pos, block=4)
    torch.library.opcheck(rl_ops.attention_fwd, (q, k, v, cu_q, cu_k, pos, 0.25, 4))
    torch.library.opcheck(rl_ops.attention_bwd,
                          (out, q, k, v, out, lse, cu_q, cu_k, pos, 0.25, 4, 4))
    cache = paged([k[:5], k[5:]], [v[:5], v[5:]], [5, 3], 4, shuffle=True)
    torch.library.opcheck(rl_ops.attention_decode, (q[[4, 7]], *cache, 0.25, 8))


def test_bad_inputs_raise_clear_errors(rl_ops):
    q, k, v, cu_q, cu_k, pos = packed([6], 8, torch.float32)
    cache = paged([k], [v], [6], 8, shuffle=False)
    with pytest.raises(RuntimeError, match="kv_block_size .12. must be a positive multiple of page_size .8."):
        rl_ops.attention_decode(q[-1:], *cache, 0.3, 12)
    with pytest.raises(RuntimeError, match="position 6 but the sequence has only 6 keys"):
        fwd(rl_ops, q, k, v, cu_q, cu_k, pos + 1)
    with pytest.raises(RuntimeError, match="q_positions must increase strictly"):
        bwd(rl_ops, q, q, k, v, q, torch.zeros(6, HQ), cu_q, cu_k, pos.flip(0))
    with pytest.raises(RuntimeError, match="head_dim must be a positive multiple of 8"):
        fwd(rl_ops, q[..., :6], k[..., :6], v[..., :6], cu_q, cu_k, pos)
