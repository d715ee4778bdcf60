"""Paged KV cache, the block manager that hands out its pages, and the two attention backends
(packed prefill, paged decode) that write new keys into it before attending.

A sequence's keys live in fixed-size pages (PAGE_SIZE tokens) found through its page table, as in
a serving engine. The "fragmented" policy hands pages out in a scrambled but deterministic order,
one page at a time as a sequence grows, and reuses freed pages first, so page tables of live
sequences are neither contiguous nor ascending; the "contiguous" policy reserves each sequence's
whole run of pages up front. The parity claim is that the policy does not change a single bit.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import torch

from rl_engine.ops.attention import PAGE_SIZE
from rl_engine.runtime.routing import Router

POLICIES = ("fragmented", "contiguous")


def pages_for(tokens: int) -> int:
    return -(-tokens // PAGE_SIZE)


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host bookkeeping (page tables, positions, lengths) as a device tensor, without making the
    host wait: on CUDA it is staged in pinned memory and copied asynchronously (a pageable copy
    may block until the GPU catches up); the caching host allocator keeps the pinned buffer until
    the copy has run."""
    t = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


class BlockManager:
    """Physical page allocator of one cache."""

    def __init__(self, num_pages: int, policy: str = "fragmented"):
        if policy not in POLICIES:
            raise ValueError(f"page policy {policy!r}; use one of {', '.join(POLICIES)}")
        self.num_pages, self.policy = num_pages, policy
        if policy == "fragmented":
            # Descending by two, odd ids first: consecutive grants are never neighbours.
            order = list(range(num_pages - 1, -1, -2)) + list(range(num_pages - 2, -1, -2))
            self._free: collections.deque[int] | set[int] = collections.deque(order)
        else:
            self._free = set(range(num_pages))

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"KV cache exhausted: {n} pages wanted, {len(self._free)} free of "
                               f"{self.num_pages}")
        if self.policy == "fragmented":
            return [self._free.popleft() for _ in range(n)]
        free = sorted(self._free)
        for i in range(len(free) - n + 1):  # first fit of a run of n consecutive pages
            if free[i + n - 1] - free[i] == n - 1:
                run = free[i:i + n]
                self._free.difference_update(run)
                return run
        raise RuntimeError(f"KV cache has no run of {n} contiguous free pages")

    def free(self, pages: list[int]) -> None:
        if self.policy == "fragmented":
            self._free.extendleft(pages)  # most recently freed is granted first
        else:
            self._free.update(pages)


def is_fragmented(pages: list[int]) -> bool:
    """A table that is not one ascending run of consecutive physical pages."""
    return any(b != a + 1 for a, b in zip(pages, pages[1:]))


@dataclass(slots=True)
class SeqSlot:
    """One live sequence's place in the cache: its pages and how many tokens are cached."""
    pages: list[int] = field(default_factory=list)
    cached: int = 0


class PagedKVCache:
    """k/v per layer [num_pages, PAGE_SIZE, Hkv_local, D] and their block manager."""

    def __init__(self, *, layers: int, num_pages: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, policy: str = "fragmented", device="cpu"):
        shape = (num_pages, PAGE_SIZE, kv_heads, head_dim)
        self.device = torch.device(device)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.blocks = BlockManager(num_pages, policy)

    def reserve(self, slot: SeqSlot, tokens: int) -> None:
        """Makes room for `tokens` cached tokens of the slot."""
        need = pages_for(tokens) - len(slot.pages)
        if need > 0:
            slot.pages.extend(self.blocks.allocate(need))

    def release(self, slot: SeqSlot) -> None:
        self.blocks.free(slot.pages)
        slot.pages, slot.cached = [], 0

    def slot_index(self, slots: list[SeqSlot],
                   positions: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(page, offset) of each token to write, slot by slot."""
        page, off = [], []
        for slot, pos in zip(slots, positions):
            page += [slot.pages[p // PAGE_SIZE] for p in pos]
            off += [p % PAGE_SIZE for p in pos]
        return to_device(page, torch.long, self.device), to_device(off, torch.long, self.device)

    def write(self, layer: int, index: tuple[torch.Tensor, torch.Tensor], k, v) -> None:
        self.k[layer][index] = k
        self.v[layer][index] = v

    def block_table(self, slots: list[SeqSlot]) -> torch.Tensor:
        width = max(len(s.pages) for s in slots)
        return to_device([s.pages + [0] * (width - len(s.pages)) for s in slots], torch.int32,
                         self.device)


class PrefillBackend:
    """Whole prompts packed in one varlen call; their k/v land in the cache on the way."""

    def __init__(self, cache: PagedKVCache, router: Router, slots: list[SeqSlot],
                 lengths: list[int], scale: float):
        self.cache, self.router, self.scale = cache, router, scale
        self.index = cache.slot_index(slots, [list(range(n)) for n in lengths])
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        self.cu = to_device(cu, torch.int32, cache.device)
        self.positions = to_device([p for n in lengths for p in range(n)], torch.long, cache.device)

    def attend(self, layer: int, q, k, v):
        self.cache.write(layer, self.index, k, v)
        return self.router.attention("attention", q, k, v, self.cu, self.cu, self.positions,
                                     self.scale)


class DecodeBackend:
    """One new token per live sequence against its pages (position = seq_lens - 1)."""

    def __init__(self, cache: PagedKVCache, router: Router, slots: list[SeqSlot],
                 positions: list[int], scale: float):
        self.cache, self.router, self.scale = cache, router, scale
        self.index = cache.slot_index(slots, [[p] for p in positions])
        self.table = cache.block_table(slots)
        self.positions = to_device(positions, torch.long, cache.device)
        self.seq_lens = to_device([p + 1 for p in positions], torch.int32, cache.device)

    def attend(self, layer: int, q, k, v):
        self.cache.write(layer, self.index, k, v)
        return self.router.attention_decode("attention", q, self.cache.k[layer],
                                            self.cache.v[layer], self.table, self.seq_lens,
                                            self.scale)
