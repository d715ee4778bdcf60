"""`rlk up` / `rlk down` and the project-local Airflow home they use.

The end-to-end test starts the real stack in child processes (Airflow reads its home once per
process) and talks to it over HTTP, as a user's browser would.
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

from rl_engine.stack import airflow_home, services

RLK = [sys.executable, "-m", "rl_engine.cli"]


@pytest.fixture
def bystander():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                            start_new_session=True)
    yield proc
    proc.kill()
    proc.wait()


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_airflow_home_is_private_on_loopback_and_keeps_its_secrets_and_port(tmp_path):
    first = airflow_home.configure(tmp_path / "state")
    again = airflow_home.configure(tmp_path / "state")
    assert _mode(first.config_file) == 0o600
    s = again.settings
    assert s[("api", "host")] == "127.0.0.1" and again.api_url.startswith("http://127.0.0.1:")
    assert again.api_url == first.api_url, "the UI moved although its port was free"
    ports = {int(s[k]) for k in (("api", "port"), ("logging", "worker_log_server_port"),
                                 ("logging", "trigger_log_server_port"))}
    assert len(ports) == 3 and not ports & {8080, 8793, 8794}
    for key in (("api_auth", "jwt_secret"), ("api", "secret_key"), ("core", "fernet_key")):
        assert s[key] == first.settings[key] and len(s[key]) >= 32, key
    assert s[("database", "sql_alchemy_conn")] == f"sqlite:///{again.home / 'airflow.db'}"
    assert Path(s[("core", "dags_folder")]) == airflow_home.REPO_ROOT / "dags"
    env = again.env()
    assert env["AIRFLOW_HOME"] == str(again.home)
    assert env["AIRFLOW__CORE__AUTH_MANAGER"].endswith("SimpleAuthManager")
    other = airflow_home.configure(tmp_path / "elsewhere")
    assert other.settings[("api_auth", "jwt_secret")] != s[("api_auth", "jwt_secret")]


@pytest.mark.parametrize("cores, workers", [(range(2), "2"), (range(1), "2"), (range(12), "12")])
def test_scheduler_parallelism_is_the_cores_this_process_may_use(tmp_path, monkeypatch, cores, workers):
    # Airflow's default (32 LocalExecutor workers, about 4 GB) would swamp a 2-core machine.
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(cores))
    home = airflow_home.configure(tmp_path / "state")
    assert home.settings[("core", "parallelism")] == workers
    assert home.env()["AIRFLOW__CORE__PARALLELISM"] == workers


def test_admin_password_is_generated_once_and_readable_by_its_owner_only(tmp_path):
    home = airflow_home.configure(tmp_path / "state")
    password = services.ensure_password(home)
    assert password and len(password) >= 16 and password != "admin"
    assert _mode(home.passwords_file) == 0o600
    assert json.loads(home.passwords_file.read_text()) == {"admin": password}
    assert services.ensure_password(home) is None
    assert json.loads(home.passwords_file.read_text()) == {"admin": password}


def test_down_never_signals_a_process_whose_pid_was_reused(tmp_path, bystander):
    run = tmp_path / "run"
    run.mkdir()
    born = psutil.Process(bystander.pid).create_time()
    (run / "scheduler.json").write_text(json.dumps(
        {"name": "scheduler", "pid": bystander.pid, "create_time": born - 3600.0, "log": "x"}))
    assert services.status(tmp_path)["scheduler"] is False
    assert services.down(tmp_path, out=lambda _: None) == 0
    assert bystander.poll() is None
    assert not (run / "scheduler.json").exists()


def _listening(processes: list[psutil.Process]) -> set[tuple[str, int]]:
    """The (ip, port) every live one of processes listens on. A recorded process may exit between
    the check and the query (the scheduler's short-lived workers): it listens on nothing."""
    found = set()
    for p in processes:
        try:
            found |= {(c.laddr.ip, c.laddr.port) for c in p.net_connections(kind="inet")
                      if c.status == psutil.CONN_LISTEN}
        except psutil.NoSuchProcess:
            continue
    return found


def _alive(p: psutil.Process) -> bool:
    """Running and not a zombie; one that exits while asked is not alive."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _request(url: str, body: dict | None = None, token: str | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    data = json.dumps(body).encode() if body is not None else None
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers), timeout=30) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, {}


@pytest.mark.slow
def test_up_serves_the_ui_on_loopback_with_a_generated_password_and_down_stops_everything(tmp_path):
    state, roots = tmp_path / "state", tmp_path / "matrix-runs"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    where = ["--state-dir", str(state)]
    up = subprocess.run([*RLK, "up", *where, "--matrix-root", str(roots), "--num-cpus", "1"],
                        env=env, capture_output=True, text=True, timeout=300)
    recorded: list[psutil.Process] = []
    try:
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        url = re.search(r"Airflow UI:\s+(http://127\.0\.0\.1:\d+)", up.stdout).group(1)
        password = re.search(r"password:\s+(\S+)\s+\(shown once", up.stdout).group(1)
        assert password in (state / "airflow" / "passwords.json").read_text()
        assert services.status(state) == {name: True for name in (*services.SERVICES, services.HEAD)}
        for name in services.SERVICES:
            recorded += services._load(state / "run" / f"{name}.json").processes()
        token = state / "ray-auth-token"
        assert f"token in {token}, mode 0600" in up.stdout and _mode(token) == 0o600
        # The scheduler forks its LocalExecutor's workers at start: as many as the cores, not 32.
        scheduler = services._load(state / "run" / "scheduler.json").processes()
        assert len(scheduler) <= airflow_home.parallelism() + 4, [p.cmdline() for p in scheduler]

        assert _request(f"{url}/auth/token", {"username": "admin", "password": "admin"})[0] == 401
        code, body = _request(f"{url}/auth/token", {"username": "admin", "password": password})
        assert code == 201
        code, errors = _request(f"{url}/api/v2/importErrors", token=body["access_token"])
        assert code == 200 and errors["total_entries"] == 0
        listening = _listening(recorded)
        assert listening and all(ip == "127.0.0.1" for ip, _ in listening), listening

        again = subprocess.run([*RLK, "up", *where], env=env, capture_output=True, text=True, timeout=120)
        assert "already runs" in again.stdout and password not in again.stdout
    finally:
        down = subprocess.run([*RLK, "down", *where], env=env, capture_output=True, text=True, timeout=180)
    assert down.returncode == 0 and "ray-head" in down.stdout, down.stdout + down.stderr
    alive = [p for p in recorded if _alive(p)]
    assert not alive, alive
    assert not list((state / "run").glob("*.json"))
