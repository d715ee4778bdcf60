"""Training samples, their split into context-parallel chunks, and packing into micro-batches.

A sequence is cut into 2*CP chunks (Megatron's load balancing for causal attention: CP rank r holds
chunks r and 2CP-1-r). Chunk boundaries sit on query-chunk boundaries (multiples of the attention
block size), so the backward's per-chunk dK/dV partials of one chunk are computed whole on one rank
and can be added in global chunk order. A sequence of U blocks gives chunk i the blocks
floor(i*U/2CP) .. floor((i+1)*U/2CP) - 1: exact at every length, some chunks empty when U < 2CP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, kw_only=True, slots=True)
class Sample:
    """One rollout sample: prompt and response token ids, the rollout's fp32 log-probs of the
    response tokens, the GRPO group it belongs to (default: its prompt) and reward inputs."""

    prompt: tuple[int, ...]
    response: tuple[int, ...]
    rollout_logp: torch.Tensor
    group: Any = None
    reward_inputs: Any = None

    def __post_init__(self) -> None:
        if not self.prompt or not self.response:
            raise ValueError(f"a sample needs a prompt and a response, got {len(self.prompt)} "
                             f"prompt and {len(self.response)} response tokens")
        if tuple(self.rollout_logp.shape) != (len(self.response),):
            raise ValueError(f"rollout_logp has shape {tuple(self.rollout_logp.shape)}; it needs "
                             f"one log-prob per response token ({len(self.response)})")

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.response)

    @property
    def group_key(self) -> Any:
        return self.prompt if self.group is None else self.group

    def tokens(self) -> torch.Tensor:
        return torch.tensor(self.prompt + self.response, dtype=torch.long)


def cp_chunks(length: int, cp: int, block: int) -> list[tuple[int, int]]:
    """The 2*CP chunks [start, end) of a sequence, cut at multiples of `block`."""
    units = -(-length // block)
    bounds = [min(length, (i * units // (2 * cp)) * block) for i in range(2 * cp + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(2 * cp)]


def rank_ranges(length: int, cp: int, rank: int, block: int) -> list[tuple[int, int]]:
    """Position ranges of a sequence held by CP rank `rank`: chunks rank and 2CP-1-rank."""
    chunks = cp_chunks(length, cp, block)
    return [chunks[rank], chunks[2 * cp - 1 - rank]]


def rank_share(length: int, cp: int, rank: int, block: int) -> int:
    return sum(e - s for s, e in rank_ranges(length, cp, rank, block))


def pack(lengths: list[int], *, cp: int, max_tokens: int, block: int) -> list[list[int]]:
    """Greedy in-order packing: indices of the sequences of each micro-batch, such that no CP
    rank holds more than `max_tokens` tokens of a micro-batch. The same on every rank."""
    batches: list[list[int]] = []
    totals = [0] * cp
    for i, length in enumerate(lengths):
        shares = [rank_share(length, cp, r, block) for r in range(cp)]
        if max(shares) > max_tokens:
            where = f" (its largest share over CP={cp} ranks is {max(shares)})" if cp > 1 else ""
            raise ValueError(f"sequence {i} has {length} tokens{where}, more than "
                             f"MAX_TOKENS_PER_GPU={max_tokens}")
        if not batches or any(t + s > max_tokens for t, s in zip(totals, shares)):
            batches.append([])
            totals = [0] * cp
        batches[-1].append(i)
        totals = [t + s for t, s in zip(totals, shares)]
    return batches


class MicroBatch:
    """Row geometry of one micro-batch. Global row ids number the tokens as one CP=1 rank packs
    them (sequence after sequence, positions in order); each CP rank holds a subset of them."""

    def __init__(self, lengths: list[int], cp: int, block: int):
        self.lengths, self.cp, self.block = list(lengths), cp, block
        self.offsets = [0]
        for n in self.lengths:
            self.offsets.append(self.offsets[-1] + n)
        self.ranges = [[rank_ranges(n, cp, r, block) for n in self.lengths] for r in range(cp)]

    @property
    def total(self) -> int:
        return self.offsets[-1]

    def cu_seqlens(self, rank: int | None = None) -> torch.Tensor:
        """int32 [B+1]: whole sequences (rank None) or the rows rank `rank` holds."""
        counts = self.lengths if rank is None else [
            sum(e - s for s, e in rr) for rr in self.ranges[rank]]
        return torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)

    def positions(self, rank: int) -> torch.Tensor:
        return torch.tensor([p for rr in self.ranges[rank] for s, e in rr for p in range(s, e)],
                            dtype=torch.long)

    def rows(self, rank: int) -> torch.Tensor:
        """Global row ids held by `rank`, in its local order."""
        return torch.tensor([self.offsets[b] + p for b, rr in enumerate(self.ranges[rank])
                             for s, e in rr for p in range(s, e)], dtype=torch.long)

    def units(self, rank: int, seq: int) -> list[int]:
        """Query-chunk ids (position // block) of sequence `seq` held by `rank`, in local order."""
        return [u for s, e in self.ranges[rank][seq] if e > s
                for u in range(s // self.block, -(-e // self.block))]

    def num_units(self, seq: int) -> int:
        return -(-self.lengths[seq] // self.block)
