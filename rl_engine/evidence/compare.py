"""Bit equality of fp32 log-probs: the one comparison every verdict and every step line uses.

Two log-probs are equal when their bits are equal, so -0.0 differs from 0.0 and a NaN equals only
the same NaN. A non-finite value on either side is counted apart (it fails a run whatever its
bits), and `max_abs_diff` is taken over the pairs where both sides are finite.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads with the first comparison, not with the verdict's modules
    import torch


@dataclass(frozen=True, slots=True)
class Comparison:
    numel: int
    mismatch_count: int
    nonfinite_count: int
    max_abs_diff: float
    differs: torch.Tensor       # bool, True where the bits differ
    abs_diff: torch.Tensor      # |rollout - trainer|, 0 where either side is not finite


def compare(rollout: torch.Tensor, trainer: torch.Tensor) -> Comparison:
    import torch

    if rollout.dtype != torch.float32 or trainer.dtype != torch.float32:
        raise ValueError(f"log-probs must be float32, got {rollout.dtype} and {trainer.dtype}")
    if rollout.shape != trainer.shape:
        raise ValueError(f"rollout {tuple(rollout.shape)} and trainer {tuple(trainer.shape)} differ in shape")
    ro, tr = rollout.detach().cpu().contiguous(), trainer.detach().cpu().contiguous()
    differs = ro.view(torch.int32) != tr.view(torch.int32)
    finite = torch.isfinite(ro) & torch.isfinite(tr)
    abs_diff = torch.where(finite, (ro - tr).abs(), torch.zeros_like(ro))
    return Comparison(numel=ro.numel(), mismatch_count=int(differs.sum()),
                      nonfinite_count=int((~finite).sum()),
                      max_abs_diff=float(abs_diff.max()) if abs_diff.numel() else 0.0,
                      differs=differs, abs_diff=abs_diff)
