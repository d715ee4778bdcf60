"""The matrix report as Parquet: the cells table (one row per cell attempt) and the tokens table
(one row per compared log-prob of each cell's latest attempt), written atomically with fixed
schemas so that an empty or partial matrix still has every column. Their names and places are
`evidence.layout.MatrixRoot`'s.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rl_engine.artifacts import files

CELL_SCHEMA = pa.schema([
    ("cell", pa.string()), ("attempt_id", pa.string()), ("latest", pa.bool_()),
    ("matrix_id", pa.string()), ("run_id", pa.string()),
    ("plan_attention", pa.string()), ("plan_ffn", pa.string()), ("plan_logp", pa.string()),
    ("state", pa.string()), ("exit_code", pa.int32()), ("traceback", pa.bool_()),
    ("complete", pa.bool_()),
    ("evidence_complete", pa.bool_()), ("bitwise", pa.bool_()), ("bitwise_required", pa.bool_()),
    ("passed", pa.bool_()), ("numel", pa.int64()), ("expected_numel", pa.int64()),
    ("mismatch_count", pa.int64()), ("nonfinite_count", pa.int64()), ("max_abs_diff", pa.float64()),
    ("first_step", pa.int64()), ("first_sample", pa.int64()), ("first_position", pa.int64()),
    ("validation_passed", pa.bool_()), ("started_at", pa.string()), ("finished_at", pa.string()),
    ("duration_s", pa.float64()), ("source_commit", pa.string()),
    ("worker_commits", pa.list_(pa.string())), ("reasons", pa.list_(pa.string())),
    # What each side executed per module (the verdict's `sides`), as JSON text.
    ("sides", pa.string()),
])

TOKEN_SCHEMA = pa.schema([
    ("cell", pa.string()), ("attempt_id", pa.string()), ("step", pa.int64()),
    ("sample", pa.int64()), ("position", pa.int64()),
    # fp32 as compared, so that a value read back has the bits that were compared.
    ("rollout", pa.float32()), ("trainer", pa.float32()), ("abs_diff", pa.float32()),
])


def _write(path: Path, table: pa.Table) -> Path:
    return files.atomic_write(path, lambda tmp: pq.write_table(table, tmp))


def cell_record(row: dict[str, Any]) -> dict[str, Any]:
    """A report row as stored in the cells table."""
    out = {name: row.get(name) for name in CELL_SCHEMA.names}
    out["sides"] = json.dumps(row.get("sides") or {}, sort_keys=True)
    return out


def write_cells(path: Path, rows: list[dict[str, Any]]) -> Path:
    return _write(path, pa.Table.from_pylist([cell_record(r) for r in rows], schema=CELL_SCHEMA))


def write_tokens(path: Path, cells: list[dict[str, Any]],
                 tokens: dict[str, list[tuple]]) -> Path:
    """tokens[cell] = [(step, sample, position, rollout, trainer, abs_diff), ...]."""
    columns: dict[str, list] = {name: [] for name in TOKEN_SCHEMA.names}
    for cell in cells:
        attempt = cell["latest"].get("attempt_id")
        for step, sample, position, ro, tr, diff in tokens.get(cell["cell"], []):
            for name, value in zip(TOKEN_SCHEMA.names, (cell["cell"], attempt, step, sample,
                                                        position, ro, tr, diff)):
                columns[name].append(value)
    return _write(path, pa.Table.from_pydict(columns, schema=TOKEN_SCHEMA))


def read(path: Path) -> list[dict[str, Any]]:
    return pq.read_table(path).to_pylist()
