"""linear_logp_partial / logp_combine / linear_logp_backward on the CPU: correctness against plain
torch, and bitwise equality across vocab splits, token counts and thread counts."""

import pytest
import torch

# An unbuilt extension is an error (rl_engine.ops._lib says how to build it), never a skip.
from rl_engine.ops import _lib

H = 64
TILE = 64
# Row ids of kernel_counters(), as in include/rl_engine/kernel_ids.h.
K_PARTIAL, K_COMBINE, K_BACKWARD = 12, 13, 14


def ops():
    return _lib.ops()


def num_tiles_for(vocab, tile=TILE):
    """Tiles covering the vocab, padded up to a power of two."""
    n = 1
    while n * tile < vocab:
        n *= 2
    return n


def make(t, vocab, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(t, H, generator=g).to(dtype)
    weight = (torch.randn(vocab, H, generator=g) * 0.5).to(dtype)
    target = torch.randint(0, vocab, (t,), generator=g)
    return hidden, weight, target


def shards(weight, vocab, shards_n, tile=TILE):
    """(vocab_start, weight rows, num_tiles) of each shard of an R-way split of the tile tree."""
    n = num_tiles_for(vocab, tile) // shards_n
    span = n * tile
    # An all-padding shard starts at the vocab end, as a vocab-parallel layer places it.
    return [(min(vocab, r * span), weight[r * span:(r + 1) * span], n) for r in range(shards_n)]


def split_logp(hidden, weight, target, shards_n, tile=TILE):
    parts = [ops().linear_logp_partial(hidden, w, target, start, tile, n)
             for start, w, n in shards(weight, weight.shape[0], shards_n, tile)]
    stacked = [torch.stack([p[i] for p in parts]) for i in range(3)]
    return ops().logp_combine(*stacked)


def reference(hidden, weight, target):
    logits = hidden.float() @ weight.float().T
    return torch.log_softmax(logits, -1).gather(1, target[:, None])[:, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1000, 1024])
def test_matches_log_softmax(dtype, vocab):
    hidden, weight, target = make(48, vocab, dtype)
    logp, lse = split_logp(hidden, weight, target, 1)
    assert logp.dtype == torch.float32 and lse.dtype == torch.float32
    torch.testing.assert_close(logp, reference(hidden, weight, target), atol=2e-5, rtol=1e-5)
    ref_lse = torch.logsumexp(hidden.float() @ weight.float().T, -1)
    torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=1e-5)


def test_target_logit_has_det_gemm_bits():
    hidden, weight, target = make(32, 1000, torch.bfloat16)
    _, _, target_logit = ops().linear_logp_partial(hidden, weight, target, 0, TILE, 16)
    logits = ops().det_gemm(hidden.float(), weight.float(), None)
    assert torch.equal(target_logit, logits.gather(1, target[:, None])[:, 0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1000, 1024, 520])  # 520: a 4-way split has all-padding shards
