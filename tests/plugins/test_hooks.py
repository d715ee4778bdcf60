"""RayJobHook: where the address comes from, and the job calls against a real Ray head."""

from __future__ import annotations

import asyncio
import json
import shlex

import pytest
from airflow.sdk.exceptions import AirflowException, AirflowNotFoundException

from rlk_ray.hooks import RayJobHook


@pytest.fixture
def no_address(monkeypatch):
    for name in ("RLK_RAY_ADDRESS", "RAY_ADDRESS", "AIRFLOW_CONN_RAY_DEFAULT"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_address_from_connection_wins_over_environment(no_address):
    conn = {"conn_type": "http", "host": "ray-head", "port": 8270}
    no_address.setenv("AIRFLOW_CONN_RAY_DEFAULT", json.dumps(conn))
    no_address.setenv("RAY_ADDRESS", "http://elsewhere:1")
    assert RayJobHook().address == "http://ray-head:8270"


def test_connection_host_keeps_its_scheme_and_port_defaults_to_dashboard(no_address):
    conn = {"conn_type": "http", "host": "https://ray.example/"}
    no_address.setenv("AIRFLOW_CONN_RAY_TLS", json.dumps(conn))
    assert RayJobHook(conn_id="ray_tls").address == "https://ray.example:8265"


def test_address_from_environment_without_connection(no_address):
    no_address.setenv("RAY_ADDRESS", "http://10.0.0.5:8265")
    assert RayJobHook().address == "http://10.0.0.5:8265"
    no_address.setenv("RLK_RAY_ADDRESS", "http://10.0.0.6:8265")
    assert RayJobHook().address == "http://10.0.0.6:8265"


def test_missing_address_error_names_connection_and_variables(no_address):
    with pytest.raises(AirflowNotFoundException) as err:
        RayJobHook(conn_id="ray_missing").address
    text = str(err.value)
    assert "ray_missing" in text and "RAY_ADDRESS" in text and "RLK_RAY_ADDRESS" in text


def test_token_from_connection_password_else_rays_variables(no_address, tmp_path):
    for name in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        no_address.delenv(name, raising=False)
    assert RayJobHook(address="http://h:1").headers() == {}
    token_file = tmp_path / "token"
    token_file.write_text("from-the-file\n")
    no_address.setenv("RAY_AUTH_TOKEN_PATH", str(token_file))
    assert RayJobHook(address="http://h:1").headers() == {"Authorization": "Bearer from-the-file"}
    no_address.setenv("RAY_AUTH_TOKEN", "from-the-variable")
    assert RayJobHook(address="http://h:1").auth_token() == "from-the-variable"
    conn = {"conn_type": "http", "host": "ray-head", "port": 8265, "password": "from-the-connection"}
    no_address.setenv("AIRFLOW_CONN_RAY_DEFAULT", json.dumps(conn))
    assert RayJobHook(address="http://h:1").auth_token() == "from-the-connection"


def test_unreadable_token_file_is_named(no_address, tmp_path):
    no_address.delenv("RAY_AUTH_TOKEN", raising=False)
    no_address.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "missing"))
    with pytest.raises(AirflowException, match="RAY_AUTH_TOKEN_PATH=.*missing"):
        RayJobHook(address="http://h:1").headers()


def test_the_cluster_refuses_a_hook_without_its_token(ray_address, monkeypatch):
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH")
    monkeypatch.delenv("AIRFLOW_CONN_RAY_DEFAULT", raising=False)
    with pytest.raises(Exception, match="Unauthorized"):
        RayJobHook(address=ray_address).submit("echo never", "hooks-no-token")


def test_submit_with_runtime_env_then_status_and_logs(ray_connection, wait_status):
    hook = RayJobHook()
    code = "import os; print('greeting:', os.environ['RLK_GREETING'])"
    sid = hook.submit(
        shlex.join(["python", "-c", code]),
        "hooks-runtime-env",
        entrypoint_num_cpus=0.5,
        runtime_env={"env_vars": {"RLK_GREETING": "hello there"}},
    )
    assert sid == "hooks-runtime-env"
    assert wait_status(hook, sid, {"SUCCEEDED", "FAILED", "STOPPED"}) == "SUCCEEDED"
    assert "greeting: hello there" in hook.logs(sid)
    assert hook.info(sid).driver_exit_code == 0


def test_stop_ends_a_running_job(ray_address, wait_status):
    hook = RayJobHook(address=ray_address)
    sid = hook.submit("sleep 60", "hooks-stop")
    wait_status(hook, sid, {"RUNNING"})
    assert hook.stop(sid) is True
    assert wait_status(hook, sid, {"STOPPED", "SUCCEEDED", "FAILED"}, timeout=30) == "STOPPED"


def test_async_calls_tail_the_log_and_read_the_cluster(ray_address):
    hook = RayJobHook(address=ray_address)
    sid = hook.submit("echo streamed-by-tail", "hooks-async")

    async def follow():
        chunks = [chunk async for chunk in hook.atail_logs(sid)]
        while not (info := await hook.ainfo(sid)).status.is_terminal():
            await asyncio.sleep(0.2)
        return chunks, info, await hook.alogs(sid), await hook.anode_totals()

    chunks, info, logs, totals = asyncio.run(follow())
    assert "streamed-by-tail" in "".join(chunks) and "streamed-by-tail" in logs
    assert str(info.status) == "SUCCEEDED"
    # The test head: one node, 2 CPUs, no GPU (the trigger's feasibility check relies on this).
    assert [t.get("CPU") for t in totals] == [2.0]
    assert "GPU" not in totals[0] or totals[0]["GPU"] == 0.0
