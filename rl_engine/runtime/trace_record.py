"""`record(trace_dir)`: profile the block and leave a Chrome trace in trace_dir for the trace check.

`rlk run --trace` wraps each worker in it; without a folder it records nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Iterator

from rl_engine.artifacts import files

log = logging.getLogger("rl_engine.trace")


@contextlib.contextmanager
def record(trace_dir: Path | None, *, name: str = "worker") -> Iterator[Path | None]:
    """Yields the path the trace will be written to (`<name>-<pid>.json`), or None when off.

    The trace is written also when the block raises, so a failed worker still leaves the launches
    it made; a failure to write it is logged, never raised over the block's own error.
    """
    if trace_dir is None:
        yield None
        return
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    path = Path(trace_dir) / f"{name}-{os.getpid()}.json"
    prof = profile(activities=activities)
    prof.start()
    ok = False
    try:
        yield path
        ok = True
    finally:
        prof.stop()
        try:
            # export_chrome_trace wants a name ending in .json to write plain JSON.
            files.atomic_write(path, lambda tmp: prof.export_chrome_trace(str(tmp)))
        except Exception as exc:  # noqa: BLE001 - see the docstring
            if ok:
                raise
            log.error("could not write trace %s: %s", path, exc)
