"""Nightly history: a Parquet dataset partitioned by the matrix's date, one file per matrix.

  <history-root>/date=<yyyy-mm-dd>/<matrix-key>.parquet    one row per cell (its latest attempt)

A matrix id is its root's folder name, which two roots can share (``/a/nightly`` and
``/b/nightly``, or a root deleted and made again), so the history keys a matrix by
``<matrix-id>-<hash of its resolved root and creation time>``: appending the same matrix again (a
cleared cell, a re-aggregation) replaces its file, so the history holds each matrix once, as last
analyzed, and another matrix of the same name gets a file of its own.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from rl_engine.artifacts import files, ids

SCHEMA = pa.schema([
    ("matrix_key", pa.string()), ("matrix_id", pa.string()), ("generated_at", pa.string()), ("matrix_passed", pa.bool_()),
    ("attributed_modules", pa.list_(pa.string())), ("attribution_conclusive", pa.bool_()),
    ("cell", pa.string()), ("attempt_id", pa.string()), ("attempts", pa.int64()),
    ("evidence_complete", pa.bool_()), ("bitwise", pa.bool_()), ("passed", pa.bool_()),
    ("state", pa.string()),
    ("numel", pa.int64()), ("mismatch_count", pa.int64()), ("max_abs_diff", pa.float64()),
    ("duration_s", pa.float64()), ("source_commit", pa.string()),
])
PARTITIONING = ds.partitioning(pa.schema([("date", pa.string())]), flavor="hive")


def _date(report: dict[str, Any]) -> str:
    stamp = report.get("created_at") or report["generated_at"]
    return str(stamp)[:10]


def _state(cell: dict[str, Any]) -> str:
    """passed, failed or pending; reports from before ``state`` knew no pending."""
    return cell.get("state") or ("passed" if cell["passed"] else "failed")


def matrix_key(report: dict[str, Any]) -> str:
    """The matrix's unique id in the history (see the module docstring)."""
    root = str(Path(report["matrix_root"]).resolve()) if report.get("matrix_root") else ""
    origin = f"{root}\n{report.get('created_at') or ''}"
    return f"{ids.sanitize(report['matrix_id'])}-{hashlib.sha256(origin.encode()).hexdigest()[:12]}"


def append(report: dict[str, Any], history_root: Path) -> Path:
    attribution = report.get("attribution") or {}
    key = matrix_key(report)
    rows = []
    for cell in report["cells"]:
        latest = cell["latest"]
        rows.append({
            "matrix_key": key, "matrix_id": report["matrix_id"], "generated_at": report["generated_at"],
            "matrix_passed": report["verdict"]["passed"],
            "attributed_modules": attribution.get("attributed_modules", []),
            "attribution_conclusive": attribution.get("conclusive"),
            "cell": cell["cell"], "attempt_id": latest.get("attempt_id"),
            "attempts": len(cell["attempts"]) + (latest.get("attempt_id") is not None),
            "evidence_complete": cell["evidence_complete"], "bitwise": cell["bitwise"],
            "passed": cell["passed"], "state": _state(cell), "numel": latest.get("numel"),
            "mismatch_count": latest.get("mismatch_count"), "max_abs_diff": latest.get("max_abs_diff"),
            "duration_s": latest.get("duration_s"), "source_commit": latest.get("source_commit"),
        })
    path = Path(history_root) / f"date={_date(report)}" / f"{key}.parquet"
    table = pa.Table.from_pylist(rows, schema=SCHEMA)
    return files.atomic_write(path, lambda tmp: pq.write_table(table, tmp))


def read(history_root: Path) -> list[dict[str, Any]]:
    """Every row of the history, with its date, oldest matrix first."""
    root = Path(history_root)
    if not root.is_dir():
        return []
    # The schema is given, so files written before matrix_key existed read with it empty.
    schema = pa.schema([*SCHEMA, ("date", pa.string())])
    dataset = ds.dataset(root, format="parquet", partitioning=PARTITIONING, schema=schema,
                         exclude_invalid_files=True, ignore_prefixes=[".", "_"])
    rows = dataset.to_table().to_pylist()
    for r in rows:
        r["matrix_key"] = r["matrix_key"] or f"{r['date']}/{r['matrix_id']}"
        r["state"] = r["state"] or _state(r)
    return sorted(rows, key=lambda r: (r["date"], r["generated_at"], r["matrix_key"], r["cell"]))


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per matrix: its date, verdict, failing cells, the control's figures, attribution."""
    by_matrix: dict[str, list[dict]] = {}
    for r in rows:
        by_matrix.setdefault(r["matrix_key"], []).append(r)
    out = []
    for key, cells in by_matrix.items():
        control = next((c for c in cells if c["cell"] == "control"), None)
        out.append({
            "date": cells[0]["date"], "matrix_key": key, "matrix_id": cells[0]["matrix_id"],
            "generated_at": cells[0]["generated_at"],
            "passed": cells[0]["matrix_passed"],
            "cells_passed": sum(bool(c["passed"]) for c in cells), "cells": len(cells),
            "failed": [c["cell"] for c in cells if c["state"] == "failed"],
            "pending": [c["cell"] for c in cells if c["state"] == "pending"],
            "control_mismatch_count": control["mismatch_count"] if control else None,
            "attributed_modules": cells[0]["attributed_modules"] or [],
        })
    return sorted(out, key=lambda r: (r["date"], r["generated_at"], r["matrix_key"]))
