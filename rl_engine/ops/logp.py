"""Selected-token log-probability from hidden states and the LM head.

rl_engine's form never builds [tokens x vocab] logits: fixed vocab tiles aligned to absolute vocab
ids, merged through one binary tree (vocab padded to a power-of-two tile count); a vocab-parallel
shard is a subtree. The production twin is full logits + fp32 log_softmax + gather.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from rl_engine.ops import _lib

VOCAB_TILE = 256


def num_tiles(vocab: int, tile: int = VOCAB_TILE) -> int:
    """Tiles of the whole (padded) vocab: the next power of two of ceil(vocab / tile)."""
    return 1 << max(0, math.ceil(math.log2(max(1, math.ceil(vocab / tile)))))


def shard_range(vocab: int, rank: int, world: int, tile: int = VOCAB_TILE) -> tuple[int, int, int]:
    """(start, stop, tiles) of a vocab-parallel shard: an aligned subtree of the padded vocab."""
    total = num_tiles(vocab, tile)
    if total % world:
        raise ValueError(f"a vocab of {vocab} ids in tiles of {tile} has {total} tiles, which "
                         f"cannot be split {world} ways; use a smaller tile or fewer TP ranks")
    per = total // world
    start = min(vocab, rank * per * tile)
    return start, min(vocab, start + per * tile), per


def partial(hidden, weight_shard, target, vocab_start: int, tiles: int, tile: int = VOCAB_TILE):
    """(max, sumexp, target_logit) fp32 [T] of one shard's subtree."""
    return _lib.ops().linear_logp_partial(hidden, weight_shard, target, vocab_start, tile, tiles)


def combine(maxes, sumexps, target_logits):
    """(logp, lse) from the stacked [R, T] roots of R shards, in shard order."""
    return _lib.ops().logp_combine(maxes, sumexps, target_logits)


def backward(grad_logp, hidden, weight_shard, target, lse, vocab_start: int):
    """fp32 (d hidden, d weight_shard) of the selected log-prob, lse being the whole vocab's."""
    return _lib.ops().linear_logp_backward(grad_logp.float().contiguous(), hidden, weight_shard,
                                           target, lse, vocab_start)


class _DetSelectedLogp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, tile):
        tiles = num_tiles(weight.shape[0], tile)
        m, s, t = partial(hidden, weight, target, 0, tiles, tile)
        logp, lse = combine(m[None], s[None], t[None])
        ctx.save_for_backward(hidden, weight, target, lse)
        return logp

    @staticmethod
    def backward(ctx, grad_logp):
        hidden, weight, target, lse = ctx.saved_tensors
        gh, gw = backward(grad_logp, hidden, weight, target, lse, 0)
        return gh.to(hidden.dtype), gw.to(weight.dtype), None, None


def det_selected_logp(hidden, weight, target, tile: int = VOCAB_TILE) -> torch.Tensor:
    """fp32 log p(target) for each row of hidden [T, H] under the LM head weight [V, H]."""
    return _DetSelectedLogp.apply(hidden, weight, target, tile)


def production_selected_logp(hidden, weight, target) -> torch.Tensor:
    logits = F.linear(hidden, weight).float()
    return torch.log_softmax(logits, dim=-1).gather(-1, target[:, None])[:, 0]
