"""End to end through Airflow's REST API: the embedded stack (`rlk up`: API server, scheduler,
DAG processor, triggerer, a local Ray head) runs the `rlk_matrix` DAG triggered over
`POST /api/v2/dags/rlk_matrix/dagRuns`, and the report view shows the run's report, in plain HTTP
and in headless Chromium.

The stack is started with `rlk up` in a subprocess (the stack activates its Airflow home in the
process that starts it, and this test process may have loaded Airflow already), on a temporary
state folder and matrix base, and stopped with `rlk down` whatever happens. The scheduler's own
cron runs are off (AIRFLOW__SCHEDULER__USE_JOB_SCHEDULE=False): unpausing the DAG would otherwise
create the nightly run of last night at once, and the DAG runs one run at a time.

The browser authenticates with the JWT as the `token` query parameter, which the view accepts for
clients that can set neither a header nor Airflow's cookie (Airflow's access log redacts it).
The workload is the ci one with the control only (the one cell that always runs), its ranks local
processes of the cell's Ray job: a whole matrix would not fit the time of a test.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from urllib.parse import quote
from html.parser import HTMLParser
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = ROOT / "test-artifacts"
DAG = "rlk_matrix"
CONF = {"workload": "ci", "cells": [], "launcher": "local", "append_history": True,
        "cell_timeout_s": 300}
UP_TIMEOUT_S, PARSE_TIMEOUT_S, RUN_TIMEOUT_S = 240, 120, 300


def _call(url: str, method: str = "GET", body: dict | None = None, token: str | None = None):
    """(status, parsed JSON body or text) of one request; HTTP errors are answers, not raises."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            status, raw = resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read().decode()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw


