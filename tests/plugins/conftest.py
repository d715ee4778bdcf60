"""A real local Ray head for the plugin tests, owned and torn down by this test session.

The head is the embedded stack's (rl_engine.stack.ray_head): free ports on loopback, its own short
temporary folder, stopped by killing exactly the processes it started, never with ``ray stop``.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

PLUGINS = Path(__file__).resolve().parents[2] / "plugins"
sys.path.insert(0, str(PLUGINS))

os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
# Keep Airflow's files out of the home folder of whoever runs the tests.
if "AIRFLOW_HOME" not in os.environ:
    os.environ["AIRFLOW_HOME"] = tempfile.mkdtemp(prefix="rlk-airflow-")
    atexit.register(shutil.rmtree, os.environ["AIRFLOW_HOME"], True)


@pytest.fixture(scope="session")
def ray_address() -> Iterator[str]:
    """HTTP address of a fresh 2-CPU, GPU-less Ray head, killed at the end of the session. It
    requires its token, which the hook finds as a deployment gives it: Ray's RAY_AUTH_TOKEN_PATH."""
    from rl_engine.stack import ray_head

    head = ray_head.start(num_cpus=2, object_store_mb=100)
    saved = os.environ.get("RAY_AUTH_TOKEN_PATH")
    os.environ["RAY_AUTH_TOKEN_PATH"] = head.token_file
    try:
        yield head.address
    finally:
        head.stop()
        if saved is None:
            os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
        else:
            os.environ["RAY_AUTH_TOKEN_PATH"] = saved


@pytest.fixture
def ray_connection(ray_address, monkeypatch) -> str:
    """The head as the Airflow connection ``ray_default`` (host/port), as a deployment sets it."""
    host_port = ray_address.removeprefix("http://")
    host, port = host_port.split(":")
    conn = {"conn_type": "http", "host": host, "port": int(port)}
    monkeypatch.setenv("AIRFLOW_CONN_RAY_DEFAULT", json.dumps(conn))
    for name in ("RLK_RAY_ADDRESS", "RAY_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    return ray_address


@pytest.fixture
def wait_status():
    """``wait_status(hook, id, {"RUNNING"})``: poll until the job's status is one of those."""

    def wait(hook, submission_id: str, wanted: set[str], timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while (status := str(hook.status(submission_id))) not in wanted:
            assert time.monotonic() < deadline, f"{submission_id} still {status}, not {wanted}"
            time.sleep(0.2)
        return status

    return wait
