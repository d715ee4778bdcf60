"""`rlk matrix analyze`: the verdict of every cell from its attempt folders, and of the matrix.

A cell is judged by its latest attempt; older attempts are listed and judged the same way but never
count. An attempt's evidence is complete when the run finished (exit-code, run.log, no traceback),
both sides executed the requested plan (readbacks of this run id, every module with launches of the
expected backends, no fallback), the train-data of this run id hold the workload's numel, and
bitwise-validation.json agrees with them. Verdict fields as in every report: evidence_complete,
bitwise, bitwise_required (the control only), passed.
"""

from __future__ import annotations

import json
import re
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from rl_engine import errors
from rl_engine.artifacts import files
from rl_engine.matrix import evidence
from rl_engine.runtime.plan import ALL_CELLS, ISOLATION_CELLS, MODULES, cell_plan

REPORT_SCHEMA_VERSION = 1
REPORT = "matrix-report.json"
MATRIX_FILE = "matrix.json"
ATTEMPT_ID = re.compile(r"\d{8}T\d{6}Z-[0-9a-f]{6}")
_TRACEBACK = "Traceback (most recent call last)"


def matrix_id(root: Path) -> str:
    from rl_engine.artifacts import ids

    try:
        return str(files.read_json(Path(root) / MATRIX_FILE)["matrix_id"])
    except (OSError, ValueError, KeyError, TypeError):
        return ids.sanitize(Path(root).resolve().name)


def run_id_of(mid: str, cell: str, attempt: str) -> str:
    return f"{mid}-{cell}-{attempt}"


def attempts(root: Path, cell: str) -> list[Path]:
    """The cell's attempt folders, oldest first (attempt ids sort by time)."""
    folder = Path(root) / cell
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.is_dir() and ATTEMPT_ID.fullmatch(p.name))


def _read_exit_code(path: Path, problems: list[str]) -> int | None:
    try:
        return int(path.read_text().strip())
    except FileNotFoundError:
        problems.append("no exit-code: the run did not finish")
    except (OSError, ValueError):
        problems.append("exit-code is malformed")
    return None


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


def inspect_attempt(folder: Path, cell: str, mid: str) -> dict[str, Any]:
    """One attempt's row: what ran, what it compared, its verdict and the reasons against it.
    The token rows travel under the private key `_tokens`."""
    folder = Path(folder)
    plan = cell_plan(cell)
    problems: list[str] = []
    row: dict[str, Any] = {
        "cell": cell, "attempt_id": folder.name, "latest": False, "matrix_id": mid,
        "run_id": run_id_of(mid, cell, folder.name), "plan_attention": plan.attention,
        "plan_ffn": plan.ffn, "plan_logp": plan.logp, "exit_code": None, "traceback": False,
        "complete": False, "numel": 0, "expected_numel": None, "mismatch_count": 0,
        "max_abs_diff": 0.0, "first_step": None, "first_sample": None, "first_position": None,
        "validation_passed": None, "started_at": None, "finished_at": None, "duration_s": None,
        "source_commit": None, "worker_commits": [], "sides": {}, "_tokens": []}
    case = evidence.read_case_env(folder / evidence.CASE_ENV, problems)
    if case:
        if case.get("RL_KERNEL_RUN_ID") != row["run_id"]:
            problems.append(f"{evidence.CASE_ENV} names run {case.get('RL_KERNEL_RUN_ID')!r}, "
                            f"this attempt is run {row['run_id']!r}")
        asked = evidence.case_plan(case)
        if asked is None:
            problems.append(f"{evidence.CASE_ENV} lacks a valid plan (RL_KERNEL_*_CASE)")
        elif asked != plan:
            problems.append(f"{evidence.CASE_ENV} requests plan {asked.as_dict()}, "
                            f"cell {cell} is {plan.as_dict()}")
        row["source_commit"] = case.get("SOURCE_COMMIT") or None
        row["started_at"] = case.get("STARTED_AT") or None
        if case.get("EXPECTED_NUMEL", "").isdigit():
            row["expected_numel"] = int(case["EXPECTED_NUMEL"])
    run_id = row["run_id"]
    row["exit_code"] = _read_exit_code(folder / "exit-code", problems)
    row["finished_at"] = _mtime(folder / "exit-code")
    row["duration_s"] = _seconds(row["started_at"], row["finished_at"])
    has_log = (folder / "run.log").is_file()
    if not has_log:
        problems.append("no run.log")
    for name in ("run.log", evidence.CONSOLE_LOG):
        try:
            if _TRACEBACK in (folder / name).read_text(errors="replace"):
                row["traceback"] = True
                problems.append(f"{name} holds a traceback")
        except OSError:
            pass
    try:
        man = files.read_json(folder / "manifest.json")
        if man.get("run_id") != run_id:
            problems.append(f"manifest.json is of run {man.get('run_id')!r}, not {run_id!r}")
        layout = man.get("layout") or {}
        if row["expected_numel"] is None and layout.get("numel_per_step"):
            row["expected_numel"] = int(layout["numel_per_step"]) * int(layout.get("steps", 1))
    except FileNotFoundError:
        problems.append("no manifest.json")
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        problems.append(f"manifest.json is malformed: {evidence.short(exc)}")

    records = evidence.read_readbacks(folder / "readbacks", problems)
    for r in records:
        if r.get("run_id") != run_id:
            problems.append(f"readback {r['_file']} is of run {r.get('run_id')!r}, not {run_id!r}")
        if r.get("plan") is not None and r.get("plan") != plan.as_dict():
            problems.append(f"readback {r['_file']} ran plan {r.get('plan')}, not {plan.as_dict()}")
    mine = [r for r in records if r.get("run_id") == run_id]
    row["sides"] = evidence.check_sides(mine, plan, problems)
    row["worker_commits"] = sorted({str(r.get("source_commit")) for r in mine})

    data = evidence.read_train_data(folder / "train-data", run_id, problems)
    row.update(numel=data["numel"], mismatch_count=data["mismatch_count"],
               max_abs_diff=data["max_abs_diff"], _tokens=data["tokens"])
    if data["first"]:
        row.update(first_step=data["first"]["step"], first_sample=data["first"]["sample"],
                   first_position=data["first"]["position"])
    if row["expected_numel"] is None:
        problems.append("the workload's numel is unknown (no matrix-case.env or manifest layout)")
    elif data["numel"] != row["expected_numel"]:
        problems.append(f"compared {data['numel']} log-probs, the workload expects {row['expected_numel']}")

    validation = None
    try:
        validation = files.read_json(folder / "bitwise-validation.json")
        row["validation_passed"] = bool(validation.get("passed"))
        if validation.get("run_id") != run_id:
            problems.append(f"bitwise-validation.json is of run {validation.get('run_id')!r}")
        for key in ("numel", "mismatch_count"):
            if validation.get(key) != data[key]:
                problems.append(f"bitwise-validation.json reports {key}={validation.get(key)}, "
                                f"the train-data hold {data[key]}")
    except FileNotFoundError:
        problems.append("no bitwise-validation.json")
    except (OSError, ValueError, AttributeError) as exc:
        validation = None
        problems.append(f"bitwise-validation.json is malformed: {evidence.short(exc)}")

    required = cell == "control"
    code = row["exit_code"]
    if code is not None and code != 0 and not (code == errors.PARITY_FAILURE and required
                                               and data["mismatch_count"]):
        problems.append(f"rlk run exited {code}")
    sides_read = all(row["sides"][s]["records"] for s in row["sides"])
    row["complete"] = code is not None and has_log and sides_read and validation is not None
    row["evidence_complete"] = not problems
    row["bitwise"] = row["evidence_complete"] and data["mismatch_count"] == 0
    row["bitwise_required"] = required
    row["passed"] = row["evidence_complete"] and (row["bitwise"] or not required)
    row["reasons"] = problems
    return row


