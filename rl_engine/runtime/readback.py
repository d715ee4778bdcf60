"""Readback records: what a worker actually executed, written by the worker itself.

One file per worker and side, `readbacks/<engine>-<side>-<pid>.json`, tagged with the run id and
the source commit so that a record of another run can never pass as this run's evidence.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from rl_engine.artifacts import files, provenance
from rl_engine.distributed import collectives
from rl_engine.ops import counters
from rl_engine.runtime.routing import Router

ENGINES = ("builtin", "megatron", "vllm")


def readback_path(run_dir: Path, engine: str, side: str, pid: int | None = None) -> Path:
    if engine not in ENGINES:
        raise ValueError(f"engine {engine!r} is not one of {', '.join(ENGINES)}")
    return Path(run_dir) / "readbacks" / f"{engine}-{side}-{pid or os.getpid()}.json"


def kernel_totals() -> dict[str, int]:
    """Launches of every rl_engine kernel in this process, by kernel and backend id."""
    totals: dict[str, int] = {}
    for (kernel, device), n in counters.read().items():
        if n:
            totals[f"{counters.backend_id(kernel, device)}:{kernel}"] = n
    return totals


def write(run_dir: Path, router: Router, *, run_id: str, rank: int,
          extra: dict[str, Any] | None = None) -> Path:
    """Writes (or, on a later flush, replaces) this worker's record atomically."""
    src = provenance.source()
    payload = {
        "run_id": run_id,
        "source_commit": src["commit"],
        "source_dirty": src["dirty"],
        "engine": router.engine,
        "side": router.side,
        "pid": os.getpid(),
        "rank": rank,
        "device": str(router.device),
        "execution_mode": router.plan.mode,
        "plan": router.plan.as_dict(),
        "modules": router.module_records(),
        "kernel_totals": kernel_totals(),
        "collective_calls": dict(sorted(collectives.CALLS.items())),
        "collective_transport": collectives.transport_record(),
        **(extra or {}),
    }
    return files.write_json(readback_path(run_dir, router.engine, router.side), payload)
