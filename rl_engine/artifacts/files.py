"""Atomic writes: a reader sees the old file or the whole new one, never half of one."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

SCHEMA_VERSION = 1


def atomic_write(path: Path, write: Callable[[Path], None]) -> Path:
    """Runs write(tmp) on a temporary file beside path, fsyncs it, then renames it onto path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; evidence and results are for every reader
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_text(path: Path, text: str) -> Path:
    return atomic_write(path, lambda tmp: tmp.write_text(text))


def write_json(path: Path, payload: dict[str, Any]) -> Path:
    """Writes payload (schema_version added when absent) as indented JSON, atomically."""
    body = {"schema_version": SCHEMA_VERSION, **payload}
    return write_text(path, json.dumps(body, indent=2, sort_keys=False, default=str) + "\n")


def write_torch(path: Path, obj: Any) -> Path:
    import torch

    return atomic_write(path, lambda tmp: torch.save(obj, tmp))


def read_json(path: Path) -> dict[str, Any]:
    with open(path) as fh:
        return json.load(fh)
