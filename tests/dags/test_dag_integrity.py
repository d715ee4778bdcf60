"""Every DAG parses the way the DAG processor parses it, and declares what operators rely on.

No metadata database and no Ray here: parsing must need neither (no work at module top level).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DAGS, PLUGINS = ROOT / "dags", ROOT / "plugins"
# Airflow reads AIRFLOW_HOME once, when first imported: keep it out of the user's home folder.
if "AIRFLOW_HOME" not in os.environ:
    os.environ["AIRFLOW_HOME"] = tempfile.mkdtemp(prefix="rlk-airflow-")
    atexit.register(shutil.rmtree, os.environ["AIRFLOW_HOME"], True)
for folder in (PLUGINS, DAGS):  # what the DAG processor puts on sys.path
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

SETTINGS = ("RLK_MATRIX_SCHEDULE", "RLK_MATRIX_TIMEZONE", "RLK_MATRIX_MAX_ACTIVE_CELLS",
            "RLK_MATRIX_ROOT", "RLK_FAILURE_NOTIFIER")


def parse():
    from airflow.dag_processing.dagbag import BundleDagBag

    return BundleDagBag(dag_folder=DAGS, bundle_path=DAGS, bundle_name="dags-folder")


@pytest.fixture
def clean_settings(monkeypatch):
    for name in SETTINGS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture
def bag(clean_settings):
    return parse()


@pytest.fixture
def matrix(bag):
    return bag.dags["rlk_matrix"]


def test_every_dag_imports_without_errors(bag):
    assert bag.import_errors == {}
    assert "rlk_matrix" in bag.dag_ids


def test_matrix_dag_file_parses_quickly_without_heavy_imports(clean_settings):
    import subprocess

    code = ("import sys, time; sys.path[:0] = [%r, %r]; t = time.monotonic(); import rlk_matrix; "
            "print(time.monotonic() - t, 'torch' in sys.modules, 'ray' in sys.modules)") % (str(PLUGINS), str(DAGS))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "RLK_MATRIX_SCHEDULE": "0 2 * * *"}).stdout.split()
    seconds, torch_loaded, ray_loaded = float(out[-3]), out[-2], out[-1]
    assert (torch_loaded, ray_loaded) == ("False", "False")
    assert seconds < 10.0, f"importing the DAG file took {seconds:.1f} s"


def test_every_dag_declares_tags_params_docs_and_retries(bag):
    for dag_id, dag in bag.dags.items():
        assert dag.tags, f"{dag_id} has no tags"
        assert dag.params, f"{dag_id} has no params"
        assert dag.doc_md and len(dag.doc_md) > 200, f"{dag_id} has no doc_md"
        assert not dag.catchup, f"{dag_id} would backfill every missed night"
        for task in dag.tasks:
            assert task.retries >= 1, f"{dag_id}.{task.task_id} is never retried"
            assert task.retry_exponential_backoff, f"{dag_id}.{task.task_id} retries without backoff"


def test_matrix_dag_shape(matrix):
    from airflow.sdk import Asset, TriggerRule

    def down(task_id):
        return set(matrix.get_task(task_id).downstream_task_ids)

    assert down("prepare") >= {"preflight", "control", "release_cells", "aggregate"}
    assert down("preflight") == {"control", "release_cells"}
    assert down("control") == down("release_cells") == {"cell"}
    assert down("cell") == {"aggregate"} and down("aggregate") == {"verdict"}
    cell = matrix.get_task("cell")
    assert cell.trigger_rule == TriggerRule.ALL_DONE_MIN_ONE_SUCCESS
    assert cell.is_mapped and cell.max_active_tis_per_dagrun == 1
    assert "rlk_options['case']" in cell.partial_kwargs["map_index_template"]
    for task_id in ("preflight", "control"):
        assert type(matrix.get_task(task_id)).__name__ == "RayJobOperator"
    aggregate = matrix.get_task("aggregate")
    assert aggregate.trigger_rule == TriggerRule.ALL_DONE
    assert Asset(uri="rlk://matrix-report", name="rlk_matrix_report") in aggregate.outlets
    assert matrix.timetable.expression == "0 2 * * *" and str(matrix.timetable.timezone) == "UTC"
    assert matrix.on_failure_callback and matrix.max_active_runs == 1


def test_schedule_time_zone_and_cell_concurrency_come_from_the_environment(clean_settings):
    clean_settings.setenv("RLK_MATRIX_SCHEDULE", "30 3 * * 1-5")
    clean_settings.setenv("RLK_MATRIX_TIMEZONE", "Europe/Paris")
    clean_settings.setenv("RLK_MATRIX_MAX_ACTIVE_CELLS", "3")
    dag = parse().dags["rlk_matrix"]
    assert dag.timetable.expression == "30 3 * * 1-5"
    assert str(dag.timetable.timezone) == "Europe/Paris"
    assert dag.get_task("cell").max_active_tis_per_dagrun == 3


def _validate(dag, **conf):
    """What the API server does with a trigger's conf: the serialized DAG's params, merged, checked."""
    from airflow.serialization.serialized_objects import DagSerialization

    served = DagSerialization.deserialize_dag(DagSerialization.serialize_dag(dag))
    return served.params.deep_merge(conf).validate()


@pytest.mark.parametrize("conf", [
    {"cells": ["attention-XX"]},                  # not a cell
    {"cells": ["control"]},                        # the control always runs; it is not a choice
    {"cells": ["ffn-PR", "ffn-PR"]},               # each cell once
    {"cells": "ffn-PR"},                           # a list, not a string
    {"workload": "huge"},
    {"model": "relative/folder"},                  # Ray workers need an absolute path
    {"tp": 0},
    {"resume": "yes"},
])
def test_params_schema_rejects_bad_values(matrix, conf):
    from airflow.sdk.definitions.param import ParamValidationError

    with pytest.raises(ParamValidationError):
        _validate(matrix, **conf)


def test_params_schema_accepts_a_one_cell_ci_run_and_defaults_to_the_nine_cells(matrix):
    from rl_engine.runtime.plan import ISOLATION_CELLS

    values = _validate(matrix, cells=["ffn-PR", "baseline"], workload="ci", model="/models/qwen3", tp=2)
    assert values["cells"] == ["ffn-PR", "baseline"] and values["tp"] == 2
    assert _validate(matrix)["cells"] == list(ISOLATION_CELLS)
    assert _validate(matrix)["workload"] == "default"


def test_cell_options_are_flags_that_rlk_matrix_run_accepts():
    import rlk_common as common
    import typer.main
    from rlk_ray.entrypoint import build_rlk_command

    from rl_engine.matrix.cli import app

    conf = {"workload": "ci", "cells": ["ffn-PR"], "model": "/models/q", "device": "cpu", "tp": 2,
            "rollout_gpus_per_engine": 1, "resume": True, "rerun_failed": False, "cell_timeout_s": 900}
    options = common.run_options(conf, Path("/m/root"), "ffn-PR")
    argv = build_rlk_command(["matrix", "run"], options).split()[3:]
    run = typer.main.get_command(app).commands["run"]
    parsed = run.make_context("run", argv).params
    assert parsed["case"] == ["ffn-PR"] and parsed["matrix_root"] == Path("/m/root")
    assert parsed["workload"] == "ci" and parsed["tp"] == 2 and parsed["rollout_gpus_per_engine"] == 1
    assert parsed["model_root"] == Path("/models/q")
    assert parsed["resume"] is True and parsed["rerun_failed"] is False
    assert parsed["history"] is False, "cells must leave the history to the aggregate task"
    assert parsed["cell_timeout"] == 900


def test_catalogue_and_sanitize_agree_with_rl_engine():
    import rlk_common as common

    from rl_engine.artifacts import ids
    from rl_engine.runtime.plan import ALL_CELLS

    assert ("control", *common.SELECTABLE_CELLS) == ALL_CELLS
    for raw in ("manual__2026-11-30T05:15:59.202244+00:00", "scheduled__2026-11-30T02:00:00+00:00",
                "..", "a/../b", "", "../../etc", "x..y"):
        assert common.sanitize(raw) == ids.sanitize(raw)
        ids.check_id(common.sanitize(raw))
    with pytest.raises(ValueError, match="history"):
        common.matrix_root(Path("/base"), "history")


class _TI:
    def __init__(self):
        self.pushed = {}

    def xcom_push(self, key, value):
        self.pushed[key] = value


def test_unknown_conf_keys_fail_the_first_task_without_retry(matrix, clean_settings, tmp_path):
    from airflow.sdk.exceptions import AirflowFailException

    clean_settings.setenv("RLK_MATRIX_ROOT", str(tmp_path))
    prepare = matrix.get_task("prepare").python_callable
    params = _validate(matrix, cells=["ffn-PR"], workload="ci")
    assert prepare(params=params, run_id="r1", ti=_TI()) == [
        common_options(params, tmp_path / "r1", "ffn-PR")]
    # "cell" for "cells": Airflow merges it into the params; the run would use every default.
    with pytest.raises(AirflowFailException, match=r"unknown conf keys \['cell'\].*cells"):
        prepare(params={**params, "cell": ["ffn-PR"]}, run_id="r1", ti=_TI())


def common_options(conf, root, cell):
    import rlk_common as common

    return common.run_options(conf, root, cell)


@pytest.mark.parametrize("launcher, cell_gpus, needs", [("local", 4, {}), ("ray", 0, {"GPU": 4})])
def test_cuda_jobs_ask_ray_for_the_layouts_gpus(matrix, clean_settings, tmp_path, launcher, cell_gpus,
                                                needs):
    clean_settings.setenv("RLK_MATRIX_ROOT", str(tmp_path))
    prepare = matrix.get_task("prepare").python_callable
    ti = _TI()
    prepare(params=_validate(matrix, device="cuda", launcher=launcher), run_id="r1", ti=ti)
    # The default workload: TP=2 x CP=2 trainer ranks, 2 engines of TP=2, colocated: 4 GPUs.
    assert (ti.pushed["cell_num_gpus"], ti.pushed["cell_cluster_needs"]) == (cell_gpus, needs)
    assert ti.pushed["preflight_gpus"] == 1
    ti = _TI()
    prepare(params=_validate(matrix, device="cpu"), run_id="r1", ti=ti)
    assert (ti.pushed["cell_num_gpus"], ti.pushed["cell_cluster_needs"]) == (0, {})
    assert ti.pushed["preflight_gpus"] == 0
    for task_id in ("control", "cell"):
        task = matrix.get_task(task_id)
        kwargs = task.partial_kwargs if task.is_mapped else vars(task)
        # The operators read those very XComs (a wrong key would pull nothing: no GPU asked).
        assert "key='cell_num_gpus'" in str(kwargs["num_gpus"])
        assert "key='cell_cluster_needs'" in str(kwargs["cluster_needs"])


def _report(tmp_path: Path, passed: bool) -> dict:
    report = tmp_path / "matrix-report.json"
    report.write_text(json.dumps({"matrix_id": "m", "verdict": {
        "passed": passed, "evidence_complete": True, "bitwise": passed, "exit_code": 0 if passed else 1,
        "failed_cells": [] if passed else ["control"], "incomplete_cells": []}}))
    return {"report": str(report)}


def test_verdict_fails_the_run_only_when_the_matrix_verdict_fails(matrix, tmp_path):
    from airflow.sdk.exceptions import AirflowFailException

    verdict = matrix.get_task("verdict").python_callable
    assert verdict(_report(tmp_path, passed=True)) is None
    with pytest.raises(AirflowFailException, match="failed cells \\['control'\\]"):
        verdict(_report(tmp_path, passed=False))


CALLS: list = []


def record_failure(context) -> None:
    CALLS.append(context["dag_run"].run_id)


class _Run:
    run_id, run_type = "scheduled__2026-11-30T02:00:00+00:00", "scheduled"


def test_failure_notifier_logs_by_default_and_calls_the_configured_one(clean_settings, caplog):
    import rlk_common as common

    clean_settings.setenv("RLK_MATRIX_ROOT", "/shared/matrix")
    with caplog.at_level("ERROR"):
        common.notify_failure({"dag_run": _Run(), "reason": "task_failure"})
    assert "scheduled__2026-11-30T02:00:00+00:00 (scheduled) FAILED: task_failure" in caplog.text
    assert "/shared/matrix/scheduled__2026-11-30T02_00_00_00_00" in caplog.text
    clean_settings.setenv("RLK_FAILURE_NOTIFIER", f"{__name__}.record_failure")
    CALLS.clear()
    common.notify_failure({"dag_run": _Run()})
    assert CALLS == [_Run.run_id]
