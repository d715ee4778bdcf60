"""RayJobOperator and the entrypoint builder: safe commands, submit then defer, exit codes."""

from __future__ import annotations

import asyncio
import math
import re
import shlex
from types import SimpleNamespace

import pytest
from airflow.sdk.exceptions import AirflowException, AirflowFailException, TaskDeferred

from rlk_ray.entrypoint import build_rlk_command
from rlk_ray.hooks import RayJobHook
from rlk_ray.operators import RayJobOperator, submission_id_for
from rlk_ray.triggers import RayJobTrigger


def context(run_id: str, task_id: str = "cell", map_index: int = 3, try_number: int = 1) -> dict:
    ti = SimpleNamespace(dag_id="nightly", run_id=run_id, task_id=task_id, map_index=map_index,
                         try_number=try_number)
    return {"ti": ti}


# The entrypoint builder.


def test_builder_quotes_every_argument_and_round_trips():
    options = {"cell": "tp2 cp1", "dry-run": True, "skip": False, "seed": None, "tp": 2,
               "lr": 0.5, "tag": ["a b", "c"], "note": "$(reboot); rm -rf / `id`"}
    command = build_rlk_command(["matrix", "run-cell"], options)
    assert command.startswith(
        "rlk matrix run-cell '--cell=tp2 cp1' --dry-run --tp=2 --lr=0.5 '--tag=a b' --tag=c "
    )
    # Shell metacharacters stay inside one quoted argument.
    assert shlex.split(command) == [
        "rlk", "matrix", "run-cell", "--cell=tp2 cp1", "--dry-run", "--tp=2", "--lr=0.5",
        "--tag=a b", "--tag=c", "--note=$(reboot); rm -rf / `id`",
    ]


def test_positional_arguments_follow_a_double_dash():
    command = build_rlk_command(["manifest", "verify"], {"strict": True}, ["-odd name.json"])
    assert shlex.split(command) == ["rlk", "manifest", "verify", "--strict", "--", "-odd name.json"]
    for bad in ("a.json", ["a\nb"], [1]):
        with pytest.raises(ValueError, match="positional"):
            build_rlk_command(["manifest", "verify"], {}, bad)


@pytest.mark.parametrize(
    "name", ["Tp", "tp_size", "1tp", "tp\n", "-tp", "", "tp=1", "tp size", "tp\x00"]
)
def test_builder_rejects_bad_option_names(name):
    with pytest.raises(ValueError, match="option name"):
        build_rlk_command(["run"], {name: 1})


@pytest.mark.parametrize(
    "value", ["a\nrm -rf /", "a\rb", "a\x00b", ["ok", "b\nc"], {"k": "v"}, b"raw", math.nan, [True]]
)
def test_builder_rejects_bad_values(value):
    with pytest.raises(ValueError, match="'cell'"):
        build_rlk_command(["run"], {"cell": value})


@pytest.mark.parametrize("verb", [[], "run", ["Run"], ["run cell"], ["--help"], ["run", "x;y"]])
def test_builder_rejects_bad_verbs(verb):
    with pytest.raises(ValueError):
        build_rlk_command(verb, {})


# The operator without Ray.


def test_operator_needs_exactly_one_command_and_defaults_to_backed_off_retries():
    with pytest.raises(ValueError, match="exactly one"):
        RayJobOperator(task_id="t")
    with pytest.raises(ValueError, match="exactly one"):
        RayJobOperator(task_id="t", rlk_args=["run"], entrypoint="echo")
    with pytest.raises(ValueError, match="need rlk_args"):
        RayJobOperator(task_id="t", entrypoint="echo", rlk_positional=["x"])
    op = RayJobOperator(task_id="t", rlk_args=["run"])
    assert op.retries == 2 and op.retry_exponential_backoff == 2.0
    # A literal entrypoint is never rendered from params; rlk_args/rlk_options are, then validated.
    assert "entrypoint" not in op.template_fields and "rlk_options" in op.template_fields


def test_rendered_options_are_validated_before_anything_is_submitted():
    op = RayJobOperator(task_id="t", rlk_args=["run"], rlk_options={"cell": "x\nrm -rf /"})
    with pytest.raises(ValueError, match="line breaks"):
        op.execute(context("never-submitted"))


