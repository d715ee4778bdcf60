"""`rlk matrix analyze`: the verdict of every cell from its attempt folders, and of the matrix.

A cell is judged by its latest attempt; older attempts are listed and judged the same way but never
count. Each attempt is judged by `evidence.judge` as a finished matrix attempt (its case file, exit
code, run log, manifest, one readback per rank and side, train data and recorded verdict must all be
there and agree). A cell with no finished attempt is `pending` while the matrix may still run it
(an analysis that is not final) and `failed` once it is final.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from rl_engine import errors
from rl_engine.artifacts import files
from rl_engine.evidence import judge, records
from rl_engine.evidence.layout import MatrixRoot, RunDir
from rl_engine.runtime.plan import ALL_CELLS, ISOLATION_CELLS, MODULES, cell_plan

REPORT_SCHEMA_VERSION = 2


def matrix_id(root: Path) -> str:
    from rl_engine.artifacts import ids

    try:
        return str(files.read_json(MatrixRoot(root).matrix_file)["matrix_id"])
    except (OSError, ValueError, KeyError, TypeError):
        return ids.sanitize(Path(root).resolve().name)


def check_root(root: Path) -> None:
    """A matrix root holds matrix.json or a cell's folder; anything else is refused before a
    report is written into it."""
    if not root.is_dir():
        raise errors.BadInput(f"matrix root {root} does not exist; give the --matrix-root that "
                              "rlk matrix run wrote")
    cells = MatrixRoot(root)
    if not cells.matrix_file.is_file() and not any(cells.cell(c).is_dir() for c in ALL_CELLS):
        raise errors.BadInput(f"{root} is not a matrix root: it holds neither "
                              f"{cells.matrix_file.name} nor a cell's folder; give the "
                              "--matrix-root that rlk matrix run wrote")


def run_id_of(mid: str, cell: str, attempt: str) -> str:
    return f"{mid}-{cell}-{attempt}"


def attempts(root: Path, cell: str) -> list[Path]:
    """The cell's attempt folders, oldest first (attempt ids sort by time)."""
    return MatrixRoot(root).attempts(cell)


def _mtime(path: Path) -> str | None:
    try:
        return datetime.fromtimestamp(path.stat().st_mtime, timezone.utc).isoformat(timespec="milliseconds")
    except OSError:
        return None


def _seconds(start: str | None, end: str | None) -> float | None:
    try:
        return round((datetime.fromisoformat(end) - datetime.fromisoformat(start)).total_seconds(), 3)
    except (TypeError, ValueError):
        return None


def _row(cell: str, mid: str) -> dict[str, Any]:
    plan = cell_plan(cell)
    return {"cell": cell, "attempt_id": None, "latest": False, "matrix_id": mid, "run_id": None,
            "plan_attention": plan.attention, "plan_ffn": plan.ffn, "plan_logp": plan.logp,
            "state": "failed", "exit_code": None, "traceback": False, "complete": False,
            "evidence_complete": False, "bitwise": False, "bitwise_required": cell == "control",
            "passed": False, "numel": 0, "expected_numel": None, "mismatch_count": 0,
            "nonfinite_count": 0, "max_abs_diff": 0.0, "first_step": None, "first_sample": None,
            "first_position": None, "validation_passed": None, "started_at": None,
            "finished_at": None, "duration_s": None, "source_commit": None, "worker_commits": [],
            "fallbacks": [], "sides": {}, "reasons": [], "_tokens": []}


def inspect_attempt(folder: Path, cell: str, mid: str) -> dict[str, Any]:
    """One attempt's row: what ran, what it compared, its verdict and the reasons against it.
    The token rows travel under the private key `_tokens`."""
    run = RunDir(folder)
    row = _row(cell, mid)
    run_id = run_id_of(mid, cell, run.root.name)
    v = judge.judge(run, expect=judge.Expect(run_id=run_id, plan=cell_plan(cell), finished=True,
                                             matrix_attempt=True))
    try:
        recorded = files.read_json(run.validation)
    except (OSError, ValueError):
        recorded = None
    first = v.first_mismatch or {}
    row.update(
        attempt_id=run.root.name, run_id=run_id, exit_code=v.run_exit_code,
        traceback=any("traceback" in p for p in v.problems),
        complete=v.run_exit_code is not None and recorded is not None,
        evidence_complete=v.evidence_complete, bitwise=v.bitwise, passed=v.passed,
        state="passed" if v.passed else "failed", numel=v.numel, expected_numel=v.expected_numel,
        mismatch_count=v.mismatch_count, nonfinite_count=v.nonfinite_count,
        max_abs_diff=v.max_abs_diff, first_step=first.get("step"), first_sample=first.get("sample"),
        first_position=first.get("position"),
        validation_passed=bool(recorded.get("passed")) if isinstance(recorded, dict) else None,
        started_at=v.case.get("STARTED_AT") or None, finished_at=_mtime(run.exit_code),
        source_commit=v.case.get("SOURCE_COMMIT") or v.source_commit,
        worker_commits=v.worker_commits, fallbacks=v.fallbacks, sides=v.sides,
        reasons=v.problems + [f"{f['side']} {f['module']} rank {f['rank']} fell back: {f['reason']}"
                              for f in v.fallbacks],
        _tokens=v.tokens)
    row["duration_s"] = _seconds(row["started_at"], row["finished_at"])
    return row


