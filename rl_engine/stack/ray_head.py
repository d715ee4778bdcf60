"""A local Ray head that shares the machine politely, and the way to stop exactly it.

Several Ray clusters may run on one machine (other users, other checkouts, a test session), so:
every port is a free one chosen here (Ray's defaults would collide), workers bind OS-chosen ports,
everything listens on 127.0.0.1 only, the head keeps its files in its own short temp folder (Ray's
Unix socket paths must stay under ~107 bytes), usage stats are off, and the head is stopped by
killing the processes it started, found from its pid, never with ``ray stop`` (which stops every
Ray of this user on the machine).

Ray's token authentication is on (``RAY_AUTH_MODE=token``): the Jobs API, the dashboard and the
cluster's gRPC services refuse any caller without the token, so another user of the machine cannot
run code as the head's owner through them. A new token is made at every start and kept in a file
only its owner can read (``<state>/ray-auth-token``, else in the head's temp folder); the head and
every job it runs find it through Ray's ``RAY_AUTH_TOKEN_PATH``, and a client sends it as
``Authorization: Bearer <token>`` (``RayHead.headers``).

``start`` returns a ``RayHead``; ``RayHead.save``/``load`` keep it in a JSON file, so ``rlk down``
can stop the head that ``rlk up`` started. A recorded pid is trusted only while the process with
that pid has the recorded start time, so a pid reused by an unrelated process is never signalled.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from rl_engine.stack import pids, secret_file

PORT_FLAGS = (
    "port", "dashboard-port", "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
    "runtime-env-agent-port", "metrics-export-port", "node-manager-port", "object-manager-port",
    "ray-client-server-port",
)
START_TIMEOUT_S = 120.0
# Longest temp folder we hand to Ray: it appends session_<date>_<pid>/sockets/plasma_store.
_MAX_TEMP_LEN = 40
TOKEN_FILE = "ray-auth-token"


class RayHeadError(RuntimeError):
    """The head did not start, or did not become ready to accept jobs."""


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports free on 127.0.0.1 right now."""
    # Hold every socket until all are chosen, so the same port is not handed out twice.
    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _temp_dir(state_dir: Path | None) -> tuple[Path, bool]:
    """``<state>/ray`` when that path is short enough for Ray's sockets (kept after a stop, for its
    logs), else a new /tmp folder (removed after a stop). Returns the folder and whether it is new."""
    if state_dir is not None:
        folder = Path(state_dir).resolve() / "ray"
        if len(str(folder)) <= _MAX_TEMP_LEN:
            folder.mkdir(parents=True, exist_ok=True)
            return folder, False
    return Path(tempfile.mkdtemp(prefix="rlkray-", dir="/tmp")), True


