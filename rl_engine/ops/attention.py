"""Causal attention over packed sequences: rl_engine's block-ordered kernels and the production
twins (SDPA for prefill, a serving-style split-KV decode)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from rl_engine.ops import _lib

PAGE_SIZE = 16


def kv_block_size(head_dim: int) -> int:
    """The keys of one KV block for a model of this head_dim: the one tile choice that fixes the
    attention's bits. Blocks are anchored at absolute position 0 and merged in block order, and the
    backward's query chunks (the context-parallel cut) take the same size, so the rollout and the
    trainer agree only where both take it from here, as every caller does by default.

    128 keys from head_dim 64 (Qwen3-4B/8B at 128, the small presets at 64). At head_dim 128 the
    prefill forward is 9% faster than with 64 on an H100 and the backward 5-9%; the paged decode is
    as fast there, 5% slower on an H200 (3.76 TB/s against 3.96). At head_dim 64, on an H100 at
    c68bd6f (benchmarks/results/h100/c68bd6f/): forward 0.93 / 0.88 of cuDNN with 128 against
    0.80 / 0.76 with 64 (4k / 8k tokens), backward 0.61 / 0.53 against 0.58 / 0.50, and the paged
    decode as fast (2.65 TB/s each), since at 128 it walks a ring of three tiles and keeps four
    CTAs an SM (attention.cuh's split decode). 64 below head_dim 64, as before: no GPU kernel runs
    there, and the CPU tests' tiny models keep their bits."""
    if head_dim < 1:
        raise ValueError(f"head_dim {head_dim} must be positive")
    return 128 if head_dim >= 64 else 64


def block_of(q, given: int | None = None) -> int:
    """The block size a call asked for, or the one of q's head_dim (q: [..., head_dim])."""
    return kv_block_size(q.shape[-1]) if given is None else given


def det_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, q_positions, scale: float,
                  block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """out, lse of causal attention; query i sees keys 0..q_positions[i] of its sequence, in KV
    blocks of `block` keys (None: kv_block_size of the head_dim)."""
    return _lib.ops().attention_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, q_positions, scale,
                                    block_of(q, block))


def det_attention_backward(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, q_positions,
                           scale: float, block: int | None = None):
    """dq, and fp32 dk/dv partials added in global query-chunk order (chunks of `block` rows)."""
    block = block_of(q, block)
    return _lib.ops().attention_bwd(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                    q_positions, scale, block, block)


def det_attention_decode(q, k_cache, v_cache, block_table, seq_lens, scale: float,
                         block: int | None = None) -> torch.Tensor:
    return _lib.ops().attention_decode(q, k_cache, v_cache, block_table, seq_lens, scale,
                                       block_of(q, block))[0]


def production_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, q_positions, scale: float) -> torch.Tensor:
    """SDPA per sequence with the causal mask of absolute positions (GQA expanded by SDPA)."""
    outs = []
    for b in range(cu_seqlens_q.numel() - 1):
        qs, qe = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        ks, ke = int(cu_seqlens_k[b]), int(cu_seqlens_k[b + 1])
        qb, kb, vb = q[qs:qe].transpose(0, 1), k[ks:ke].transpose(0, 1), v[ks:ke].transpose(0, 1)
        key_pos = torch.arange(ke - ks, device=q.device)
        mask = key_pos[None, :] <= q_positions[qs:qe, None]
        o = F.scaled_dot_product_attention(qb[None], kb[None], vb[None], attn_mask=mask[None, None],
                                           scale=scale, enable_gqa=True)
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs, dim=0)


def decode_splits(batch: int, context: int, kv_heads: int) -> int:
    """How many KV splits a serving engine picks: enough work items to fill the machine when the
    batch is small, so the reduction order changes with batch size and context length."""
    if context <= PAGE_SIZE:
        return 1
    want = max(1, 64 // max(1, batch * kv_heads))
    return min(want, math.ceil(context / PAGE_SIZE), 16)


def production_attention_decode(q, k_cache, v_cache, block_table, seq_lens, scale: float) -> torch.Tensor:
    """Split-KV decode: each split's softmax partial in the activation dtype, merged by LSE."""
    batch, hq, d = q.shape
    page = k_cache.shape[1]
    hkv = k_cache.shape[2]
    outs = []
    for b in range(batch):
        n = int(seq_lens[b])
        pages = block_table[b, : math.ceil(n / page)].long()
        kb = k_cache[pages].reshape(-1, hkv, d)[:n].repeat_interleave(hq // hkv, dim=1)
        vb = v_cache[pages].reshape(-1, hkv, d)[:n].repeat_interleave(hq // hkv, dim=1)
        splits = decode_splits(batch, n, hkv)
        bounds = torch.linspace(0, n, splits + 1).round().long().tolist()
        parts, lses = [], []
        for s in range(splits):
            ks, kv_ = kb[bounds[s]:bounds[s + 1]], vb[bounds[s]:bounds[s + 1]]
            if ks.shape[0] == 0:
                continue
            scores = torch.einsum("hd,thd->ht", q[b], ks).float() * scale
            lse = torch.logsumexp(scores, dim=-1)
            p = torch.exp(scores - lse[:, None]).to(q.dtype)
            parts.append(torch.einsum("ht,thd->hd", p, kv_).float())
            lses.append(lse)
        lse_all = torch.stack(lses)
        weights = torch.softmax(lse_all, dim=0)
        outs.append((weights[..., None] * torch.stack(parts)).sum(0).to(q.dtype))
    return torch.stack(outs)


def _setup(ctx, inputs, output):
    q, k, v, cu_q, cu_k, q_pos, scale, block = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, q_pos)
    ctx.scale, ctx.block = scale, block


def _backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse, cu_q, cu_k, q_pos = ctx.saved_tensors
    dq, dk, dv = _lib.ops().attention_bwd(grad_out.contiguous(), q, k, v, out, lse, cu_q, cu_k,
                                          q_pos, ctx.scale, ctx.block, ctx.block)
    return dq, dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


if _lib.available():
    torch.library.register_autograd("rl_engine::attention_fwd", _backward, setup_context=_setup)