def _missing(cell: str, mid: str, root: Path) -> dict[str, Any]:
    return {**_row(cell, mid), "latest": True, "reasons": [f"no attempt of cell {cell} in {root}"]}


def analyze_cell(root: Path, cell: str, mid: str, *, final: bool = True) -> dict[str, Any]:
    """{"cell", verdict fields, "state", "latest": row, "attempts": older rows, newest first}."""
    rows = []
    for folder in reversed(attempts(root, cell)):
        try:
            rows.append(inspect_attempt(folder, cell, mid))
        except Exception as exc:  # noqa: BLE001 - one broken attempt must not hide the others
            row = _missing(cell, mid, root)
            row.update(attempt_id=folder.name, latest=False,
                       reasons=[f"analysis failed: {records.short(exc)}"])
            rows.append(row)
    if not rows:
        rows.append(_missing(cell, mid, root))
    rows[0]["latest"] = True
    for older in rows[1:]:
        older.pop("_tokens", None)
    latest = rows[0]
    if not final and latest["exit_code"] is None and not latest["passed"]:
        latest["state"] = "pending"
        latest["reasons"] = [f"pending: cell {cell} has no finished attempt yet", *latest["reasons"]]
    return {"cell": cell, **{k: latest[k] for k in ("evidence_complete", "bitwise",
                                                    "bitwise_required", "passed", "state")},
            "reasons": latest["reasons"], "latest": latest, "attempts": rows[1:]}


def expected_cells(root: Path, baseline: bool = False) -> list[str]:
    cells = ["control", *ISOLATION_CELLS]
    if baseline or (Path(root) / "baseline").is_dir():
        cells.append("baseline")
    return cells


def verdict(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """The matrix verdict over these cells: every cell passed."""
    complete = all(c["evidence_complete"] for c in cells)
    required = [c for c in cells if c["bitwise_required"]]
    passed = bool(cells) and all(c["passed"] for c in cells)
    refused = [c["cell"] for c in cells if c["latest"]["exit_code"] == errors.BAD_INPUT]
    # A refused input is the answer that must be fixed first (no retry changes it), then missing
    # evidence (retried), then a parity failure.
    code = (errors.BAD_INPUT if refused else errors.INFRASTRUCTURE if not complete
            else errors.OK if passed else errors.PARITY_FAILURE)
    return {"evidence_complete": complete, "bitwise": all(c["bitwise"] for c in required),
            "bitwise_required": bool(required), "passed": passed, "exit_code": code,
            "failed_cells": [c["cell"] for c in cells if c["state"] == "failed"],
            "pending_cells": [c["cell"] for c in cells if c["state"] == "pending"],
            "incomplete_cells": [c["cell"] for c in cells if not c["evidence_complete"]],
            "bad_input_cells": refused}


def analyze(root: Path, *, cells: list[str] | None = None, baseline: bool = False,
            final: bool = True) -> dict[str, Any]:
    """The matrix report; the latest attempts' token rows travel under `_tokens` (not in JSON).
    Not final: a cell without a finished attempt is pending, not failed."""
    from rl_engine.matrix.attribution import attribute

    root = Path(root)
    check_root(root)
    mid = matrix_id(root)
    names = [c for c in ALL_CELLS if c in set(cells)] if cells else expected_cells(root, baseline)
    results = [analyze_cell(root, c, mid, final=final) for c in names]
    tokens = {r["cell"]: r["latest"].pop("_tokens", []) for r in results}
    try:
        created = files.read_json(MatrixRoot(root).matrix_file).get("created_at")
    except (OSError, ValueError, AttributeError):
        created = None
    return {"schema_version": REPORT_SCHEMA_VERSION, "kind": "rlk.matrix-report",
            "matrix_id": mid, "matrix_root": str(root), "created_at": created,
            "generated_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "modules": list(MODULES), "verdict": verdict(results), "cells": results,
            "attribution": attribute({r["cell"]: r for r in results}), "_tokens": tokens}


def write_report(root: Path, output: Path | None = None, **kwargs) -> dict[str, Any]:
    """Analyzes root and writes matrix-report.json, cells.parquet and tokens.parquet beside it."""
    from rl_engine.matrix import tables

    report = analyze(root, **kwargs)
    tokens = report.pop("_tokens")
    out = Path(output) if output else MatrixRoot(root).report
    cells_path, tokens_path = MatrixRoot.tables_beside(out)
    rows = [row for c in report["cells"] for row in (c["latest"], *c["attempts"])]
    report["tables"] = {"cells": str(cells_path), "cell_rows": len(rows), "tokens": str(tokens_path),
                        "token_rows": sum(len(t) for t in tokens.values())}
    tables.write_cells(cells_path, rows)
    tables.write_tokens(tokens_path, report["cells"], tokens)
    files.write_text(out, json.dumps(report, indent=2, default=str) + "\n")
    return report