def test_submission_id_is_one_per_try_and_sanitised():
    sid = submission_id_for("nightly", "manual__2026-01-01T00:00:00+00:00", "cells.run", 3, 2)
    assert sid == "nightly-manual__2026-01-01T00_00_00_00_00-cells.run-3-try2"
    assert re.fullmatch(r"[A-Za-z0-9._-]+", submission_id_for("d", "r/../x y", "t", -1, 1))
    # The same run id and try created again (a deleted, re-triggered run) still gets a new id.
    a = submission_id_for("d", "r", "t", -1, 1, "0191c0de-0000-7000-8000-000000000001")
    b = submission_id_for("d", "r", "t", -1, 1, "0191c0df-0000-7000-8000-000000000001")
    assert a != b and a.endswith("-try1-0191c0de")


def test_execute_complete_maps_events_to_the_exit_code_contract():
    op = RayJobOperator(task_id="t", rlk_args=["run"])
    assert op.execute_complete({}, {"status": "SUCCEEDED", "submission_id": "s"}) == "s"
    # Only the log marker gives the code: still honoured.
    marker_only = {"status": "FAILED", "submission_id": "s", "exit_code": None, "message": "failed",
                   "log_tail": ["usage: rlk run", "[rlk] exit-code 2"]}
    with pytest.raises(AirflowFailException, match="exit code 2: bad input"):
        op.execute_complete({}, marker_only)
    retried = [
        {"status": "FAILED", "submission_id": "s", "exit_code": None, "message": "no runtime env"},
        {"status": "FAILED", "submission_id": "s", "exit_code": 137, "message": "killed"},
        {"status": "STOPPED", "submission_id": "s", "reason": "infeasible: no node has GPU=1"},
        {"status": "LOST", "submission_id": "s", "reason": "job server did not answer"},
    ]
    for event in retried:
        with pytest.raises(AirflowException) as err:
            op.execute_complete({}, event)
        assert not isinstance(err.value, AirflowFailException), event


# The operator against the real head.


def submit(op: RayJobOperator, ctx: dict) -> RayJobTrigger:
    with pytest.raises(TaskDeferred) as deferred:
        op.execute(ctx)
    assert deferred.value.method_name == "execute_complete"
    return deferred.value.trigger


def run_trigger(trigger: RayJobTrigger) -> dict:
    async def collect():
        return [event.payload async for event in trigger.run()]

    (event,) = asyncio.run(asyncio.wait_for(collect(), 60))
    return event


def test_execute_submits_and_defers_then_on_kill_stops_the_job(ray_connection, wait_status):
    op = RayJobOperator(task_id="cell", entrypoint="sleep 60", num_cpus=0.5, pending_timeout=30,
                        poll_interval=1)
    trigger = submit(op, context("op-kill"))
    sid = "nightly-op-kill-cell-3-try1"
    _, kwargs = trigger.serialize()
    assert kwargs["submission_id"] == sid and kwargs["address"] == ray_connection
    assert kwargs["entrypoint_num_cpus"] == 0.5
    assert (kwargs["pending_timeout"], kwargs["poll_interval"]) == (30, 1)
    hook = RayJobHook(address=ray_connection)
    wait_status(hook, sid, {"RUNNING"})
    op.on_kill()
    assert wait_status(hook, sid, {"STOPPED", "SUCCEEDED", "FAILED"}, timeout=30) == "STOPPED"


def rlk_exit(code: int) -> str:
    # What the rlk CLI does on the way out: print the marker, then exit with the code.
    script = f"import sys; print('working'); print('[rlk] exit-code {code}'); sys.exit({code})"
    return shlex.join(["python", "-c", script])


def test_exit_3_is_retried(ray_connection):
    op = RayJobOperator(task_id="cell", entrypoint=rlk_exit(3), poll_interval=0.3)
    event = run_trigger(submit(op, context("op-exit3")))
    assert (event["status"], event["exit_code"]) == ("FAILED", 3)
    assert event["log_tail"][-1] == "[rlk] exit-code 3"
    with pytest.raises(AirflowException, match="exit code 3: infrastructure failure") as err:
        op.execute_complete({}, event)
    assert not isinstance(err.value, AirflowFailException)


def test_exit_1_fails_without_retry(ray_connection):
    op = RayJobOperator(task_id="cell", entrypoint=rlk_exit(1), poll_interval=0.3)
    event = run_trigger(submit(op, context("op-exit1")))
    assert (event["status"], event["exit_code"]) == ("FAILED", 1)
    with pytest.raises(AirflowFailException, match="exit code 1: parity failure"):
        op.execute_complete({}, event)
