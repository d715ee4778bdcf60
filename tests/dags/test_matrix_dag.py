"""The matrix DAG end to end on the embedded stack: a real local Ray head, a real SQLite Airflow
metadata database in a temporary home, ``dag.test()``, the ci workload, one cell.

It runs in a child process, as `rlk demo` does: Airflow reads its home once per process, and this
pytest process may already have loaded another one. The child writes what it saw (task
instances, Ray jobs, asset events) to a JSON file; the files it leaves are checked here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pyarrow.parquet as pq
import pytest

from rl_engine.artifacts import ids

CELL = "ffn-PR"

CHILD = textwrap.dedent('''
    import json, sys, time
    from datetime import datetime, timezone
    from pathlib import Path
    from rl_engine.stack import demo

    state, base, out = map(Path, sys.argv[1:4])
    conf = {"cells": [sys.argv[4]], "workload": "ci", "launcher": "ray"}
    seen = {}

    def tasks(run):
        return [{"task_id": t.task_id, "map_index": t.map_index, "label": t.rendered_map_index,
                 "state": str(t.state), "try": t.try_number} for t in run.get_task_instances()]

    def jobs(client):
        return [{"id": j.submission_id, "entrypoint": j.entrypoint, "status": str(j.status)}
                for j in client.list_jobs() if (j.submission_id or "").startswith("rlk_matrix")]

    with demo.embedded(state, base, num_cpus=4) as (head, home):
        from ray.job_submission import JobSubmissionClient
        from sqlalchemy import select
        from airflow.models.asset import AssetEvent, AssetModel
        from airflow.utils.session import create_session

        client = JobSubmissionClient(head.address, headers=head.headers())
        when = datetime.now(timezone.utc).replace(microsecond=0)
        run = demo.trigger(conf, when=when)
        seen["first"] = {"run_id": run.run_id, "state": str(run.state), "tasks": tasks(run),
                         "jobs": jobs(client)}
        # Clear the cell: the same run id (same `when`), so the same matrix root. dag.test
        # recreates the run, so try numbers start at 1 again and would reuse the Ray submission
        # ids of the first run; forget those jobs (a real clear bumps the try number instead).
        # Ray's job monitor, polling once a second, can write a deleted job's status back (as a
        # FAILED job whose entrypoint is "Entrypoint not found."), once; delete until none is left.
        first_ids = {job["id"] for job in seen["first"]["jobs"]}
        for _ in range(30):
            left = first_ids & {job["id"] for job in jobs(client)}
            if not left:
                break
            for job_id in left:
                client.delete_job(job_id)
            time.sleep(2)
        else:
            raise RuntimeError(f"Ray kept the first run's jobs: {sorted(left)}")
        run = demo.trigger(conf, when=when, mark_success_pattern="preflight|control")
        seen["second"] = {"run_id": run.run_id, "state": str(run.state), "tasks": tasks(run),
                          "jobs": jobs(client)}
        with create_session() as session:
            seen["asset_events"] = [e.extra for e in session.scalars(
                select(AssetEvent).join(AssetModel, AssetEvent.asset_id == AssetModel.id)
                .where(AssetModel.name == "rlk_matrix_report"))]
    out.write_text(json.dumps(seen, indent=1))
''')


def _by_task(tasks: list[dict]) -> dict[str, dict]:
    return {t["task_id"]: t for t in tasks}


@pytest.mark.slow
def test_matrix_dag_runs_cells_as_ray_jobs_and_a_cleared_cell_adds_an_attempt(tmp_path):
    state, base, out = tmp_path / "state", tmp_path / "matrix-runs", tmp_path / "seen.json"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("AIRFLOW") and k not in ("RLK_RAY_ADDRESS", "RAY_ADDRESS")}
    done = subprocess.run([sys.executable, "-c", CHILD, str(state), str(base), str(out), CELL],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
    seen = json.loads(out.read_text())

    # The first run: every task succeeded, and the mapped cell is named by its cell in the grid.
    first = seen["first"]
    assert first["state"] == "success", first["tasks"]
    tasks = _by_task(first["tasks"])
    assert set(tasks) == {"prepare", "preflight", "control", "release_cells", "cell", "aggregate",
                          "verdict"}
    assert all(t["state"] == "success" for t in first["tasks"]), first["tasks"]
    assert tasks["cell"]["label"] == CELL

    # preflight, control and the cell ran as Ray jobs, each the rlk command it names.
    assert {j["status"] for j in first["jobs"]} == {"SUCCEEDED"}
    commands = sorted(j["entrypoint"] for j in first["jobs"])
    assert len(commands) == 3, commands
    assert commands[0].startswith("rlk matrix run") and "--case=control" in commands[0]
    assert commands[1].startswith("rlk matrix run") and f"--case={CELL}" in commands[1]
    assert commands[2] == "rlk preflight --device=cpu"

    # The run owns one matrix root, named by its run id; the aggregation wrote the report, the
    # Parquet tables and the nightly history, and emitted the asset.
    roots = [p for p in base.iterdir() if p.is_dir() and p.name != "history"]
    assert [p.name for p in roots] == [ids.sanitize(first["run_id"])]
    root = roots[0]
    report = json.loads((root / "matrix-report.json").read_text())
    assert report["verdict"]["passed"] is True
    assert [c["cell"] for c in report["cells"]] == ["control", CELL]
    control = report["cells"][0]
    assert control["bitwise"] and control["bitwise_required"] and control["latest"]["numel"] > 0
    assert pq.read_table(root / "cells.parquet").num_rows >= 2
    assert pq.read_table(root / "tokens.parquet").num_rows > 0
    assert list((base / "history").rglob("*.parquet")), "no nightly history written"
    assert seen["asset_events"] and seen["asset_events"][0]["passed"] is True

    # Clearing the cell ran only the cell again: a second attempt under the same root, one job.
    second = seen["second"]
    assert second["run_id"] == first["run_id"] and second["state"] == "success"
    assert [j["entrypoint"] for j in second["jobs"]] == [commands[1]]
    assert len([p for p in (root / "control").iterdir() if p.is_dir()]) == 1
    attempts = sorted(p.name for p in (root / CELL).iterdir() if p.is_dir())
    assert len(attempts) == 2
    report = json.loads((root / "matrix-report.json").read_text())
    cell = report["cells"][1]
    assert cell["latest"]["attempt_id"] == attempts[1] and len(cell["attempts"]) == 1
    assert len(seen["asset_events"]) == 2


OUTCOMES = textwrap.dedent('''
    import json, sys
    from pathlib import Path
    from rl_engine.stack import airflow_home, demo

    state, out = Path(sys.argv[1]), Path(sys.argv[2])
    airflow_home.prepare(state, ray_address="http://127.0.0.1:9")  # no Ray: jobs are faked
    from airflow.sdk.exceptions import AirflowFailException
    from rlk_ray.operators import RayJobOperator

    failing = set()

    def execute(self, context):  # a Ray job that exits 1 (parity) for the failing tasks, else 0
        if self.task_id in failing:
            raise AirflowFailException(f"Ray job {self.task_id} failed with exit code 1")
        return "sid"

    RayJobOperator.execute = execute
    seen = {}
    for name, fail, conf in (("control", {"control"}, {"cells": ["ffn-PR", "logp-PP"]}),
                             ("preflight", {"preflight"}, {"cells": ["ffn-PR"]}),
                             ("typo", set(), {"cell": ["ffn-PR"]})):
        failing.clear()
        failing.update(fail)
        run = demo.trigger({**conf, "workload": "ci"})
        seen[name] = {f"{t.task_id}{'' if t.map_index < 0 else t.map_index}": [str(t.state), t.try_number]
                      for t in run.get_task_instances()}
    out.write_text(json.dumps(seen))
''')


def test_the_cells_run_when_the_control_fails_but_not_when_the_preflight_does(tmp_path):
    """The trigger rules on a real metadata database (dag.test, about 15 s); the Ray jobs are
    faked by their exit: 1 (parity failure) for the failing task, 0 for the others."""
    out = tmp_path / "seen.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    env["RLK_MATRIX_ROOT"] = str(tmp_path / "matrix-runs")
    done = subprocess.run([sys.executable, "-c", OUTCOMES, str(tmp_path / "state"), str(out)],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
    seen = json.loads(out.read_text())
    # A failed control is when the isolation cells are needed: both ran.
    control = seen["control"]
    assert control["control"][0] == "failed"
    assert control["cell0"][0] == control["cell1"][0] == "success", control
    # A failed preflight: nothing could run, so no cell was started.
    preflight = seen["preflight"]
    assert preflight["preflight"][0] == "failed"
    assert {state for task, (state, _) in preflight.items() if task.startswith("cell")} == {"upstream_failed"}
    # A misspelt conf key fails the first task at its first try, and nothing runs.
    typo = seen["typo"]
    assert typo["prepare"] == ["failed", 1], typo
    assert typo["preflight"][0] == "upstream_failed"
    assert typo["aggregate"] == ["failed", 1], "aggregate retried what cannot change"
