"""`rlk demo`: the matrix DAG end to end on the embedded stack, every cell a Ray job.

Starts a local Ray head, prepares the project-local Airflow home, runs the ``rlk_matrix`` DAG with
``dag.test()`` (the tasks run in this process; a deferred Ray job's trigger runs inline until the
job ends), prints where the report is and its table, and stops the head it started, whatever
happened. Nothing is installed here: ``make demo`` installs first.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

from rl_engine import envs, errors
from rl_engine.console import console as make_console
from rl_engine.artifacts import files, ids
from rl_engine.stack import airflow_home, ray_head

DAG_ID = "rlk_matrix"
# A ci cell's ranks as Ray actors: 2 trainer ranks, then 2 rollout ranks (the default workload
# needs 4); the job's driver reserves no CPU.
DEFAULT_NUM_CPUS = 4
console = make_console(stderr=True)


@contextlib.contextmanager
def embedded(state_dir: Path, matrix_base: Path, *, num_cpus: int = DEFAULT_NUM_CPUS,
             num_gpus: int = 0) -> Iterator[tuple[ray_head.RayHead, airflow_home.AirflowHome]]:
    """A Ray head and this process pointed at the project-local Airflow home; the head is stopped
    on the way out. Airflow must not have been imported yet in this process."""
    state_dir, matrix_base = Path(state_dir).resolve(), Path(matrix_base).resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    # Jobs inherit the head's environment: the embedded model and the matrix roots live here.
    head_env = {"RLK_STATE_DIR": str(state_dir), "RLK_MATRIX_ROOT": str(matrix_base)}
    console.print(f"starting a local Ray head ({num_cpus} CPUs) ...", highlight=False)
    head = ray_head.start(state_dir=state_dir, num_cpus=num_cpus, num_gpus=num_gpus, env=head_env,
                          log=state_dir / "logs" / "ray-head.log")
    try:
        console.print(f"Ray head at {head.address} (pid {head.pid}); preparing the Airflow home ...",
                      highlight=False)
        home = airflow_home.prepare(state_dir, ray_address=head.address)
        os.environ["RLK_MATRIX_ROOT"] = str(matrix_base)
        # The tasks run in this process: the Ray hook reads the head's token from here.
        os.environ["RAY_AUTH_TOKEN_PATH"] = head.token_file
        yield head, home
    finally:
        console.print(f"stopping the Ray head (pid {head.pid})", highlight=False)
        head.stop()


def load_dag():
    """The matrix DAG, parsed from the dags folder the way the DAG processor does."""
    from airflow import settings
    from airflow.dag_processing.dagbag import BundleDagBag

    folder = Path(settings.DAGS_FOLDER)
    bag = BundleDagBag(dag_folder=folder, bundle_path=folder, bundle_name="dags-folder")
    if bag.import_errors:
        raise errors.InfrastructureError(f"the DAGs do not import: {bag.import_errors}")
    return bag.dags[DAG_ID]


def trigger(conf: dict[str, Any], *, when: datetime | None = None,
            mark_success_pattern: str | None = None):
    """Run the DAG once with ``conf`` via ``dag.test()``; returns the DagRun.

    ``when`` is the run's logical date and run-after time, which make its run id: running again
    with the same ``when`` replaces that run by one with the same id, so the same matrix root.
    With ``mark_success_pattern`` naming the tasks not to run, that is how a cleared cell runs again.
    """
    dag = load_dag()
    kwargs: dict[str, Any] = {"run_conf": conf, "mark_success_pattern": mark_success_pattern}
    if when is not None:
        kwargs.update(logical_date=when, run_after=when)
    return dag.test(**kwargs)


def matrix_root_of(run_id: str) -> Path:
    return Path(os.environ["RLK_MATRIX_ROOT"]) / ids.sanitize(run_id)


def overheads(dag_run, report: dict[str, Any]) -> list[dict[str, Any]]:
    """Per cell: the Airflow task's wall time, the cell's own `rlk run` time (from the report), and
    their difference, the cost of Airflow + Ray (submission, scheduling, job start, log streaming);
    the task's start and end (epoch seconds) for a finer split."""
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session

    own = {c["cell"]: c["latest"].get("duration_s") for c in report.get("cells", [])}
    rows = []
    with create_session() as session:
        tis = session.query(TaskInstance).filter(TaskInstance.dag_id == DAG_ID,
                                                 TaskInstance.run_id == dag_run.run_id)
        for ti in tis:
            if ti.task_id not in ("control", "cell") or ti.start_date is None or ti.end_date is None:
                continue
            cell = "control" if ti.task_id == "control" else ti.rendered_map_index
            task_s = (ti.end_date - ti.start_date).total_seconds()
            cell_s = own.get(cell)
            rows.append({"cell": cell, "task_s": round(task_s, 3), "cell_s": cell_s,
                         "overhead_s": None if cell_s is None else round(task_s - cell_s, 3),
                         "task_start": ti.start_date.timestamp(),
                         "task_end": ti.end_date.timestamp()})
    return sorted(rows, key=lambda r: str(r["cell"]))


def _print_overheads(rows: list[dict[str, Any]]) -> None:
    from rich.table import Table

    table = Table(title="Airflow + Ray overhead per cell (task wall time minus the cell's own run)")
    for col in ("cell", "task s", "rlk run s", "overhead s"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["cell"]), str(r["task_s"]), str(r["cell_s"]), str(r["overhead_s"]))
    console.print(table)


def run(*, workload: str = "ci", cells: list[str] | None = None, launcher: str = "ray",
        num_cpus: int = DEFAULT_NUM_CPUS, state_dir: Path | None = None,
        matrix_base: Path | None = None) -> int:
    """What `rlk demo` does; returns its exit code (the matrix verdict's, or 3 when no report)."""
    from rl_engine.matrix.cli import show_cmd
    from rl_engine.evidence.layout import MatrixRoot
    from rl_engine.runtime.plan import ISOLATION_CELLS

    state_dir = state_dir or envs.RLK_STATE_DIR
    matrix_base = matrix_base or envs.RLK_MATRIX_ROOT
    conf = {"workload": workload, "cells": list(ISOLATION_CELLS) if cells is None else list(cells),
            "launcher": launcher, "model": "tiny", "device": "cpu"}
    with embedded(state_dir, matrix_base, num_cpus=num_cpus):
        console.print(f"running DAG {DAG_ID} with {conf}", highlight=False)
        dag_run = trigger(conf)
        root = matrix_root_of(dag_run.run_id)
        report = MatrixRoot(root).report
        if report.is_file():
            rows = overheads(dag_run, json.loads(report.read_text()))
            files.write_json(root / "overhead.json", {"dag_run_id": dag_run.run_id, "cells": rows})
            _print_overheads(rows)
    console.print(f"DAG run {dag_run.run_id}: {dag_run.state}", highlight=False)
    if not report.is_file():
        console.print(f"[red]no report[/] at {report}; see the task logs above", highlight=False)
        return errors.INFRASTRUCTURE
    code = show_cmd(root)
    cells_table, tokens_table = MatrixRoot.tables_beside(report)
    console.print(f"report: {report}\ntables: {cells_table}, {tokens_table}", highlight=False)
    if str(dag_run.state) != "success" and code == errors.OK:
        return errors.INFRASTRUCTURE
    return code
