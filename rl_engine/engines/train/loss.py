"""GRPO: rewards, group-normalised advantages and the clipped token-level policy-gradient loss.

Everything before the loss is plain Python arithmetic in sample order, so every rank computes the
same advantages whatever the layout. The loss of a micro-batch is its token terms summed and divided
by the token count of the whole global batch, so the gradient of each token is the same whether the
batch is split over DP ranks, CP ranks or micro-batches.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch

RewardFn = Callable[[Any], float]


def even_token_reward(sample) -> float:
    """Default reward: the fraction of response tokens with an even id (a deterministic rule)."""
    return sum(1 for t in sample.response if t % 2 == 0) / len(sample.response)


def group_advantages(rewards: Sequence[float], groups: Sequence[Any],
                     eps: float = 1e-6) -> list[float]:
    """(r - mean) / (std + eps) over the samples of each group, mean and unbiased std summed in
    sample order; a group of one sample has advantage 0."""
    members: dict[Any, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    out = [0.0] * len(rewards)
    for idx in members.values():
        vals = [float(rewards[i]) for i in idx]
        mean = math.fsum(vals) / len(vals)
        if len(vals) < 2:
            continue
        std = math.sqrt(math.fsum((v - mean) ** 2 for v in vals) / (len(vals) - 1))
        for i, v in zip(idx, vals):
            out[i] = (v - mean) / (std + eps)
    return out


def token_terms(logp: torch.Tensor, rollout_logp: torch.Tensor, advantages: torch.Tensor,
                clip: float = 0.2) -> torch.Tensor:
    """PPO-clipped policy-gradient term of each token: -min(ratio A, clip(ratio) A),
    ratio = exp(logp - rollout_logp). All fp32, elementwise."""
    ratio = torch.exp(logp - rollout_logp)
    clipped = torch.clamp(ratio, 1.0 - clip, 1.0 + clip)
    return torch.maximum(-ratio * advantages, -clipped * advantages)


def batch_loss(terms: torch.Tensor, global_tokens: int) -> torch.Tensor:
    """This part's share of the mean over the global batch's tokens."""
    return terms.sum() / global_tokens
