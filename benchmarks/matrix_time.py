"""What the matrix costs on top of its cells' own `rlk run`, directly and through the DAG.

A cell's own time is its `rlk run` process's wall time, from the case file's STARTED_AT (written
just before the run starts) to its exit-code file (the report's `duration_s`). Its overhead is the
wall time of what ran it minus that:
- directly: `rlk matrix run --case CELL` as a process of its own (one per cell, as a DAG job runs it);
- through the DAG: the cell's Airflow task (the `rlk_matrix` DAG on the embedded stack: a local Ray
  head, every cell a Ray job, `dag.test()` as `rlk demo` runs it).
The overhead per cell is the median over the cells; targets: <= 3 s through the DAG, and the
default matrix (the control and nine cells) <= 5 min through the DAG. Where the overhead goes:
the start of `rlk` (Python and imports, timed alone), the runner's work around the cell (the
direct overhead), and Airflow + Ray (the DAG's overhead minus the direct one). Through the DAG each
cell's overhead is also split at the Ray job's submission and end (Ray's own times), into four
parts whose medians are in `dag.where`:
- `to_submit_s`: the task's start to the job's submission (Airflow, the operator's submit call);
- `to_cell_start_s`: the submission to the cell's STARTED_AT (Ray starts the job's supervisor, a
  Python process of its own, which starts `rlk matrix run`, which starts the cell);
- `after_cell_s`: the cell's exit code to the job's end (the cell's `rlk run` exits, then the
  runner judges the cell, writes the matrix report and exits);
- `to_task_end_s`: the job's end to the task's end (the trigger sees it, reads the rest of the
  log; the task resumes and ends).
Writes benchmarks/results/matrix_time.json (schema 2: schema 1 had no `dag.where` and per-cell
parts) with the commit, its dirty flag and the load average.

    python benchmarks/matrix_time.py [--workload ci|default] [--skip-dag] [--skip-direct]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rl_engine.artifacts import files, provenance
from rl_engine.evidence.layout import MatrixRoot
from rl_engine.runtime.plan import ISOLATION_CELLS

RESULTS = Path(__file__).parent / "results" / "matrix_time.json"
CELLS = ["control", *ISOLATION_CELLS]
TARGET_OVERHEAD_S, TARGET_DAG_S = 3.0, 300.0
RLK = [sys.executable, "-m", "rl_engine.cli"]


def own_times(root: Path) -> dict[str, float | None]:
    report = json.loads(MatrixRoot(root).report.read_text())
    return {c["cell"]: c["latest"].get("duration_s") for c in report["cells"]}


SCHEMA_VERSION = 2
PARTS = ("to_submit_s", "to_cell_start_s", "after_cell_s", "to_task_end_s")


def _median(rows: list[dict], key: str = "overhead_s") -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return round(statistics.median(values), 3) if values else None


def _epoch(iso: str | None) -> float | None:
    from datetime import datetime

    return datetime.fromisoformat(iso).timestamp() if iso else None


def parts(tasks: list[dict], report: dict, head) -> dict[str, dict[str, float | None]]:
    """Per cell, its overhead split at the Ray job's submission and end (see the docstring), from
    the cells' task rows (`demo.overheads`) and the head's jobs."""
    from ray.job_submission import JobSubmissionClient

    jobs: dict[str, object] = {}
    for job in sorted(JobSubmissionClient(head.address, headers=head.headers()).list_jobs(),
                      key=lambda j: j.start_time or 0):
        for word in (job.entrypoint or "").split():
            if word.startswith("--case="):
                jobs[word.removeprefix("--case=")] = job  # the last try of the cell
    latest = {c["cell"]: c["latest"] for c in report["cells"]}
    out: dict[str, dict[str, float | None]] = {}
    for task in tasks:
        cell = task["cell"]
        job, row = jobs.get(cell), latest.get(cell) or {}
        if job is None:
            continue
        marks = [task["task_start"], job.start_time / 1000.0,
                 _epoch(row.get("started_at")), _epoch(row.get("finished_at")),
                 (job.end_time or 0) / 1000.0 or None, task["task_end"]]
        spans = [None if a is None or b is None else round(b - a, 3)
                 for a, b in ((marks[0], marks[1]), (marks[1], marks[2]),
                              (marks[3], marks[4]), (marks[4], marks[5]))]
        out[cell] = dict(zip(PARTS, spans))
    return out


def startup_s(repeats: int = 3) -> dict[str, float]:
    """The start of `rlk`: Python alone, and `rlk matrix run --help` (its imports and CLI)."""
    def best(cmd: list[str]) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            subprocess.run(cmd, capture_output=True, check=True)
            times.append(time.perf_counter() - t0)
        return round(min(times), 3)

    return {"python_s": best([sys.executable, "-c", "pass"]),
            "rlk_matrix_run_help_s": best([*RLK, "matrix", "run", "--help"]),
            "rlk_run_help_s": best([*RLK, "run", "--help"])}


def direct(workload: str, env: dict[str, str], base: Path) -> dict:
    root = base / "direct"
    rows, codes = [], {}
    t_all = time.monotonic()
    for cell in CELLS:
        t0 = time.monotonic()
        proc = subprocess.run([*RLK, "matrix", "run", "--case", cell, "--workload", workload,
                               "--matrix-root", str(root), "--no-history"],
                              capture_output=True, text=True, env=env)
        wall = time.monotonic() - t0
        codes[cell] = proc.returncode
        if proc.returncode not in (0, 1):
            print(proc.stderr[-3000:], file=sys.stderr)
        own = own_times(root).get(cell)
        rows.append({"cell": cell, "wall_s": round(wall, 3), "own_s": own,
                     "overhead_s": None if own is None else round(wall - own, 3)})
        print(f"direct {cell}: {wall:.2f} s, own {own} s", flush=True)
    return {"cells": rows, "exit_codes": codes, "total_s": round(time.monotonic() - t_all, 3),
            "median_overhead_s": _median(rows)}


def through_dag(workload: str, base: Path) -> dict:
    # Airflow reads its home when first imported: only after embedded() has prepared it.
    from rl_engine.stack import demo

    conf = {"workload": workload, "cells": list(ISOLATION_CELLS), "model": "tiny", "device": "cpu",
            "append_history": False}
    with demo.embedded(base / "state", base / "matrix-runs") as (head, _):
        t0 = time.monotonic()
        dag_run = demo.trigger(conf)
        wall = time.monotonic() - t0
        root = demo.matrix_root_of(dag_run.run_id)
        report = json.loads(MatrixRoot(root).report.read_text())
        tasks = demo.overheads(dag_run, report)
        split = parts(tasks, report, head)
        rows = [{"cell": r["cell"], "task_s": r["task_s"], "own_s": r["cell_s"],
                 "overhead_s": r["overhead_s"], **split.get(r["cell"], dict.fromkeys(PARTS))}
                for r in tasks]
        span = None
        if dag_run.start_date and dag_run.end_date:
            span = round((dag_run.end_date - dag_run.start_date).total_seconds(), 3)
    return {"state": str(dag_run.state), "verdict_exit_code": report["verdict"]["exit_code"],
            "wall_s": round(wall, 3), "dag_run_s": span, "cells": rows,
            "median_overhead_s": _median(rows), "where": {k: _median(rows, k) for k in PARTS}}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", default="ci", choices=("ci", "default"))
    parser.add_argument("--skip-dag", action="store_true")
    parser.add_argument("--skip-direct", action="store_true")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="rlk-matrix-bench-"))
    # The direct runs use the same embedded model folder as the DAG's jobs.
    env = {**os.environ, "RLK_STATE_DIR": str(base / "state"),
           "RLK_MATRIX_ROOT": str(base / "matrix-runs")}
    for var in ("CI_TEST", "RL_KERNEL_RUN_ID", "RL_KERNEL_ARTIFACT_DIR", "VALIDATE_ARTIFACTS"):
        env.pop(var, None)
        os.environ.pop(var, None)
    os.environ.update(RLK_STATE_DIR=env["RLK_STATE_DIR"])
    src = provenance.source()
    result: dict = {
        "schema_version": SCHEMA_VERSION, "benchmark": "matrix_time", "workload": args.workload,
        "cells": CELLS,
        "commit": src["commit"], "dirty": src["dirty"],
        "targets": {"overhead_per_cell_s": TARGET_OVERHEAD_S, "dag_matrix_s": TARGET_DAG_S},
        "machine": {"cpu_count": os.cpu_count(), "python": platform.python_version(),
                    "load_average_at_start": list(os.getloadavg())},
    }
    result["startup"] = startup_s()
    if not args.skip_direct:
        result["direct"] = direct(args.workload, env, base)
    if not args.skip_dag:
        result["dag"] = dag = through_dag(args.workload, base)
        direct_median = result.get("direct", {}).get("median_overhead_s")
        result["verdict"] = {
            "overhead_per_cell_s": dag["median_overhead_s"],
            "overhead_ok": dag["median_overhead_s"] is not None
            and dag["median_overhead_s"] <= TARGET_OVERHEAD_S,
            "dag_matrix_s": dag["dag_run_s"],
            "dag_matrix_ok": dag["dag_run_s"] is not None and dag["dag_run_s"] <= TARGET_DAG_S,
            # Where the DAG's overhead goes, per cell (medians).
            "airflow_and_ray_s": None if direct_median is None or dag["median_overhead_s"] is None
            else round(dag["median_overhead_s"] - direct_median, 3),
            "runner_s": direct_median,
        }
    result["machine"]["load_average_at_end"] = list(os.getloadavg())
    files.write_json(RESULTS, result)
    print(json.dumps({k: result.get(k) for k in ("startup", "verdict")}, indent=1))
    if "dag" in result:
        print(f"where the DAG's overhead goes (medians): {result['dag']['where']}")
    for part in ("direct", "dag"):
        if part in result:
            print(f"{part}: median overhead per cell {result[part]['median_overhead_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