def test_vocab_split_is_bitwise_identical(dtype, vocab):
    hidden, weight, target = make(40, vocab, dtype, seed=1)
    one = split_logp(hidden, weight, target, 1)
    for shards_n in (2, 4):
        split = split_logp(hidden, weight, target, shards_n)
        assert torch.equal(one[0], split[0]), f"logp differs for a {shards_n}-way split"
        assert torch.equal(one[1], split[1]), f"lse differs for a {shards_n}-way split"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_count_invariance(dtype):
    hidden, weight, target = make(37, 1000, dtype, seed=2)
    logp, lse = split_logp(hidden, weight, target, 2)
    for rows in (slice(0, 1), slice(5, 6), slice(3, 20), slice(36, 37)):
        part = split_logp(hidden[rows], weight, target[rows], 2)
        assert torch.equal(part[0], logp[rows]) and torch.equal(part[1], lse[rows])
    grad = torch.randn(37, generator=torch.Generator().manual_seed(3))
    gh, _ = ops().linear_logp_backward(grad, hidden, weight, target, lse, 0)
    gh_part, _ = ops().linear_logp_backward(grad[3:20], hidden[3:20], weight, target[3:20],
                                            lse[3:20], 0)
    assert torch.equal(gh_part, gh[3:20])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_matches_autograd(dtype):
    hidden, weight, target = make(24, 1000, dtype, seed=4)
    grad = torch.randn(24, generator=torch.Generator().manual_seed(5))
    _, lse = split_logp(hidden, weight, target, 1)
    gh, gw = ops().linear_logp_backward(grad, hidden, weight, target, lse, 0)
    assert gh.dtype == torch.float32 and gw.dtype == torch.float32
    h = hidden.float().requires_grad_()
    w = weight.float().requires_grad_()
    (reference(h, w, target) * grad).sum().backward()
    torch.testing.assert_close(gh, h.grad, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(gw, w.grad, atol=1e-5, rtol=1e-4)


def test_sharded_backward():
    """grad_weight rows of a shard carry the unsplit bits; grad_hidden adds up across shards."""
    hidden, weight, target = make(24, 1000, torch.bfloat16, seed=6)
    grad = torch.randn(24, generator=torch.Generator().manual_seed(7))
    _, lse = split_logp(hidden, weight, target, 1)
    gh, gw = ops().linear_logp_backward(grad, hidden, weight, target, lse, 0)
    parts = [ops().linear_logp_backward(grad, hidden, w, target, lse, start)
             for start, w, _ in shards(weight, 1000, 4)]
    assert torch.equal(torch.cat([p[1] for p in parts]), gw)
    torch.testing.assert_close(sum(p[0] for p in parts), gh, atol=1e-5, rtol=1e-4)


def test_thread_count_invariance():
    hidden, weight, target = make(33, 1000, torch.bfloat16, seed=8)
    grad = torch.randn(33, generator=torch.Generator().manual_seed(9))
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            logp, lse = split_logp(hidden, weight, target, 2)
            results.append((logp, lse, *ops().linear_logp_backward(grad, hidden, weight, target,
                                                                  lse, 0)))
    finally:
        torch.set_num_threads(before)
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_launches_are_counted():
    hidden, weight, target = make(4, 128, torch.float32)
    before = ops().kernel_counters()[:, 0].clone()
    m, s, t = ops().linear_logp_partial(hidden, weight, target, 0, TILE, 2)
    _, lse = ops().logp_combine(m[None], s[None], t[None])
    ops().linear_logp_backward(torch.ones(4), hidden, weight, target, lse, 0)
    delta = ops().kernel_counters()[:, 0] - before
    assert delta[K_PARTIAL] == 1 and delta[K_COMBINE] == 1 and delta[K_BACKWARD] == 1


def test_opcheck():
    hidden, weight, target = make(8, 200, torch.bfloat16)
    m, s, t = ops().linear_logp_partial(hidden, weight, target, 0, TILE, 4)
    torch.library.opcheck(ops().linear_logp_partial.default, (hidden, weight, target, 0, TILE, 4))
    torch.library.opcheck(ops().logp_combine.default, (m[None], s[None], t[None]))
    _, lse = ops().logp_combine(m[None], s[None], t[None])
    torch.library.opcheck(ops().linear_logp_backward.default,
                          (torch.randn(8), hidden, weight, target, lse, 0))


def test_bad_inputs_are_refused():
    hidden, weight, target = make(4, 200, torch.float32)
    with pytest.raises(RuntimeError, match="num_tiles must be a power of two"):
        ops().linear_logp_partial(hidden, weight, target, 0, TILE, 3)
    with pytest.raises(RuntimeError, match="more than num_tiles \\* vocab_tile"):
        ops().linear_logp_partial(hidden, weight, target, 0, TILE, 2)
    with pytest.raises(RuntimeError, match="vocab_start must be a multiple"):
        ops().linear_logp_partial(hidden, weight, target, 64, TILE, 4)
    with pytest.raises(RuntimeError, match="must be int64"):
        ops().linear_logp_partial(hidden, weight, target.int(), 0, TILE, 4)
    outside = target.clone()
    outside[2] = 5000
    m, s, t = ops().linear_logp_partial(hidden, weight, outside, 0, TILE, 4)
    with pytest.raises(RuntimeError, match="token 2 has its target in 0 of 1 shards"):
        ops().logp_combine(m[None], s[None], t[None])
    with pytest.raises(RuntimeError, match="R must be a power of two"):
        ops().logp_combine(m.expand(3, 4), s.expand(3, 4), t.expand(3, 4))