def _rlk(*args: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rl_engine.cli", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from rl_engine.stack.ray_head import free_ports

    work = tmp_path_factory.mktemp("e2e")
    state, base = work / "state", work / "matrix-runs"
    # Only this stack's Airflow settings: none of the caller's AIRFLOW_* may leak into it.
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    env.update(AIRFLOW__SCHEDULER__USE_JOB_SCHEDULE="False", RAY_USAGE_STATS_ENABLED="0")
    port = free_ports(1)[0]
    try:
        up = _rlk("up", "--state-dir", str(state), "--matrix-root", str(base), "--api-port", str(port),
                  "--num-cpus", "4", env=env, timeout=UP_TIMEOUT_S)
        assert up.returncode == 0, f"rlk up exited {up.returncode}:\n{up.stdout}\n{up.stderr}"
        password = json.loads((state / "airflow" / "passwords.json").read_text())["admin"]
        api = f"http://127.0.0.1:{port}"
        status, body = _call(f"{api}/auth/token", "POST", {"username": "admin", "password": password})
        assert status == 201, body
        yield {"api": api, "token": body["access_token"], "base": base, "state": state}
    finally:
        down = _rlk("down", "--state-dir", str(state), env=env, timeout=120)
        assert down.returncode == 0, down.stderr


def _wait_parsed(api: str, token: str) -> None:
    deadline = time.monotonic() + PARSE_TIMEOUT_S
    while time.monotonic() < deadline:
        status, body = _call(f"{api}/api/v2/dags/{DAG}", token=token)
        if status == 200:
            return
        time.sleep(2)
    _, errors = _call(f"{api}/api/v2/importErrors", token=token)
    pytest.fail(f"DAG {DAG} not parsed within {PARSE_TIMEOUT_S} s; import errors: {errors}")


def _task_states(api: str, token: str, run_id: str) -> str:
    _, body = _call(f"{api}/api/v2/dags/{DAG}/dagRuns/{quote(run_id)}/taskInstances", token=token)
    items = body.get("task_instances", []) if isinstance(body, dict) else []
    return ", ".join(f"{t['task_id']}[{t['map_index']}]={t['state']} (try {t['try_number']})"
                     for t in items) or str(body)


@pytest.fixture(scope="module")
def finished_run(stack):
    api, token = stack["api"], stack["token"]
    _wait_parsed(api, token)
    # A run id with characters a folder name cannot have, as Airflow's own ids do: the view has to
    # find the run behind the sanitised matrix root in the metadata database.
    run_id = f"e2e__{uuid.uuid4().hex[:8]}+00:00"
    trigger = {"dag_run_id": run_id, "logical_date": None, "conf": CONF}
    url = f"{api}/api/v2/dags/{DAG}/dagRuns"
    # Without credentials, and with a forged token: refused, and nothing is created.
    assert _call(url, "POST", trigger)[0] == 401
    assert _call(url, "POST", trigger, token="not.a.jwt")[0] in (401, 403)
    assert _call(f"{url}/{quote(run_id)}", token=token)[0] == 404
    status, body = _call(f"{api}/api/v2/dags/{DAG}", "PATCH", {"is_paused": False}, token=token)
    assert status == 200 and body["is_paused"] is False, body
    status, body = _call(url, "POST", trigger, token=token)
    assert status == 200, body
    assert body["dag_run_id"] == run_id and body["conf"]["workload"] == "ci"
    deadline, state = time.monotonic() + RUN_TIMEOUT_S, None
    while time.monotonic() < deadline:
        state = _call(f"{url}/{quote(run_id)}", token=token)[1].get("state")
        if state in ("success", "failed"):
            break
        time.sleep(3)
    tasks = _task_states(api, token, run_id)
    assert state == "success", (f"DAG run {run_id} is {state!r} after {RUN_TIMEOUT_S} s at most; "
                                f"tasks: {tasks}; logs under {stack['state'] / 'airflow' / 'logs'}")
    return run_id


def _root_name(run_id: str) -> str:
    from rl_engine.artifacts import ids

    return ids.sanitize(run_id)


def test_rest_trigger_runs_the_matrix_and_the_view_shows_its_report(stack, finished_run):
    api, token, run_id = stack["api"], stack["token"], finished_run
    name = _root_name(run_id)
    assert name != run_id
    report = json.loads((stack["base"] / name / "matrix-report.json").read_text())
    assert [c["cell"] for c in report["cells"]] == ["control"]
    assert report["verdict"]["passed"] is True
    control = report["cells"][0]["latest"]
    page_url = f"{api}/rlk/reports/{name}"
    for token_given in (None, "not.a.jwt"):
        status, body = _call(page_url, token=token_given)
        assert status in (401, 403) and "cell-control" not in str(body)
    status, page = _call(page_url, token=token)
    assert status == 200, page
    assert '<tr id="cell-control"><td>control</td><td>R/R R/R R/R</td>' in page
    assert f"<td>{control['attempt_id']}</td>" in page
    link = f"/dags/{DAG}/runs/{quote(run_id, safe='')}/tasks/control"
    assert f'href="{link}"' in page and f"DAG run <code>{run_id}</code>" in page
    # The link names a real task instance, whose log the UI shows at that route.
    status, ti = _call(f"{api}/api/v2/dags/{DAG}/dagRuns/{quote(run_id)}/taskInstances/control",
                       token=token)
    assert status == 200 and ti["state"] == "success", ti
    status, index = _call(f"{api}/rlk/", token=token)
    assert status == 200 and f'href="/rlk/reports/{name}"' in index
    status, hist = _call(f"{api}/rlk/history", token=token)
    assert status == 200 and "<svg" in hist and f">{name}</a>" in hist
    status, plugins = _call(f"{api}/api/v2/plugins", token=token)
    views = [v for p in plugins["plugins"] if p["name"] == "rlk_ui" for v in p["external_views"]]
    assert [v["href"] for v in views] == ["rlk/"], plugins


class _Cells(HTMLParser):
    def __init__(self):
        super().__init__()
        self.row: list[str] | None = None
        self.cells: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "tr" and dict(attrs).get("id") == "cell-control":
            self.row = []
        elif tag == "td" and self.row is not None:
            self.cells.append("")

    def handle_endtag(self, tag):
        if tag == "tr":
            self.row = None

    def handle_data(self, data):
        if self.row is not None and self.cells:
            self.cells[-1] += data


def _chromium(*args: str, profile: Path) -> subprocess.CompletedProcess:
    cmd = [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
           "--no-first-run", "--disable-background-networking", "--disable-component-update",
           "--disable-sync", f"--user-data-dir={profile}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=90)


def test_report_view_in_headless_chromium(stack, finished_run, tmp_path):
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is absent (Debian: apt-get install --no-install-recommends chromium)")
    name = _root_name(finished_run)
    url = f"{stack['api']}/rlk/reports/{name}?token={stack['token']}"
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "rlk-report-view.png"
    shot.unlink(missing_ok=True)
    done = _chromium(f"--screenshot={shot}", "--window-size=1400,900", url, profile=tmp_path / "p1")
    assert done.returncode == 0, done.stderr[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    dom = _chromium("--dump-dom", url, profile=tmp_path / "p2")
    assert dom.returncode == 0, dom.stderr[-2000:]
    report = json.loads((stack["base"] / name / "matrix-report.json").read_text())
    latest = report["cells"][0]["latest"]
    parser = _Cells()
    parser.feed(dom.stdout)
    cells = [c.strip() for c in parser.cells]
    assert cells[:7] == ["control", "R/R R/R R/R", "yes", "yes", "yes", str(latest["mismatch_count"]),
                         f"{latest['max_abs_diff']:.3g}"], cells
    assert re.fullmatch(r"\d+ min \d\d s|\d+ s", cells[7]) and cells[8] == latest["attempt_id"], cells
    assert cells[10] == "task log"
    assert stack["token"] not in dom.stdout  # the page never echoes the credential
    # Airflow's access log redacts the token query parameter of the browser's requests.
    log = (stack["state"] / "logs" / "api-server.log").read_text()
    assert f"/rlk/reports/{name}" in log and stack["token"] not in log
    history = ARTIFACTS / "rlk-history-view.png"
    history.unlink(missing_ok=True)
    done = _chromium(f"--screenshot={history}", "--window-size=1400,900",
                     f"{stack['api']}/rlk/history?token={stack['token']}", profile=tmp_path / "p3")
    assert done.returncode == 0 and history.stat().st_size > 10_000, done.stderr[-2000:]
