"""A real local Ray head for the plugin tests, owned and torn down by this test session.

The machine is shared: the head listens on free ports only, keeps its files in its own short
temporary folder (Ray's socket paths must stay short), and is stopped by killing exactly the
processes it started, never with ``ray stop`` (which stops every Ray on the machine).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

PLUGINS = Path(__file__).resolve().parents[2] / "plugins"
sys.path.insert(0, str(PLUGINS))

os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
# Keep Airflow's files out of the home folder of whoever runs the tests.
if "AIRFLOW_HOME" not in os.environ:
    os.environ["AIRFLOW_HOME"] = tempfile.mkdtemp(prefix="rlk-airflow-")
    atexit.register(shutil.rmtree, os.environ["AIRFLOW_HOME"], True)

_PORT_FLAGS = (
    "port", "dashboard-port", "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
    "runtime-env-agent-port", "metrics-export-port", "node-manager-port", "object-manager-port",
    "ray-client-server-port",
)
START_TIMEOUT_S = 90.0


def pytest_configure(config):
    # Raised inside Ray's own log-tail client (aiohttp's ssl=None); nothing this project can change.
    config.addinivalue_line("filterwarnings", "ignore:ssl=None is deprecated:DeprecationWarning")


def _free_ports(count: int) -> list[int]:
    # Hold every socket until all are chosen, so the same port is not handed out twice.
    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _started_by(head: subprocess.Popen, temp_dir: str) -> list[psutil.Process]:
    """The head's process tree, plus any process that names our temp folder (re-parented ones)."""
    procs: dict[int, psutil.Process] = {}
    try:
        root = psutil.Process(head.pid)
        procs[root.pid] = root
        procs.update((p.pid, p) for p in root.children(recursive=True))
    except psutil.NoSuchProcess:
        pass
    for p in psutil.process_iter(["cmdline"]):
        if any(temp_dir in arg for arg in (p.info["cmdline"] or [])):
            procs.setdefault(p.pid, p)
    procs.pop(os.getpid(), None)
    return list(procs.values())


def _stop(head: subprocess.Popen, temp_dir: str) -> None:
    # SIGKILL, not SIGTERM: a terminated head drains for up to 30 s; this test cluster holds
    # nothing worth draining.
    procs = _started_by(head, temp_dir)
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)
    head.wait(timeout=10)


def _wait_ready(head: subprocess.Popen, address: str, log: Path) -> None:
    from ray.job_submission import JobSubmissionClient

    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if head.poll() is not None:
            tail = log.read_text()[-3000:]
            raise RuntimeError(f"ray start exited with {head.returncode}:\n{tail}")
        try:
            client = JobSubmissionClient(address)
            # The first submission also waits for the job agent and the runtime-env agent.
            sid = client.submit_job(entrypoint="true")
            while not client.get_job_status(sid).is_terminal():
                time.sleep(0.2)
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


@pytest.fixture(scope="session")
def ray_address() -> Iterator[str]:
    """HTTP address of a fresh 2-CPU, GPU-less Ray head, killed at the end of the session."""
    temp_dir = tempfile.mkdtemp(prefix="rlkray-", dir="/tmp")
    ports = dict(zip(_PORT_FLAGS, _free_ports(len(_PORT_FLAGS))))
    ray = Path(sys.executable).with_name("ray")
    cmd = [
        str(ray), "start", "--head", "--block", "--temp-dir", temp_dir, "--num-cpus", "2",
        "--num-gpus", "0", "--include-dashboard=true", "--dashboard-host", "127.0.0.1",
        "--node-ip-address", "127.0.0.1", "--disable-usage-stats",
        "--object-store-memory", str(100 * 1024 * 1024),
    ] + [f"--{flag}={port}" for flag, port in ports.items()]
    log = Path(temp_dir) / "ray-start.log"
    with open(log, "w") as out:
        head = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    address = f"http://127.0.0.1:{ports['dashboard-port']}"
    try:
        _wait_ready(head, address, log)
        yield address
    finally:
        _stop(head, temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


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
