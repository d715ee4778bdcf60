"""Bit equality of fp32 log-probs: the one comparison every verdict and every step line uses.

Two log-probs are equal when their bits are equal, so -0.0 differs from 0.0 and a NaN equals only
the same NaN. A non-finite value on either side is counted apart (it fails a run whatever its
bits), and `max_abs_diff` is taken over the pairs where both sides are finite.

It works on numpy arrays, so that judging a run needs no torch (see `artifacts.torchfile`); a
step's torch tensors are viewed as numpy arrays, which changes no bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True, slots=True)
class Comparison:
    numel: int
    mismatch_count: int
    nonfinite_count: int
    max_abs_diff: float
    differs: np.ndarray       # bool, True where the bits differ
    abs_diff: np.ndarray      # |rollout - trainer|, 0 where either side is not finite


def _array(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor, on any device (numpy has no bfloat16: check first)
        if str(x.dtype) != "torch.float32":
            raise ValueError(f"log-probs must be float32, got {x.dtype}")
        x = x.detach().cpu().numpy()
    return np.ascontiguousarray(x)


def compare(rollout: Any, trainer: Any) -> Comparison:
    ro, tr = _array(rollout), _array(trainer)
    if ro.dtype != np.float32 or tr.dtype != np.float32:
        raise ValueError(f"log-probs must be float32, got {ro.dtype} and {tr.dtype}")
    if ro.shape != tr.shape:
        raise ValueError(f"rollout {tuple(ro.shape)} and trainer {tuple(tr.shape)} differ in shape")
    differs = ro.view(np.int32) != tr.view(np.int32)
    finite = np.isfinite(ro) & np.isfinite(tr)
    with np.errstate(invalid="ignore", over="ignore"):
        abs_diff = np.where(finite, np.abs(ro - tr), np.float32(0.0)).astype(np.float32)
    return Comparison(numel=int(ro.size), mismatch_count=int(differs.sum()),
                      nonfinite_count=int((~finite).sum()),
                      max_abs_diff=float(abs_diff.max()) if abs_diff.size else 0.0,
                      differs=differs, abs_diff=abs_diff)
