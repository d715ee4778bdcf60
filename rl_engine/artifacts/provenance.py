"""Where the running code came from: the checkout's commit and whether it has local changes."""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

SOURCE_ROOT = Path(__file__).resolve().parents[2]


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(SOURCE_ROOT), *args], capture_output=True,
                             text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


@functools.cache
def source() -> dict[str, object]:
    """{"commit": sha or None, "dirty": bool or None}; cached per process."""
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": None if status is None else bool(status)}
