"""`rlk gate archive`: one JSON, `<gate-dir>/gate-archive.json`, with every step's result, the run
directories' manifests, the commits and the environment, and the gate's overall verdict.

The gate passes when every step passed (or was skipped on purpose) and every run ran the clean
checkout: each manifest's source commit is the checkout step's commit, with no local changes.
"""

from __future__ import annotations

import importlib.metadata
import platform
import sys
from pathlib import Path
from typing import Any, Sequence

from rl_engine import errors
from rl_engine.artifacts import files
from rl_engine.errors import BadInput
from rl_engine.gate import RUN_STEPS, STEPS
from rl_engine.evidence.layout import MatrixRoot, RunDir
from rl_engine.gate.steps import Result, fail, ok

ARCHIVE = "gate-archive.json"


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return files.read_json(path)
    except (OSError, ValueError):
        return None


def _matrix_result(root: Path) -> dict[str, Any] | None:
    """The matrix step's result from a matrix root's report (the DAG runs the matrix as a DAG)."""
    path = MatrixRoot(root).report
    report = _read(path)
    if report is None:
        return None
    v = report["verdict"]
    return {"step": "matrix", "passed": bool(v["passed"]), "exit_code": v["exit_code"],
            "reason": "" if v["passed"] else (f"matrix verdict failed: failed cells {v.get('failed_cells')}"
                                              f", incomplete {v.get('incomplete_cells')}"),
            "details": {"matrix_root": str(root), "verdict": v}, "source": str(path)}


def _manifests(gate_dir: Path, matrix_roots: Sequence[Path]) -> dict[str, dict[str, Any]]:
    out = {}
    for step in RUN_STEPS:
        if (m := _read(RunDir(gate_dir / step).manifest)) is not None:
            out[step] = m
    for root in map(MatrixRoot, matrix_roots):
        for cell in sorted(p.name for p in root.root.iterdir() if p.is_dir()) if root.root.is_dir() else []:
            for attempt in root.attempts(cell):
                if (m := _read(RunDir(attempt).manifest)) is not None:
                    out[f"matrix/{cell}/{attempt.name}"] = m
    return out


def environment() -> dict[str, Any]:
    import torch

    freeze = sorted(f"{d.metadata['Name']}=={d.version}" for d in importlib.metadata.distributions()
                    if d.metadata["Name"])
    return {"python": sys.version.split()[0], "executable": sys.executable,
            "platform": platform.platform(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "pip_freeze": freeze}


def build(gate_dir: Path, *, matrix_root: Path | None = None, skip: Sequence[str] = ()) -> Result:
    """Writes gate-archive.json and returns the gate's verdict: the first failed step's exit code
    and reason, 3 when a step left no result, 2 when a run did not run the clean checkout."""
    gate_dir = Path(gate_dir)
    unknown = set(skip) - set(STEPS[:-1])
    if unknown:
        raise BadInput(f"--skip {sorted(unknown)}: steps are {', '.join(STEPS[:-1])}")
    if matrix_root is not None and not Path(matrix_root).is_dir():
        raise BadInput(f"--matrix-root {matrix_root} does not exist")
    steps: dict[str, dict[str, Any] | None] = {}
    for step in STEPS[:-1]:
        if step in skip:
            steps[step] = {"step": step, "skipped": True}
        elif (result := _read(gate_dir / f"{step}.json")) is not None:
            steps[step] = result
        elif step == "matrix" and matrix_root is not None:
            steps[step] = _matrix_result(Path(matrix_root))
        else:
            steps[step] = None
    roots = list(dict.fromkeys(p.resolve() for p in (gate_dir / "matrix", matrix_root)
                               if p is not None and Path(p).is_dir()))
    manifests = _manifests(gate_dir, roots)
    checkout = ((steps.get("checkout") or {}).get("details") or {})
    pinned = checkout.get("commit")
    runs = {name: {"source_commit": m.get("source_commit"), "source_dirty": m.get("source_dirty")}
            for name, m in manifests.items()}
    provenance = [f"{name} ran commit {r['source_commit']} (dirty={r['source_dirty']}), not the clean "
                  f"checkout {pinned}" for name, r in runs.items()
                  if pinned and (r["source_commit"] != pinned or r["source_dirty"] is not False)]
    missing = [s for s, r in steps.items() if r is None]
    skipped = [s for s, r in steps.items() if r and r.get("skipped")]
    failed = [s for s, r in steps.items() if r and not r.get("skipped") and not r.get("passed")]
    if failed:
        first = steps[failed[0]]
        code = first.get("exit_code") or errors.INFRASTRUCTURE
        result = fail(code, f"step {failed[0]} failed (exit {code}): {first.get('reason')}")
    elif missing:
        result = fail(errors.INFRASTRUCTURE, f"steps {', '.join(missing)} left no result in {gate_dir}")
    elif provenance:
        result = fail(errors.BAD_INPUT, provenance[0])
    else:
        result = ok()
    path = gate_dir / ARCHIVE
    files.write_json(path, {
        "step": "archive", "gate_dir": str(gate_dir), "passed": result.passed,
        "exit_code": result.exit_code, "reason": result.reason, "failed_steps": failed,
        "missing_steps": missing, "skipped_steps": skipped,
        "commits": {"repo": checkout.get("repo"), "checkout": pinned, "runs": runs},
        "provenance_problems": provenance, "environment": environment(), "steps": steps,
        "manifests": manifests,
    })
    result.details = {"archive": str(path), "failed_steps": failed, "missing_steps": missing,
                      "skipped_steps": skipped, "provenance_problems": provenance}
    return result
