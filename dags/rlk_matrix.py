"""
### rl-engine parity matrix

Proves, every night, that the trainer and the rollout engine compute bitwise identical token
log-probs under the all-R plan (the **control**), and runs the **isolation cells** (one module's
case switched to P/R, R/P or P/P) that say which operator family breaks parity when it does.

| task | what it runs |
| --- | --- |
| `prepare` | turns the params into this run's matrix root and each cell's options (no work); refuses unknown conf keys |
| `preflight` | Ray job `rlk preflight`: can this checkout run the R routes at all |
| `control` | Ray job `rlk matrix run --case control`: must be bitwise equal |
| `release_cells` | passes the cells' options on once the preflight passed (no work) |
| `cell` | one Ray job `rlk matrix run --case <cell>` per selected cell (named by cell in the grid); runs after the control whatever its outcome, since a failed control is when the cells are needed |
| `aggregate` | `rlk matrix analyze`: `matrix-report.json`, `cells.parquet`, `tokens.parquet`, the nightly history; emits the `rlk_matrix_report` asset |
| `verdict` | fails the run when the matrix verdict fails |

**Matrix root**: `<RLK_MATRIX_ROOT>/<run id, sanitised>/`. Clearing a cell (or several) runs it
again into a new attempt folder under the same root, and clearing `aggregate` re-judges the
latest attempts. Exit codes of every `rlk` verb: 0 ok, 1 parity failure, 2 bad input (neither is
retried), 3 infrastructure (retried with backoff). With `device` cuda a job whose ranks are its
own processes (`launcher` local) asks Ray for the layout's GPUs; with Ray actors as ranks, each
rank asks for its own and the job is stopped when no node could ever hold them all.

**Settings** (environment first, then the Airflow Variable of the same name in lower case):
`RLK_MATRIX_ROOT` (shared by Airflow and Ray workers), `RLK_MATRIX_SCHEDULE` (cron, default
`0 2 * * *`), `RLK_MATRIX_TIMEZONE` (default `UTC`), `RLK_MATRIX_MAX_ACTIVE_CELLS` (cells running at
once; size it to what the Ray cluster holds, default 1), `RLK_FAILURE_NOTIFIER` (environment only:
dotted path of a callable given the context of a failed run; default: an error log line).
The Ray cluster is the `ray_default` connection.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pendulum
import rlk_common as common
from airflow.sdk import DAG, Asset, CronTriggerTimetable, TriggerRule, task
from rlk_ray.operators import RayJobOperator

log = logging.getLogger(__name__)

SCHEDULE = common.setting("RLK_MATRIX_SCHEDULE", "0 2 * * *")
TIMEZONE = common.setting("RLK_MATRIX_TIMEZONE", "UTC")
MAX_ACTIVE_CELLS = common.int_setting("RLK_MATRIX_MAX_ACTIVE_CELLS", 1)
REPORT_ASSET = Asset(uri="rlk://matrix-report", name="rlk_matrix_report")
# Only infrastructure failures are retried: the Ray operator fails exit codes 1 and 2 without
# retry, and the Python tasks below raise AirflowFailException for answers that would not change.
RETRY = dict(retries=2, retry_delay=timedelta(seconds=30), retry_exponential_backoff=2.0,
             max_retry_delay=timedelta(minutes=10))
ANALYZE_TIMEOUT_S = 900

with DAG(
    dag_id="rlk_matrix",
    dag_display_name="rl-engine parity matrix",
    description="control + isolation cells as Ray jobs; matrix report, Parquet and nightly history",
    schedule=CronTriggerTimetable(SCHEDULE, timezone=pendulum.timezone(TIMEZONE)),
    start_date=pendulum.datetime(2026, 1, 1, tz=TIMEZONE),
    catchup=False,
    max_active_runs=1,
    params=common.params(),
    tags=["rl-engine", "parity", "matrix"],
    doc_md=__doc__,
    on_failure_callback=common.notify_failure,
    default_args=RETRY,
) as dag:

    @task(**RETRY)
    def prepare(params: dict | None = None, run_id: str | None = None, ti=None) -> list[dict]:
        """This run's matrix root and every job's options, from the validated params.

        Returns the cells' options (a mapped task expands only a return value); the rest goes out
        as keyed XComs. Bad params fail here, without retry: the same params give the same answer.
        """
        from airflow.sdk.exceptions import AirflowFailException

        conf = dict(params or {})
        try:
            common.check_keys(conf, common.params())
            root = common.matrix_root(common.matrix_base(), run_id)
            cells = common.selected_cells(conf)
            gpus = common.layout_gpus(conf) if conf.get("device") == "cuda" else 0
        except Exception as exc:  # noqa: BLE001 - ValueError, or rl_engine's BadInput for a layout
            raise AirflowFailException(f"bad params: {exc}") from None
        log.info("matrix root %s; cells: control, %s", root, ", ".join(cells) or "(none)")
        keyed = {
            "matrix_root": str(root),
            # One history file per DAG run: the root's own id keys it (see rl_engine.matrix.history).
            "history_root": str(root.parent / common.HISTORY_FOLDER) if conf.get("append_history") else "",
            "cases": ["control", *cells],
            "preflight": {"device": conf.get("device") or "cpu"},
            # The preflight checks the GPU itself, so on CUDA it runs where one is.
            "preflight_gpus": 1 if gpus else 0,
            "control": common.run_options(conf, root, "control"),
            # Keyed apart: an XCom's key can be pulled, an item inside its value cannot.
            **{f"cell_{k}": v for k, v in common.job_resources(conf, gpus).items()},
            "runtime_env": common.runtime_env(conf),
        }
        for key, value in keyed.items():
            ti.xcom_push(key=key, value=value)
        return [common.run_options(conf, root, cell) for cell in cells]

    @task(**RETRY)
    def release_cells(cells: list[dict]) -> list[dict]:
        """The isolation cells' options, passed on once the preflight has succeeded (no work).

        The cells wait for the control but run whatever its outcome: when the control fails they
        are the diagnosis. They must not run when the preflight failed (nothing could run), and a
        trigger rule reads only direct upstreams, so this task carries the preflight's verdict.
        """
        return cells

    plan = prepare()

    preflight = RayJobOperator(task_id="preflight", rlk_args=["preflight"], rlk_options=plan["preflight"],
                               num_gpus=plan["preflight_gpus"], runtime_env=plan["runtime_env"], **RETRY)

    control = RayJobOperator(task_id="control", rlk_args=["matrix", "run"], rlk_options=plan["control"],
                             num_gpus=plan["cell_num_gpus"], cluster_needs=plan["cell_cluster_needs"],
                             runtime_env=plan["runtime_env"], **RETRY)

    released = release_cells(plan)
    cells = RayJobOperator.partial(
        task_id="cell", rlk_args=["matrix", "run"], runtime_env=plan["runtime_env"],
        num_gpus=plan["cell_num_gpus"], cluster_needs=plan["cell_cluster_needs"],
        max_active_tis_per_dagrun=MAX_ACTIVE_CELLS, map_index_template="{{ task.rlk_options['case'] }}",
        # Upstream: the control (done, passed or not) and release_cells (done only after a passed
        # preflight); at least one success means the preflight passed.
        trigger_rule=TriggerRule.ALL_DONE_MIN_ONE_SUCCESS,
        **RETRY,
    ).expand(rlk_options=released)

    @task(trigger_rule=TriggerRule.ALL_DONE, outlets=[REPORT_ASSET], **RETRY)
    def aggregate(ti=None, outlet_events=None) -> dict:
        """Judge the latest attempt of every cell of this run, whatever happened upstream.

        Reads prepare's XComs itself: as arguments they would be resolved before this runs, and a
        failed prepare would make that fail again at every retry rather than once, with a reason.
        """
        from airflow.sdk.exceptions import AirflowException, AirflowFailException

        matrix_root = ti.xcom_pull(task_ids="prepare", key="matrix_root")
        if not matrix_root:
            raise AirflowFailException("prepare failed (see its log): there is no matrix to judge")
        cases = ti.xcom_pull(task_ids="prepare", key="cases")
        history_root = ti.xcom_pull(task_ids="prepare", key="history_root")
        from rl_engine.evidence.layout import MatrixRoot

        root = Path(matrix_root)
        report = MatrixRoot(root).report
        if not root.is_dir():
            raise AirflowFailException(f"matrix root {root} was never created: no cell ran")
        cmd = [sys.executable, "-m", "rl_engine.cli", "matrix", "analyze", "--matrix-root", str(root),
               "--output", str(report), *[f"--case={c}" for c in cases]]
        if history_root:
            cmd += ["--history-root", history_root]
        log.info("running %s", " ".join(cmd))
        started = report.stat().st_mtime if report.exists() else None
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=ANALYZE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise AirflowException(f"rlk matrix analyze did not finish in {ANALYZE_TIMEOUT_S} s") from None
        for line in (done.stdout + done.stderr).splitlines():
            log.info("%s", line)
        written = report.exists() and report.stat().st_mtime != started
        # With a report written, exit 2 is the verdict (a cell refused its input), judged below.
        if done.returncode == 2 and not written:
            raise AirflowFailException("rlk matrix analyze refused its input (exit 2); see the log")
        if not written:
            raise AirflowException(f"rlk matrix analyze exited {done.returncode} without writing {report}")
        verdict = json.loads(report.read_text())["verdict"]
        summary = {"report": str(report), "matrix_root": str(root), "passed": verdict["passed"],
                   "exit_code": verdict["exit_code"], "failed_cells": verdict["failed_cells"]}
        if outlet_events is not None:
            outlet_events[REPORT_ASSET].extra = summary
        return summary

    @task(**RETRY)
    def verdict(summary: dict) -> None:
        """Fail the run when the matrix verdict fails (not retried: the evidence is on disk)."""
        from airflow.sdk.exceptions import AirflowFailException

        report = json.loads(Path(summary["report"]).read_text())
        v = report["verdict"]
        log.info("matrix %s: passed=%s evidence_complete=%s bitwise=%s failed=%s incomplete=%s",
                 report["matrix_id"], v["passed"], v["evidence_complete"], v["bitwise"],
                 v["failed_cells"], v["incomplete_cells"])
        if not v["passed"]:
            raise AirflowFailException(
                f"matrix verdict failed (exit {v['exit_code']}): failed cells {v['failed_cells']}, "
                f"incomplete {v['incomplete_cells']}; report {summary['report']}")

    summary = aggregate()
    plan >> preflight >> [control, released]
    control >> cells >> summary
    plan >> summary
    verdict(summary)
