"""The clean-room gate DAG parses with no import errors and runs one task per gate step, in order,
each as the `rlk gate` command the step's CLI accepts."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DAGS, PLUGINS = ROOT / "dags", ROOT / "plugins"
# Airflow reads its settings once, when first imported: a throwaway home, and no example DAGs.
if "AIRFLOW_HOME" not in os.environ:
    os.environ["AIRFLOW_HOME"] = tempfile.mkdtemp(prefix="rlk-airflow-")
    atexit.register(shutil.rmtree, os.environ["AIRFLOW_HOME"], True)
os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
for folder in (PLUGINS, DAGS):  # what the DAG processor puts on sys.path
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

DAG_ID = "rlk_clean_room_gate"
VALID = {"commit": "0123456789abcdef0123456789abcdef01234567"}
ORIGIN = "https://example.org/rl-engine.git"


@pytest.fixture(scope="module")
def bag():
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=DAGS)


@pytest.fixture(scope="module")
def dag(bag):
    return bag.dags[DAG_ID]


def test_the_gate_dag_loads_without_import_errors(bag):
    assert not {f: e for f, e in bag.import_errors.items() if "rlk_clean_room_gate" in f}
    assert DAG_ID in bag.dag_ids


def test_one_task_per_gate_step_chained_in_order(dag):
    from airflow.sdk import TriggerRule

    from rl_engine.gate import STEPS

    import rlk_clean_room_gate as module

    assert module.GATE_STEPS == STEPS
    for step, nxt in zip(STEPS, STEPS[1:]):
        assert dag.get_task(step).downstream_task_ids == {nxt}, step
    assert dag.get_task("archive").downstream_task_ids == set()
    assert set(dag.task_ids) == {"prepare", *STEPS}
    assert set(dag.get_task("prepare").downstream_task_ids) == set(STEPS)  # every step's options
    for step in STEPS:
        kind = type(dag.get_task(step)).__name__
        assert kind == ("TriggerDagRunOperator" if step == "matrix" else "RayJobOperator"), step
        if step != "matrix":
            assert dag.get_task(step).rlk_args == ["gate", step]
    assert dag.get_task("archive").trigger_rule == TriggerRule.ALL_DONE
    assert dag.get_task("strict-run").trigger_rule == TriggerRule.ALL_SUCCESS


def test_the_matrix_step_triggers_the_matrix_dag_and_waits_deferred(dag):
    matrix = dag.get_task("matrix")
    assert matrix.trigger_dag_id == "rlk_matrix"
    assert matrix.wait_for_completion and matrix.deferrable and matrix.poke_interval > 0
    assert matrix.failed_states == ["failed"] and matrix.reset_dag_run


def test_retries_tags_params_docs_and_manual_schedule(dag):
    assert type(dag.timetable).__name__ == "NullTimetable"  # manual triggers only
    assert not dag.catchup and dag.max_active_runs == 1
    assert {"rl-engine", "gate"} <= set(dag.tags) and "clean-room gate" in dag.doc_md
    assert {"commit", "workload", "model", "device"} <= set(dag.params)
    assert "repo" not in dag.params  # the repository is a setting, not the triggerer's choice
    for task in dag.tasks:
        assert task.retries >= 1 and task.retry_exponential_backoff, task.task_id
        assert task.execution_timeout is not None or task.task_id == "prepare"


def _validate(dag, **conf):
    """The values a trigger with conf would run with; a bad value raises ParamValidationError."""
    import copy

    params = copy.deepcopy(dag.params)
    params.update(conf)
    return params.validate()


@pytest.mark.parametrize("conf", [
    {**VALID, "workload": "huge"},
    {**VALID, "commit": "main"},                  # a branch is not pinned
    {},                                           # no commit
    {**VALID, "model": "relative/folder"},        # Ray workers need an absolute path
    {**VALID, "device": "tpu"},
    {**VALID, "tests": ["-x"]},                   # an option, not a test path
    {**VALID, "tests": ["/etc/passwd"]},          # outside the checkout
    {**VALID, "tests": ["../other/tests"]},
    {**VALID, "tests": ["tests/../../x.py::t"]},
    {**VALID, "cells": ["attention-XX"]},
    {**VALID, "steps": 0},
])
def test_params_reject_bad_values(dag, conf):
    from airflow.sdk.definitions.param import ParamValidationError

    with pytest.raises(ParamValidationError):
        _validate(dag, **conf)


def test_prepare_gives_every_step_options_its_rlk_gate_command_accepts(dag, bag, monkeypatch, tmp_path):
    import typer.main
    from rlk_ray.entrypoint import build_rlk_command

    from rl_engine.gate.cli import app

    monkeypatch.setenv("RLK_GATE_ROOT", str(tmp_path / "gates"))
    monkeypatch.setenv("RLK_MATRIX_ROOT", str(tmp_path / "matrices"))
    monkeypatch.setenv("RLK_GATE_REPO", ORIGIN)
    conf = _validate(dag, **VALID, model="/models/qwen3", workload="ci", build="verify")
    out = dag.get_task("prepare").python_callable(params=conf, run_id="manual__2026-11-30T05:15:59+00:00")
    gate = tmp_path / "gates" / "manual__2026-11-30T05_15_59_00_00"
    commands = typer.main.get_command(app).commands
    for step in ("checkout", "build", "verify-inputs", "tests", "strict-run", "traced-run",
                 "production-run", "archive"):
        argv = build_rlk_command(["gate", step], out[step]).split()[3:]
        parsed = commands[step].make_context(step, argv).params
        assert parsed["gate_dir"] == gate, step
    run = commands["production-run"].make_context("x", build_rlk_command(
        ["gate", "production-run"], out["production-run"]).split()[3:]).params
    assert run["workload"] == "ci" and run["model_root"] == Path("/models/qwen3") and run["trace"]
    build = commands["build"].make_context("x", build_rlk_command(["gate", "build"], out["build"]).split()[3:])
    assert build.params["install"] is False
    assert out["checkout"]["commit"] == VALID["commit"] and out["tests"]["select"] == conf["tests"]
    assert out["checkout"]["repo"] == ORIGIN
    assert (out["strict-run_num_gpus"], out["build_cluster_needs"]) == (0, {})  # cpu: no GPU asked
    assert out["archive"]["matrix-root"] == str(tmp_path / "matrices" / out["matrix_run_id"])
    # The conf the matrix step passes is one the matrix DAG's own schema accepts.
    matrix_conf = _validate(bag.dags["rlk_matrix"], **out["matrix_conf"])
    assert matrix_conf["append_history"] is False and matrix_conf["workload"] == "ci"


@pytest.fixture
def prepare(dag, monkeypatch, tmp_path):
    monkeypatch.setenv("RLK_GATE_ROOT", str(tmp_path / "gates"))
    monkeypatch.setenv("RLK_MATRIX_ROOT", str(tmp_path / "matrices"))
    monkeypatch.setenv("RLK_GATE_REPO", ORIGIN)
    return lambda **conf: dag.get_task("prepare").python_callable(
        params={**_validate(dag, **VALID), **conf}, run_id="r1")


def test_only_the_configured_origin_is_cloned(prepare, monkeypatch):
    from airflow.sdk.exceptions import AirflowFailException

    # A repo in the conf is not a param: refused at once, whatever it names.
    with pytest.raises(AirflowFailException, match=r"unknown conf keys \['repo'\]"):
        prepare(repo="https://attacker.example/evil.git")
    monkeypatch.delenv("RLK_GATE_REPO")
    with pytest.raises(AirflowFailException, match="RLK_GATE_REPO"):
        prepare()
    monkeypatch.setenv("RLK_GATE_REPO", "--upload-pack=touch /tmp/x")
    with pytest.raises(AirflowFailException, match="RLK_GATE_REPO"):
        prepare()


def test_test_paths_outside_the_checkout_are_refused_by_prepare_too(prepare):
    from airflow.sdk.exceptions import AirflowFailException

    assert prepare(tests=["tests/runtime", "tests/x.py::test_a"])["tests"]["select"] == \
        ["tests/runtime", "tests/x.py::test_a"]
    for bad in ("/etc", "../x", "tests/../../x", "a/..", "-p evil"):
        with pytest.raises(AirflowFailException, match="outside the checkout"):
            prepare(tests=[bad])


def test_cuda_gate_steps_ask_ray_for_gpus(prepare):
    out = prepare(device="cuda", workload="ci")  # launcher local: the ranks are the job's processes
    assert out["strict-run_num_gpus"] == 2 and out["build_num_gpus"] == 1 and out["tests_num_gpus"] == 1
    out = prepare(device="cuda", workload="ci", launcher="ray")
    assert out["strict-run_num_gpus"] == 0 and out["strict-run_cluster_needs"] == {"GPU": 2}
    assert out["build_num_gpus"] == 1  # the build runs on a GPU node whatever the launcher


def test_git_clone_ends_its_options_before_the_repository(tmp_path, monkeypatch):
    # A repository that reads as an option ("--upload-pack=...") would run a command.
    from rl_engine.gate import steps

    calls = []
    monkeypatch.setattr(steps, "_git", lambda *args, **kw: calls.append(args) or
                        type("Done", (), {"returncode": 1, "stderr": "fatal: not found", "stdout": ""})())
    steps._clone("--upload-pack=touch pwned", tmp_path / "c", "0123456")
    clone = calls[0]
    assert clone[0] == "clone" and clone.index("--") == clone.index("--upload-pack=touch pwned") - 1
