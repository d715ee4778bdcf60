"""Seeded random tensors for the tests: the same values on every run, in every test module."""

from __future__ import annotations

import torch


def randn(*shape, seed: int = 0, dtype: torch.dtype = torch.float32, scale: float = 1.0,
          device: str = "cpu") -> torch.Tensor:
    """Standard normal values from a generator seeded with `seed` on `device`, times scale, then
    rounded once to dtype."""
    g = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)