def _missing(cell: str, mid: str, root: Path) -> dict[str, Any]:
    plan = cell_plan(cell)
    return {"cell": cell, "attempt_id": None, "latest": True, "matrix_id": mid, "run_id": None,
            "plan_attention": plan.attention, "plan_ffn": plan.ffn, "plan_logp": plan.logp,
            "exit_code": None, "traceback": False, "complete": False, "evidence_complete": False,
            "bitwise": False, "bitwise_required": cell == "control", "passed": False, "numel": 0,
            "expected_numel": None, "mismatch_count": 0, "max_abs_diff": 0.0, "first_step": None,
            "first_sample": None, "first_position": None, "validation_passed": None,
            "started_at": None, "finished_at": None, "duration_s": None, "source_commit": None,
            "worker_commits": [], "sides": {}, "reasons": [f"no attempt of cell {cell} in {root}"],
            "_tokens": []}


def analyze_cell(root: Path, cell: str, mid: str) -> dict[str, Any]:
    """{"cell", verdict fields, "latest": row, "attempts": older rows, newest first}."""
    rows = []
    for folder in reversed(attempts(root, cell)):
        try:
            rows.append(inspect_attempt(folder, cell, mid))
        except Exception as exc:  # noqa: BLE001 - one broken attempt must not hide the others
            row = _missing(cell, mid, root)
            row.update(attempt_id=folder.name, latest=False,
                       reasons=[f"analysis failed: {evidence.short(exc)}"])
            rows.append(row)
    if not rows:
        rows.append(_missing(cell, mid, root))
    rows[0]["latest"] = True
    for older in rows[1:]:
        older.pop("_tokens", None)
    latest = rows[0]
    return {"cell": cell, **{k: latest[k] for k in ("evidence_complete", "bitwise",
                                                    "bitwise_required", "passed")},
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
    code = errors.OK if passed else (errors.INFRASTRUCTURE if not complete else errors.PARITY_FAILURE)
    return {"evidence_complete": complete, "bitwise": all(c["bitwise"] for c in required),
            "bitwise_required": bool(required), "passed": passed, "exit_code": code,
            "failed_cells": [c["cell"] for c in cells if not c["passed"]],
            "incomplete_cells": [c["cell"] for c in cells if not c["evidence_complete"]]}


def analyze(root: Path, *, cells: list[str] | None = None, baseline: bool = False) -> dict[str, Any]:
    """The matrix report; the latest attempts' token rows travel under `_tokens` (not in JSON)."""
    from rl_engine.matrix.attribution import attribute

    root = Path(root)
    mid = matrix_id(root)
    names = [c for c in ALL_CELLS if c in set(cells)] if cells else expected_cells(root, baseline)
    results = [analyze_cell(root, c, mid) for c in names]
    tokens = {r["cell"]: r["latest"].pop("_tokens", []) for r in results}
    try:
        created = files.read_json(root / MATRIX_FILE).get("created_at")
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
    out = Path(output) if output else Path(root) / REPORT
    rows = [row for c in report["cells"] for row in (c["latest"], *c["attempts"])]
    report["tables"] = {"cells": str(out.parent / tables.CELLS), "cell_rows": len(rows),
                        "tokens": str(out.parent / tables.TOKENS),
                        "token_rows": sum(len(t) for t in tokens.values())}
    tables.write_cells(out.parent / tables.CELLS, rows)
    tables.write_tokens(out.parent / tables.TOKENS, report["cells"], tokens)
    files.write_text(out, json.dumps(report, indent=2, default=str) + "\n")
    return report
