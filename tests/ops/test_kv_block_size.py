"""kv_block_size, the one choice that fixes the attention's bits: its value per head_dim, and that
every caller that does not name a block (the wrappers, the router, the attention gate) takes the
one of its head_dim, so a rollout and a trainer of one model agree without passing it around."""

import pytest
import torch

from rl_engine.ops import attention
from rl_engine.runtime.plan import Plan
from rl_engine.runtime.routing import Router
from rl_engine.validation.attention_gate import GateConfig
from seeded import randn

HQ, HKV, PAGE = 4, 2, 16


@pytest.mark.parametrize("head_dim,block", [(8, 64), (56, 64), (64, 128), (120, 128), (128, 128), (256, 128)])
def test_block_by_head_dim(head_dim, block):
    assert attention.kv_block_size(head_dim) == block


def test_a_bad_head_dim_is_refused():
    with pytest.raises(ValueError, match="head_dim 0 must be positive"):
        attention.kv_block_size(0)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_block_of_a_call_is_the_one_it_names_or_its_head_dims(head_dim):
    q = torch.empty(3, HQ, head_dim)
    assert attention.block_of(q) == attention.kv_block_size(head_dim)
    assert attention.block_of(q, 16) == 16


def sequence(n, d, seed):
    q, k, v = randn(n, HQ, d, seed=seed), randn(n, HKV, d, seed=seed + 1), randn(n, HKV, d, seed=seed + 2)
    cu = torch.tensor([0, n], dtype=torch.int32)
    return q, k, v, cu, torch.arange(n)


@pytest.mark.parametrize("d", [64, 128])
def test_wrappers_default_to_the_block_of_the_head_dim(rl_ops, d):
    # 300 keys: two whole 128-key blocks and a partial one, four 64-key blocks and a partial one.
    n, block, scale = 300, attention.kv_block_size(d), d ** -0.5
    q, k, v, cu, pos = sequence(n, d, seed=d)
    out, lse = attention.det_attention(q, k, v, cu, cu, pos, scale)
    named_out, named_lse = attention.det_attention(q, k, v, cu, cu, pos, scale, block)
    assert torch.equal(out, named_out) and torch.equal(lse, named_lse)
    # The other size gives other bits, so the equality above says which size ran.
    other, _ = attention.det_attention(q, k, v, cu, cu, pos, scale, 192 - block)
    assert not torch.equal(out, other)

    do = randn(n, HQ, d, seed=d + 3)
    grads = attention.det_attention_backward(do, q, k, v, out, lse, cu, cu, pos, scale)
    named = attention.det_attention_backward(do, q, k, v, out, lse, cu, cu, pos, scale, block)
    assert all(torch.equal(a, b) for a, b in zip(grads, named))

    # The decode's last row equals the prefill's last row: both took the head_dim's block.
    pages = n // PAGE + 1
    k_cache = torch.zeros(pages, PAGE, HKV, d)
    v_cache = torch.zeros(pages, PAGE, HKV, d)
    k_cache.view(-1, HKV, d)[:n], v_cache.view(-1, HKV, d)[:n] = k, v
    table = torch.arange(pages, dtype=torch.int32)[None]
    dec = attention.det_attention_decode(q[n - 1:], k_cache, v_cache, table,
                                         torch.tensor([n], dtype=torch.int32), scale)
    assert torch.equal(dec[0], out[n - 1])


def test_router_r_ops_default_to_the_block_of_the_head_dim_and_note_it(rl_ops):
    n, d, scale = 200, 128, 128 ** -0.5
    q, k, v, cu, pos = sequence(n, d, seed=5)
    router = Router(Plan(), side="training", engine="builtin", device="cpu")
    out, lse = router.attention_lse("attention", q, k, v, cu, cu, pos, scale)
    named_out, named_lse = attention.det_attention(q, k, v, cu, cu, pos, scale, 128)
    assert torch.equal(out, named_out) and torch.equal(lse, named_lse)
    do = randn(n, HQ, d, seed=6)
    grads = router.attention_backward("attention", do, q, k, v, out, lse, cu, cu, pos, scale)
    named = attention.det_attention_backward(do, q, k, v, out, lse, cu, cu, pos, scale, 128)
    assert all(torch.equal(a, b) for a, b in zip(grads, named))
    assert torch.equal(router.attention("attention", q, k, v, cu, cu, pos, scale), named_out)
    # The readback's record says which size ran.
    assert router.records["attention"].shapes["kv_block"] == {128}


@pytest.mark.parametrize("head_dim,block", [(None, 64), (64, 128), (128, 128)])
def test_attention_gate_takes_the_block_of_its_head_dim(head_dim, block):
    assert GateConfig(world_size=1, head_dim=head_dim).block == block
    assert GateConfig(world_size=1, head_dim=head_dim, block=16).block == 16