@dataclasses.dataclass(kw_only=True)
class RayHead:
    """One running head: its job-server address, its temp folder and the pid that owns it."""

    address: str          # http://127.0.0.1:<dashboard port>, the Job Submission API
    gcs_address: str      # 127.0.0.1:<port>, for ray.init / RLK_RAY_ADDRESS inside jobs
    temp_dir: str
    pid: int
    create_time: float    # psutil's start time of ``pid``; guards against pid reuse
    num_cpus: int
    token_file: str | None = None   # the cluster's token; None: a head without authentication
    owns_temp_dir: bool = True

    def headers(self) -> dict[str, str]:
        """What a Jobs API or dashboard client must send."""
        if self.token_file is None:
            return {}
        return {"Authorization": f"Bearer {Path(self.token_file).read_text().strip()}"}

    @property
    def dashboard_port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(dataclasses.asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> RayHead | None:
        try:
            return cls(**json.loads(Path(path).read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def alive(self) -> bool:
        return self._root() is not None

    def _root(self) -> psutil.Process | None:
        return pids.leader(self.pid, self.create_time)

    def processes(self) -> list[psutil.Process]:
        """The head's process tree, plus processes it started that were re-parented since."""
        return pids.started_by(self.pid, self.create_time, marker=self.temp_dir)

    def stop(self, *, remove_temp_dir: bool = True) -> None:
        """Kill every process the head started; leaves every other Ray on the machine alone."""
        # SIGKILL, not SIGTERM: a terminated head drains for up to 30 s, and nothing in the embedded
        # head is worth draining (jobs' evidence is on disk, written atomically).
        pids.kill(self.processes())
        if remove_temp_dir and self.owns_temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)


def _env(extra: dict[str, str] | None, token_file: Path) -> dict[str, str]:
    env = {**os.environ, **(extra or {}), "RAY_USAGE_STATS_ENABLED": "0",
           # Ray reads RAY_AUTH_TOKEN before the file: a stray one must not replace ours.
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_file),
           # Ray replaces --node-ip-address 127.0.0.1 by the machine's routable address and binds its
           # gRPC servers to every interface; this switch (Ray's single-machine mode, as on macOS)
           # keeps every address and listening socket on the loopback. The head is one machine.
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    # Jobs run `rlk ...` through a shell on the head; it must find this environment's rlk even when
    # the caller did not activate it.
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join([bin_dir, env.get("PATH", "")])
    env.pop("RAY_AUTH_TOKEN", None)
    return env


def start(*, state_dir: Path | None = None, num_cpus: int = 4, num_gpus: int = 0,
          object_store_mb: int = 256, env: dict[str, str] | None = None, log: Path | None = None,
          timeout: float = START_TIMEOUT_S) -> RayHead:
    """Start a head with ``num_cpus`` CPUs (never Ray's guess: a shared machine's core count is not
    ours), wait until it runs jobs, and return it. ``env`` is added to the environment of the head
    and so of every job it runs. Its output goes to ``log`` (default: ray-start.log in the temp dir)."""
    if num_cpus < 1 or num_gpus < 0:
        raise ValueError(f"num_cpus={num_cpus} must be >= 1 and num_gpus={num_gpus} >= 0")
    temp_dir, fresh = _temp_dir(state_dir)
    token_file = (Path(state_dir).resolve() if state_dir is not None else temp_dir) / TOKEN_FILE
    secret_file.write(token_file, secrets.token_hex(32) + "\n")
    ports = dict(zip(PORT_FLAGS, free_ports(len(PORT_FLAGS))))
    cmd = [
        str(Path(sys.executable).with_name("ray")), "start", "--head", "--block",
        "--temp-dir", str(temp_dir), "--num-cpus", str(num_cpus), "--num-gpus", str(num_gpus),
        "--include-dashboard=true", "--dashboard-host", "127.0.0.1", "--node-ip-address", "127.0.0.1",
        "--disable-usage-stats", "--object-store-memory", str(object_store_mb * 1024 * 1024),
        "--min-worker-port=0", "--max-worker-port=0",   # workers bind ports the OS picks
    ] + [f"--{flag}={port}" for flag, port in ports.items()]
    log = Path(log) if log is not None else temp_dir / "ray-start.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=_env(env, token_file))
    head = RayHead(address=f"http://127.0.0.1:{ports['dashboard-port']}",
                   gcs_address=f"127.0.0.1:{ports['port']}", temp_dir=str(temp_dir), pid=proc.pid,
                   create_time=psutil.Process(proc.pid).create_time(), num_cpus=num_cpus,
                   token_file=str(token_file), owns_temp_dir=fresh)
    try:
        _wait_ready(proc, head.address, head.headers(), log, timeout)
    except BaseException:
        head.stop()
        proc.wait(timeout=10)
        raise
    return head


def _wait_ready(proc: subprocess.Popen, address: str, headers: dict[str, str], log: Path,
                timeout: float) -> None:
    """Until a trivial job runs to the end: the first job also waits for the job and runtime-env
    agents, which come up after the dashboard answers."""
    from ray.job_submission import JobSubmissionClient

    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RayHeadError(f"ray start exited with {proc.returncode}: {_tail(log)}")
        try:
            client = JobSubmissionClient(address, headers=headers)
            sid = client.submit_job(entrypoint="true")
            while not client.get_job_status(sid).is_terminal():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"job {sid} did not finish")
                time.sleep(0.2)
            return
        except Exception as exc:  # noqa: BLE001 - not up yet; the deadline decides
            last = exc
            time.sleep(0.5)
    raise RayHeadError(f"Ray head at {address} did not run a job within {timeout:.0f} s "
                       f"({type(last).__name__}: {last}); see {log}")


def _tail(log: Path, lines: int = 20) -> str:
    try:
        return " | ".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
