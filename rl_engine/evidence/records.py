"""The records of a run directory: their writers and readers.

Readbacks are written by each worker itself, one file per rank and side, rewritten atomically after
every step: the record keeps what the rank executed in each step (`steps`) and in total
(`modules`), tagged with the run id and the source commit so that a record of another run or
another checkout can never pass as this run's evidence. Readers return what they could read and
append a named problem for what they could not.

Readers and the case file need no torch: the matrix runner writes a case file and judges finished
runs, and torch (with the kernels' library) is imported only by the functions that need it, the
readback writer (in a worker, where it is loaded already) and the train-data reader.
"""

from __future__ import annotations

import collections
import json
import os
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rl_engine.artifacts import files, provenance
from rl_engine.evidence import layout
from rl_engine.runtime.plan import MODULES, Plan

if TYPE_CHECKING:
    from rl_engine.runtime.routing import Router

READBACK_SCHEMA = 2

# What this process last wrote for each readback file: (router id, cumulative call counts per
# module), so the next write records the step's own counts as the difference.
_written: dict[Path, tuple[int, dict[str, collections.Counter]]] = {}


def short(exc: BaseException) -> str:
    """An exception as one short line: its type and the first line of its message."""
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first[:160]}"


def kernel_totals() -> dict[str, int]:
    """Launches of every rl_engine kernel in this process, by kernel and backend id."""
    from rl_engine.ops import counters

    return {f"{counters.backend_id(kernel, device)}:{kernel}": n
            for (kernel, device), n in counters.read().items() if n}


def _step_modules(path: Path, router: Router) -> list[dict[str, Any]]:
    """The router's module records with the call counts made since this file was last written."""
    cumulative = {r.module: collections.Counter(r.call_counts) for r in router.records.values()}
    owner, before = _written.get(path, (None, {}))
    if owner != id(router):
        before = {}
    _written[path] = (id(router), cumulative)
    out = []
    for record in router.module_records():
        counts = cumulative[record["module"]] - before.get(record["module"], collections.Counter())
        out.append({**record, "call_counts": dict(sorted(counts.items())), "backend_ids": sorted(counts)})
    return out


def _earlier_steps(path: Path, run_id: str, step: int) -> list[dict[str, Any]]:
    """Steps an earlier process of the same rank wrote into this file for this run."""
    try:
        body = files.read_json(path)
    except (OSError, ValueError):
        return []
    if not isinstance(body, dict) or body.get("run_id") != run_id:
        return []
    return [s for s in body.get("steps", []) if isinstance(s, dict) and s.get("step") != step]


def _totals(steps: list[dict[str, Any]], router: Router) -> list[dict[str, Any]]:
    out = []
    for record in router.module_records():
        total: collections.Counter = collections.Counter()
        for s in steps:
            for m in s["modules"]:
                if m.get("module") == record["module"]:
                    total.update(m.get("call_counts") or {})
        out.append({**record, "call_counts": dict(sorted(total.items())), "backend_ids": sorted(total)})
    return out


def write_readback(run: layout.RunDir, router: Router, *, run_id: str, rank: int, world_size: int,
                   step: int, extra: dict[str, Any] | None = None) -> Path:
    """Writes (after a later step, replaces) this rank's record atomically."""
    from rl_engine.distributed import collectives

    path = run.readback_file(router.engine, router.side, rank)
    current = {"step": step, "modules": _step_modules(path, router)}
    steps = sorted([*_earlier_steps(path, run_id, step), current], key=lambda s: s["step"])
    src = provenance.source()
    payload = {
        "schema_version": READBACK_SCHEMA,
        "run_id": run_id, "source_commit": src["commit"], "source_dirty": src["dirty"],
        "engine": router.engine, "side": router.side, "rank": rank, "world_size": world_size,
        "pid": os.getpid(), "device": str(router.device), "execution_mode": router.plan.mode,
        "plan": router.plan.as_dict(), "steps": steps, "modules": _totals(steps, router),
        "kernel_totals": kernel_totals(),
        "collective_calls": dict(sorted(collectives.CALLS.items())),
        "collective_transport": collectives.transport_record(),
        **(extra or {}),
    }
    return files.write_json(path, payload)


