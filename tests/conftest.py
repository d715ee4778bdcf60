"""Fixtures shared by the test suites."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def rl_ops():
    """torch.ops.rl_engine with the fake kernels registered. An unbuilt extension is an error that
    says how to build it, never a skip."""
    import rl_engine.ops  # noqa: F401  (registers the fake kernels)
    from rl_engine.ops import _lib

    return _lib.ops()


@pytest.fixture
def with_threads():
    """with_threads(n, fn) runs fn() under torch.set_num_threads(n) and restores the old count."""

    def run(n, fn):
        before = torch.get_num_threads()
        torch.set_num_threads(n)
        try:
            return fn()
        finally:
            torch.set_num_threads(before)

    return run
