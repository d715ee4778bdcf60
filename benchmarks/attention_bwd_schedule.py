"""A model, not a measurement: how long the attention backward's dk/dv grid would take if each CTA
also added its share of dQ to global memory in a fixed order of key tiles, as a deterministic
fused backward must (one kernel of five products instead of dk/dv's four plus dq's three).

The grid is dk/dv's: one CTA per 128 keys of one kv head, blockIdx = tile * kv_heads + head, taken
by the SMs in that order, one CTA an SM. A CTA walks the query rows its keys are seen by in 64-row
steps, the group's q heads inside each step, one time unit a step. Under a fixed order, the CTA of
key tile j may add step (rows, head)'s dQ only after the tile before it in that order has: it waits
for it, one `flush` unit behind at least. Causal, one sequence, chunks of 128 rows (the benchmark's
8k shape by default):

    python benchmarks/attention_bwd_schedule.py [--tokens 8192 --kv-heads 8 --group 4 --sms 132]

prints the time of each schedule over dk/dv's today (no dQ, no waits):
- `ascending`: the walk as today (from the first row that sees the tile, down the sequence), tiles
  adding in key order. Tile j reaches its first rows when tile j - 1 is still on its own first
  chunk, so tile j starts one chunk's steps behind j - 1, and so on down the wave.
- `descending`: the chunks walked from the last one back (rows inside a chunk as today), tiles
  adding in key order. Every tile starts at the last chunk, so the turns only serialise the flushes.
  dk/dv's chunk partials would then be added from the last chunk back, in the kernel, the CPU kernel
  and the context-parallel reduce alike (today: from the first).
- `last_tile_first`: the walk as today, tiles adding in reverse key order (for the rows of chunk c,
  tile c reaches them first, then c - 1 one chunk later...), which needs the grid launched from the
  last tile (blockIdx = (tiles - 1 - tile) * kv_heads + head) so that a turn never waits on a CTA
  not yet on an SM. The turns then cost nothing, but the SMs take the short tiles first and tile 0's
  long walk last.
A tile's turn can never wait on a tile the SMs take later, so no schedule here can deadlock.
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
from pathlib import Path

STEP_ROWS, KEYS, CHUNK = 64, 128, 128


def walk(tile: int, blocks: int, descending: bool) -> list[int]:
    """The 64-row blocks tile `tile` visits, in order (causal: rows from the tile's own chunk on)."""
    per_chunk = CHUNK // STEP_ROWS
    chunks = range(tile * KEYS // CHUNK, blocks // per_chunk)
    order = reversed(chunks) if descending else chunks
    return [c * per_chunk + r for c in order for r in range(per_chunk)]


def _turn(t: float, done: dict, tile: int, prior: int, tiles: int, kv: int, block: int, q: int,
          flush: float) -> float:
    """When `tile` may add its dQ of (block, q): after `prior`, the tile before it in the order, if
    that one sees these rows (they do not come before its keys). One that sees them but no SM has
    taken yet would never come: a deadlock, which the model raises."""
    if not 0 <= prior < tiles or block * STEP_ROWS // CHUNK < prior * KEYS // CHUNK:
        return t
    if (prior, kv, block, q) not in done:
        raise RuntimeError(f"tile {tile} waits on tile {prior}, not yet launched")
    return max(t, done[(prior, kv, block, q)] + flush)


def makespan(tokens: int, kv_heads: int, group: int, sms: int, order: str | None, flush: float = 0.05) -> float:
    """Time until the last CTA ends; order None: no dQ turns (dk/dv today)."""
    tiles, blocks = tokens // KEYS, tokens // STEP_ROWS
    done: dict[tuple[int, int, int, int], float] = {}  # (tile, head, block, q head) -> its dQ added
    free = [0.0] * sms
    end = 0.0
    last_first = order == "last_tile_first"
    before = 1 if last_first else -1  # the tile whose turn comes just before this one's
    # blockIdx order: the tile whose turn comes first is on an SM or done
    for tile in (reversed(range(tiles)) if last_first else range(tiles)):
        for kv in range(kv_heads):
            t = heapq.heappop(free)
            for block in walk(tile, blocks, order == "descending"):
                for q in range(group):
                    t += 1.0
                    if order is not None:
                        t = _turn(t, done, tile, tile + before, tiles, kv, block, q, flush)
                    done[(tile, kv, block, q)] = t
            end = max(end, t)
            heapq.heappush(free, t)
    return end


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--group", type=int, default=4, help="q heads per kv head")
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--out", type=Path, help="also write the figures as JSON here")
    args = ap.parse_args(argv)
    if args.tokens <= 0 or args.tokens % CHUNK or min(args.kv_heads, args.group, args.sms) <= 0:
        ap.error(f"--tokens must be a positive multiple of {CHUNK}, the others positive")
    shape = dict(tokens=args.tokens, kv_heads=args.kv_heads, group=args.group, sms=args.sms)
    base = makespan(**shape, order=None)
    rows = {order: makespan(**shape, order=order) / base
            for order in ("ascending", "descending", "last_tile_first")}
    print(f"{shape}: dk/dv today {base:.0f} steps")
    for order, ratio in rows.items():
        print(f"  fused dQ, {order}: {ratio:.3f} of that time")
    if args.out:
        from rl_engine.artifacts.files import write_json

        write_json(args.out, dict(kind="model", shape=shape, dkdv_steps=base, fused_over_dkdv=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
