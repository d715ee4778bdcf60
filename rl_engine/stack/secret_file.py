"""Files only their owner may read (tokens, passwords), written atomically.

The temporary file is created with mode 0600 (never wider, not even for an instant) next to its
target, flushed to disk, then renamed over it, so a reader sees the old content or the new, never
a part, and never a file others can read.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write(path: Path, text: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # mkstemp: mode 0600
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
