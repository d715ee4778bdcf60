"""`rlk up` / `rlk down`: the embedded stack as background processes.

``up`` starts the Ray head, prepares the Airflow home, then ``airflow api-server`` (on 127.0.0.1),
``scheduler``, ``dag-processor`` and ``triggerer``, each in its own session with its output in
``<state>/logs/<name>.log`` and its pid (and start time) in ``<state>/run/<name>.json``. ``down``
stops exactly those: each recorded session, then the head. A pid file whose process has another
start time (the pid was reused) is ignored, so ``down`` never signals a stranger.

Login: Airflow's simple auth manager, user ``admin``; its password is generated the first time,
printed once, and kept in ``<state>/airflow/passwords.json`` (mode 0600).
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil

from rl_engine.stack import airflow_home, pids, ray_head

# Every process of this home runs on this machine and shares its log folder, so the UI reads task
# and trigger logs from disk: the log servers (bound to every interface, not configurable) stay off.
COMMANDS = {
    "api-server": ["api-server"],
    "scheduler": ["scheduler", "--skip-serve-logs"],
    "dag-processor": ["dag-processor"],
    "triggerer": ["triggerer", "--skip-serve-logs"],
}
SERVICES = tuple(COMMANDS)
HEAD = "ray-head"
API_START_TIMEOUT_S = 180.0
STOP_GRACE_S = 20.0


@dataclasses.dataclass(kw_only=True)
class Service:
    name: str
    pid: int
    create_time: float
    log: str

    def leader(self) -> psutil.Process | None:
        return pids.leader(self.pid, self.create_time)

    def processes(self) -> list[psutil.Process]:
        """The leader, its descendants, and re-parented members of its session started after it."""
        if self.leader() is None:
            return []
        return pids.started_by(self.pid, self.create_time)


def _run_dir(state_dir: Path) -> Path:
    return Path(state_dir).resolve() / "run"


def _load(path: Path) -> Service | None:
    try:
        return Service(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def status(state_dir: Path) -> dict[str, bool]:
    """Which parts of the stack run now."""
    run = _run_dir(state_dir)
    alive = {name: bool((s := _load(run / f"{name}.json")) and s.leader()) for name in SERVICES}
    head = ray_head.RayHead.load(run / f"{HEAD}.json")
    alive[HEAD] = bool(head and head.alive())
    return alive


def ensure_password(home: airflow_home.AirflowHome) -> str | None:
    """Create the admin password file (0600) if missing; return the new password, else None."""
    path = home.passwords_file
    if path.exists():
        return None
    password = secrets.token_urlsafe(18)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump({airflow_home.ADMIN_USER: password}, fh)
        fh.write("\n")
    return password


def _start(name: str, env: dict[str, str], logs: Path, run: Path) -> Service:
    airflow = str(Path(sys.executable).with_name("airflow"))
    log = logs / f"{name}.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen([airflow, *COMMANDS[name]], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    service = Service(name=name, pid=proc.pid, create_time=psutil.Process(proc.pid).create_time(),
                      log=str(log))
    (run / f"{name}.json").write_text(json.dumps(dataclasses.asdict(service)) + "\n")
    return service


def _wait_api(url: str, api: Service, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if api.leader() is None:
            raise RuntimeError(f"airflow api-server exited; see {api.log}")
        try:
            with urllib.request.urlopen(f"{url}/api/v2/monitor/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"airflow api-server did not answer at {url} within {timeout:.0f} s; see {api.log}")


def up(state_dir: Path, matrix_base: Path, *, num_cpus: int = 4, num_gpus: int = 0,
       api_port: int | None = None, out=print) -> int:
    state_dir, matrix_base = Path(state_dir).resolve(), Path(matrix_base).resolve()
    now = status(state_dir)
    if all(now.values()):
        out(f"the stack already runs (state {state_dir}); `make down` stops it")
        return 0
    if any(now.values()):
        out("part of the stack runs; stopping it first")
        down(state_dir, out=out)
    run, logs = _run_dir(state_dir), state_dir / "logs"
    run.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    rlk_env = {"RLK_STATE_DIR": str(state_dir), "RLK_MATRIX_ROOT": str(matrix_base)}
    head = ray_head.start(state_dir=state_dir, num_cpus=num_cpus, num_gpus=num_gpus, env=rlk_env,
                          log=logs / "ray-head.log")
    head.save(run / f"{HEAD}.json")
    try:
        home = airflow_home.configure(state_dir, api_port=api_port)
        password = ensure_password(home)
        airflow_home.activate(home)
        airflow_home.migrate_and_connect(head.address)
        bin_dir = str(Path(sys.executable).parent)
        # RAY_AUTH_TOKEN_PATH: where the Ray hook of every Airflow process reads the head's token.
        env = {**os.environ, **home.env(), **rlk_env, "RAY_USAGE_STATS_ENABLED": "0",
               "RAY_AUTH_TOKEN_PATH": head.token_file,
               "PATH": os.pathsep.join([bin_dir, os.environ.get("PATH", "")])}
        started = {name: _start(name, env, logs, run) for name in SERVICES}
        _wait_api(home.api_url, started["api-server"], API_START_TIMEOUT_S)
    except BaseException:
        down(state_dir, out=out)
        raise
    out(f"Airflow UI:  {home.api_url}  (user {airflow_home.ADMIN_USER})")
    if password is not None:
        out(f"password:    {password}  (shown once; kept in {home.passwords_file}, mode 0600)")
    else:
        out(f"password:    unchanged, in {home.passwords_file}")
    out(f"Ray dashboard: {head.address}  (token in {head.token_file}, mode 0600)")
    out(f"logs: {logs}   matrix roots: {matrix_base}")
    out("the rlk_matrix DAG is paused until you unpause it; `make down` stops everything")
    return 0


def _stop(procs: list[psutil.Process]) -> None:
    """SIGTERM, a grace period to finish (all at once: they stop in parallel), then SIGKILL."""
    for sig, grace in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 5.0)):
        for p in procs:
            try:
                p.send_signal(sig)
            except psutil.Error:
                pass
        _, procs = psutil.wait_procs(procs, timeout=grace)
        if not procs:
            return


def down(state_dir: Path, *, out=print) -> int:
    """Stop what ``up`` started (the Airflow services, then the head); 0 also when nothing ran."""
    run = _run_dir(state_dir)
    stopped, procs = [], []
    for name in SERVICES:
        path = run / f"{name}.json"
        service = _load(path)
        if service is not None and service.leader() is not None:
            procs += service.processes()
            stopped.append(name)
    _stop(procs)
    for name in SERVICES:
        (run / f"{name}.json").unlink(missing_ok=True)
    head_file = run / f"{HEAD}.json"
    head = ray_head.RayHead.load(head_file)
    if head is not None and head.alive():
        head.stop()
        stopped.append(HEAD)
    head_file.unlink(missing_ok=True)
    out(f"stopped: {', '.join(stopped)}" if stopped else "nothing was running")
    return 0
