"""Loads the compiled extension once. Importing rl_engine._C only registers the ops with the
dispatcher; they are then reached as torch.ops.rl_engine.<name>."""

from __future__ import annotations

import functools

import torch


class ExtensionUnavailable(RuntimeError):
    """rl_engine._C could not be imported; the message says how to build it."""


@functools.cache
def load() -> None:
    try:
        from rl_engine import _C  # noqa: F401
    except ImportError as exc:
        raise ExtensionUnavailable(
            f"rl_engine._C is not built or does not load ({exc}); build it with "
            "`pip install --no-build-isolation -e .` in this checkout"
        ) from exc


def available() -> bool:
    try:
        load()
    except ExtensionUnavailable:
        return False
    return True


def ops():
    load()
    return torch.ops.rl_engine
