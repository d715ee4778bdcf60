"""The production twins (P) against rl_engine's ops (R) on this CPU.

Each twin computes the same function as its R op to within rounding, so a P-vs-R cell of the
matrix compares like with like. What separates them is invariance: the production attention twin
gives a decode row other bits than the prefill row of the same token, and other bits again when
the decode batch changes, while R gives the same bits every time.

Measured for production_linear (F.linear) on this machine's CPUs (oneDNN, 1 or 2 threads): in fp32
every sampled row of an M=257 call differs from the same row computed alone (M=1 goes through a
matrix-vector path); in bf16 the tiny preset's shapes (K 256 and 768) happen to be batch invariant
and K=1024 is not (a few rows of 17 differ). So the test asserts that some fp32 shape differs,
only prints the bf16 counts (they depend on the CPU's kernels), and asserts that det_linear never
differs in either dtype.
"""

import math

import pytest
import torch

from rl_engine.ops import attention, linear, logp, norm, rope, swiglu
from seeded import randn

HQ, HKV, D = 8, 4, 64  # the tiny preset's heads
HIDDEN, INTER, VOCAB = 256, 768, 4096
EPS, THETA = 1e-6, 1_000_000.0
SCALE = D ** -0.5
# fp32: summation order only. bf16: one rounding of each output on both sides, and P rounds some
# intermediates (rope's cos/sin, the logits, decode's softmax weights) to bf16 as well.
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
DTYPES = [torch.float32, torch.bfloat16]


def sequence(t, dtype, seed=0):
    q, k, v = (randn(t, h, D, seed=seed + i, dtype=dtype) for i, h in enumerate((HQ, HKV, HKV)))
    cu = torch.tensor([0, t], dtype=torch.int32)
    return q, k, v, cu, torch.arange(t)