def read_readbacks(run: layout.RunDir, problems: list[str]) -> dict[str, dict[str, Any]]:
    """{file name: record} of every readback file; a malformed one is a named problem."""
    out = {}
    for path in sorted(run.readbacks.glob("*")) if run.readbacks.is_dir() else []:
        try:
            body = json.loads(path.read_text())
            if not isinstance(body, dict) or not isinstance(body.get("modules", []), list) \
                    or not isinstance(body.get("steps", []), list):
                raise ValueError("not a readback record")
        except (OSError, ValueError) as exc:
            problems.append(f"readback {path.name} is malformed: {short(exc)}")
            continue
        out[path.name] = body
    return out


# -- matrix-case.env ------------------------------------------------------------------------------
def write_case_env(run: layout.RunDir, values: dict[str, Any]) -> Path:
    return files.write_text(run.case_env, "".join(f"{k}={shlex.quote(str(v))}\n"
                                                  for k, v in values.items()))


def read_case_env(run: layout.RunDir, problems: list[str]) -> dict[str, str]:
    """KEY=value lines (shell-quoted values), as write_case_env writes them."""
    try:
        text = run.case_env.read_text()
    except OSError:
        problems.append(f"no {layout.CASE_ENV} (the matrix runner writes it before the run starts)")
        return {}
    out = {}
    for n, line in enumerate(text.splitlines(), 1):
        key, sep, raw = line.partition("=")
        try:
            value = shlex.split(raw)
        except ValueError:
            value = None
        if not sep or not key.isidentifier() or value is None or len(value) > 1:
            problems.append(f"{layout.CASE_ENV} line {n} is malformed: {line[:80]!r}")
            continue
        out[key] = value[0] if value else ""
    return out


def case_plan(case: dict[str, str]) -> Plan | None:
    try:
        return Plan(**{m: case[f"RL_KERNEL_{m.upper()}_CASE"] for m in MODULES},
                    mode=case.get("RLK_MODE", "strict"))
    except (KeyError, ValueError):
        return None


# -- train data -----------------------------------------------------------------------------------
def write_train_data(run: layout.RunDir, *, run_id: str, step: int, rank: int,
                     payload: dict[str, Any]) -> Path:
    """One DP replica's compared log-probs of one step, named by the replica's first rank."""
    rollout = layout.rollout_id(step)
    return files.write_torch(run.train_data_file(rollout, rank),
                             {"run_id": run_id, "rollout_id": rollout, "step": step, **payload})


def read_train_data(run: layout.RunDir, problems: list[str]) -> list[dict[str, Any]]:
    """Every train-data file that loads and has consistent shapes, with `_file`; its tensors as
    numpy arrays (read without torch, see `artifacts.torchfile`)."""
    import numpy as np

    from rl_engine.artifacts import torchfile

    out = []
    paths = sorted(run.train_data.glob("*")) if run.train_data.is_dir() else []
    for path in paths:
        if not layout.TRAIN_DATA_NAME.fullmatch(path.name):
            problems.append(f"train data {path.name} is not named <rollout-id>.rank<r>.pt")
            continue
        try:
            d = torchfile.load(path)
            ro, tr = d["rollout_logprobs"], d["trainer_logprobs"]
            if ro.dtype != np.float32 or tr.dtype != np.float32:
                raise ValueError(f"log-probs are {ro.dtype} / {tr.dtype}, not float32")
            if ro.ndim != 2 or ro.shape != tr.shape or d["positions"].shape != ro.shape \
                    or d["sample_ids"].shape != ro.shape[:1]:
                raise ValueError(f"shapes rollout {tuple(ro.shape)}, trainer {tuple(tr.shape)}, "
                                 f"positions {tuple(d['positions'].shape)}, "
                                 f"samples {tuple(d['sample_ids'].shape)}")
            int(d["step"])
        except Exception as exc:  # noqa: BLE001 - any unreadable file is a named problem
            problems.append(f"train data {path.name} is malformed: {short(exc)}")
            continue
        out.append({**d, "_file": path.name})
    return out
