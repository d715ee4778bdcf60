"""Temperature-1 sampling from the full distribution by Gumbel-max, seeded per sequence and step.

Each draw depends only on (base seed, prompt index, sample index, step) and the sequence's own
logits row; under an R logp route that row does not depend on the other rows either, so a sample is
the same whichever sequences share its batch, engine or TP group (a P route's GEMM picks its
blocking by batch shape, so there it may not be). The logits here only choose the token; the
reported log-prob comes from the plan's logp route.
"""

from __future__ import annotations

import hashlib
import struct

import torch

from rl_engine.models.tp import TPGroup
from rl_engine.ops import logp as logp_ops
from rl_engine.runtime.routing import Router


def _mix(*values: int) -> int:
    digest = hashlib.sha256(struct.pack(f"<{len(values)}q", *values)).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def sequence_seed(base: int, prompt_index: int, sample_index: int) -> int:
    return _mix(base, prompt_index, sample_index)


def step_seed(seq_seed: int, step: int) -> int:
    return _mix(seq_seed, step)


def full_logits(hidden: torch.Tensor, lm_head: torch.Tensor, *, vocab: int, tp: TPGroup,
                router: Router) -> torch.Tensor:
    """fp32 logits [B, vocab] of final hidden rows [B, H], computed by the logp route (det_gemm on
    R, so a row's logits do not depend on how many rows share the batch); vocab shards gathered in
    rank order (by the logp module's all-gather: bytes only, whichever route)."""
    local = router.logits("logp", hidden, lm_head).float()
    if tp.size == 1:
        return local
    shards = [logp_ops.shard_range(vocab, r, tp.size) for r in range(tp.size)]
    width = max(stop - start for start, stop, _ in shards)
    padded = local.new_full((local.shape[0], width), float("-inf"))
    padded[:, :local.shape[1]] = local
    parts = router.collective("logp", "all_gather", padded, tp.group).split(padded.shape[0])
    return torch.cat([p[:, :stop - start] for p, (start, stop, _) in zip(parts, shards)], dim=1)


def gumbel_max(logits: torch.Tensor, seeds: list[int]) -> torch.Tensor:
    """argmax(logits[b] + Gumbel noise of seeds[b]) of each row: exact samples of softmax(logits)
    at temperature 1, as a long tensor [B] on the logits' device (nothing is read back, so the
    host never waits for the GPU here).

    Each row's noise comes from its own generator, on the logits' device (a CUDA generator on a
    GPU), so it does not depend on the other rows; the seed never depends on the device, the
    noise drawn from it does."""
    tiny = torch.finfo(torch.float64).tiny
    noise = torch.stack([
        torch.rand(logits.shape[1:], device=logits.device, dtype=torch.float64,
                   generator=torch.Generator(device=logits.device).manual_seed(seed))
        for seed in seeds])
    return torch.argmax(logits.double() - torch.log(-torch.log(noise.clamp_min(tiny))), dim=-1)