def page_cache(k, v):
    """k, v of one sequence [T, Hkv, D] in a paged cache of PAGE_SIZE slots, pages in order."""
    page = attention.PAGE_SIZE
    pages = math.ceil(k.shape[0] / page)
    k_cache = k.new_zeros(pages, page, HKV, D)
    v_cache = v.new_zeros(pages, page, HKV, D)
    k_cache.view(-1, HKV, D)[: k.shape[0]] = k
    v_cache.view(-1, HKV, D)[: v.shape[0]] = v
    return k_cache, v_cache, torch.arange(pages, dtype=torch.int32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_elementwise_and_linear_twins_match(dtype):
    x = randn(64, HIDDEN, seed=1, dtype=dtype)
    w, b = randn(INTER, HIDDEN, seed=2, scale=HIDDEN ** -0.5, dtype=dtype), randn(INTER, seed=3, dtype=dtype)
    torch.testing.assert_close(linear.det_linear(x, w, b), linear.production_linear(x, w, b), **TOL[dtype])
    nw = randn(HIDDEN, seed=4, dtype=dtype)
    torch.testing.assert_close(norm.det_rmsnorm(x, nw, EPS), norm.production_rmsnorm(x, nw, EPS),
                               **TOL[dtype])
    xq = randn(64, HQ, D, seed=5, dtype=dtype)
    pos = torch.randint(0, 40_000, (64,), generator=torch.Generator().manual_seed(6))
    torch.testing.assert_close(rope.det_rope(xq, pos, THETA), rope.production_rope(xq, pos, THETA),
                               **TOL[dtype])
    gu = randn(64, 2 * INTER, seed=7, scale=3.0, dtype=dtype)
    torch.testing.assert_close(swiglu.det_swiglu(gu), swiglu.production_swiglu(gu), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_and_logp_twins_match(dtype):
    q, k, v, _, _ = sequence(150, dtype)
    cu = torch.tensor([0, 50, 150], dtype=torch.int32)  # two packed sequences
    pos = torch.cat([torch.arange(50), torch.arange(100)])
    torch.testing.assert_close(attention.det_attention(q, k, v, cu, cu, pos, SCALE)[0],
                               attention.production_attention(q, k, v, cu, cu, pos, SCALE), **TOL[dtype])
    k_cache, v_cache, pages = page_cache(k[50:], v[50:])
    table, lens = pages[None].expand(3, -1).contiguous(), torch.tensor([1, 37, 100], dtype=torch.int32)
    qd = q[[50, 86, 149]]
    torch.testing.assert_close(attention.det_attention_decode(qd, k_cache, v_cache, table, lens, SCALE),
                               attention.production_attention_decode(qd, k_cache, v_cache, table, lens, SCALE),
                               **TOL[dtype])
    h, w = randn(64, HIDDEN, seed=10, dtype=dtype), randn(VOCAB, HIDDEN, seed=11, scale=0.1, dtype=dtype)
    target = torch.randint(0, VOCAB, (64,), generator=torch.Generator().manual_seed(12))
    torch.testing.assert_close(logp.det_selected_logp(h, w, target),
                               logp.production_selected_logp(h, w, target), **TOL[dtype])


def decode_rows(decode, q, k_cache, v_cache, pages):
    """Row t = decode of token t (batch of one) after tokens 0..t are cached."""
    return [decode(q[t:t + 1], k_cache, v_cache, pages[None], torch.tensor([t + 1], dtype=torch.int32),
                   SCALE)[0] for t in range(q.shape[0])]


def test_production_decode_rows_differ_from_prefill_rows(with_threads):
    t = 200
    q, k, v, cu, pos = sequence(t, torch.bfloat16, seed=20)
    k_cache, v_cache, pages = page_cache(k, v)

    def differing(prefill, decode):
        out = prefill(q, k, v, cu, cu, pos, SCALE)
        rows = decode_rows(decode, q, k_cache, v_cache, pages)
        return sum(not torch.equal(rows[i], out[i]) for i in range(t))

    # One thread: 400 tiny calls, where waking a thread pool for each costs more than the work.
    p_diff, r_diff = with_threads(1, lambda: (
        differing(attention.production_attention, attention.production_attention_decode),
        differing(lambda *a: attention.det_attention(*a)[0], attention.det_attention_decode)))
    print(f"decode vs prefill rows that differ (bf16): production {p_diff} of {t}, "
          f"rl_engine {r_diff} of {t}")
    assert p_diff >= t // 2
    assert r_diff == 0


def test_production_decode_depends_on_the_batch():
    """The same three tokens decoded alone and inside a batch of 16: the serving twin picks fewer
    KV splits for the larger batch, so it merges in another order; R's bits do not move."""
    q, k, v, _, _ = sequence(180, torch.bfloat16, seed=30)
    k_cache, v_cache, pages = page_cache(k, v)
    lens = torch.tensor([180, 97, 41] + [180] * 13, dtype=torch.int32)
    table = pages[None].expand(16, -1).contiguous()
    qb = torch.cat([q[[179, 96, 40]], q[:13]])
    for decode, expect_equal in ((attention.production_attention_decode, False),
                                 (attention.det_attention_decode, True)):
        batched = decode(qb, k_cache, v_cache, table, lens, SCALE)
        alone = [decode(qb[i:i + 1], k_cache, v_cache, table[:1], lens[i:i + 1], SCALE)[0]
                 for i in range(3)]
        same = [torch.equal(batched[i], alone[i]) for i in range(3)]
        assert all(same) if expect_equal else not any(same), (decode.__name__, same)


def test_decode_splits_follow_batch_and_context():
    assert attention.decode_splits(1, attention.PAGE_SIZE, HKV) == 1
    by_context = [attention.decode_splits(1, n, HKV) for n in (16, 40, 64, 200, 4096)]
    by_batch = [attention.decode_splits(b, 200, HKV) for b in (1, 2, 4, 8, 16)]
    assert by_context == [1, 3, 4, 13, 16]
    assert by_batch == [13, 8, 4, 2, 1]


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_rows_alone_and_in_a_batch(dtype):
    """Row i computed alone (M=1) and as row i of an M=257 call, every 16th row, for the tiny
    preset's projection shapes and a larger one."""
    counts = {}
    for k_dim, n_dim in ((HIDDEN, 3 * HIDDEN), (INTER, HIDDEN), (1024, 1024)):
        x = randn(257, k_dim, seed=40, dtype=dtype)
        w = randn(n_dim, k_dim, seed=41, scale=k_dim ** -0.5, dtype=dtype)
        for name, fn in (("production", linear.production_linear), ("rl_engine", linear.det_linear)):
            full = fn(x, w)
            counts[name, k_dim, n_dim] = sum(not torch.equal(fn(x[i:i + 1], w)[0], full[i])
                                             for i in range(0, 257, 16))
    print(dtype, {f"{n} K={k} N={m}": c for (n, k, m), c in counts.items()}, "of 17 rows")
    assert all(c == 0 for (name, _, _), c in counts.items() if name == "rl_engine")
    if dtype == torch.float32:
        assert any(c > 0 for (name, _, _), c in counts.items() if name == "production")
