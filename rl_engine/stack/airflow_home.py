"""A project-local Airflow home on SQLite: ``<state>/airflow``.

Its DAGs and plugins are this repository's ``dags/`` and ``plugins/``; the ``ray_default``
connection points at the embedded Ray head. The same settings are written to ``airflow.cfg`` (so
``AIRFLOW_HOME=.state/airflow airflow ...`` works by hand) and returned as ``AIRFLOW__*`` variables
for the processes we start, so an Airflow configured elsewhere in the caller's environment is never
picked up by mistake. Secrets (JWT, API, Fernet) are generated once and kept in ``airflow.cfg``,
which, like the password file, is readable by its owner only.

Every port is a free one chosen here (the default 8080/8793/8794 may belong to another Airflow on a
shared machine); the UI keeps its port across restarts while that port stays free. The API server
listens on 127.0.0.1 only.

The scheduler's LocalExecutor keeps up to ``[core] parallelism`` worker processes (about 130 MB
each); Airflow's default of 32 is sized for a server, so here it is the number of cores this
process may use (at least 2). A task that waits for a Ray job defers and frees its worker, so
the cores, not the number of cells, are what bounds the work done here.
"""

from __future__ import annotations

import base64
import configparser
import dataclasses
import os
import secrets
import socket
import sys
from pathlib import Path

from rl_engine.stack.ray_head import free_ports

REPO_ROOT = Path(__file__).resolve().parents[2]
RAY_CONN_ID = "ray_default"
SIMPLE_AUTH = "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager"
ADMIN_USER = "admin"


@dataclasses.dataclass(frozen=True, kw_only=True)
class AirflowHome:
    home: Path
    settings: dict[tuple[str, str], str]

    @property
    def config_file(self) -> Path:
        return self.home / "airflow.cfg"

    @property
    def passwords_file(self) -> Path:
        return Path(self.settings[("core", "simple_auth_manager_passwords_file")])

    @property
    def api_url(self) -> str:
        return self.settings[("api", "base_url")]

    def env(self) -> dict[str, str]:
        """The variables every process of this home runs with."""
        env = {"AIRFLOW_HOME": str(self.home), "AIRFLOW_CONFIG": str(self.config_file)}
        env.update({f"AIRFLOW__{s.upper()}__{k.upper()}": v for (s, k), v in self.settings.items()})
        return env


def _previous(cfg: Path) -> dict[tuple[str, str], str]:
    """The secrets and the UI port of an earlier start, if any."""
    keys = (("core", "fernet_key"), ("api", "secret_key"), ("api_auth", "jwt_secret"), ("api", "port"))
    parser = configparser.ConfigParser(interpolation=None)
    try:
        parser.read(cfg)
    except configparser.Error:
        return {}
    return {k: parser.get(*k) for k in keys if parser.has_option(*k) and parser.get(*k)}


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _new_secrets() -> dict[tuple[str, str], str]:
    return {
        ("core", "fernet_key"): base64.urlsafe_b64encode(secrets.token_bytes(32)).decode(),
        ("api", "secret_key"): secrets.token_urlsafe(32),
        ("api_auth", "jwt_secret"): secrets.token_urlsafe(32),
    }


def parallelism() -> int:
    """Worker processes of the LocalExecutor: the usable cores (affinity, not the host's count)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform
        cores = os.cpu_count() or 1
    return max(2, cores)


def configure(state_dir: Path, *, repo_root: Path = REPO_ROOT, api_port: int | None = None) -> AirflowHome:
    """Write ``<state>/airflow/airflow.cfg`` and return the home; touches no database."""
    state_dir = Path(state_dir).resolve()
    home = state_dir / "airflow"
    dags, plugins = Path(repo_root) / "dags", Path(repo_root) / "plugins"
    for folder in (dags, plugins):
        if not folder.is_dir():
            raise FileNotFoundError(f"{folder} does not exist; the embedded stack runs from a "
                                    "checkout of the repository (pip install -e .)")
    home.mkdir(parents=True, exist_ok=True)
    cfg = home / "airflow.cfg"
    previous = _previous(cfg)
    if api_port is None and previous.get(("api", "port"), "").isdigit():
        # Keep the UI where it was (a bookmark still works) unless something else took the port.
        old = int(previous[("api", "port")])
        api_port = old if _port_free(old) else None
    log_port, trigger_log_port, fresh = free_ports(3)
    api_port = api_port or fresh
    base_url = f"http://127.0.0.1:{api_port}"
    settings = {
        ("core", "dags_folder"): str(dags),
        ("core", "plugins_folder"): str(plugins),
        ("core", "load_examples"): "False",
        ("core", "executor"): "LocalExecutor",
        ("core", "parallelism"): str(parallelism()),
        ("core", "auth_manager"): SIMPLE_AUTH,
        ("core", "simple_auth_manager_users"): f"{ADMIN_USER}:admin",
        ("core", "simple_auth_manager_all_admins"): "False",
        ("core", "simple_auth_manager_passwords_file"): str(home / "passwords.json"),
        ("core", "execution_api_server_url"): f"{base_url}/execution/",
        ("core", "dags_are_paused_at_creation"): "True",
        ("database", "sql_alchemy_conn"): f"sqlite:///{home / 'airflow.db'}",
        ("api", "host"): "127.0.0.1",
        ("api", "port"): str(api_port),
        ("api", "base_url"): base_url,
        ("logging", "base_log_folder"): str(home / "logs"),
        ("logging", "worker_log_server_port"): str(log_port),
        ("logging", "trigger_log_server_port"): str(trigger_log_port),
        ("dag_processor", "refresh_interval"): "30",
        ("scheduler", "enable_health_check"): "False",
        **_new_secrets(),
    }
    settings.update({k: v for k, v in previous.items() if k != ("api", "port")})
    _write_cfg(cfg, settings)
    return AirflowHome(home=home, settings=settings)


def _write_cfg(path: Path, settings: dict[tuple[str, str], str]) -> None:
    parser = configparser.ConfigParser(interpolation=None)
    for (section, key), value in settings.items():
        if not parser.has_section(section):
            parser.add_section(section)
        parser.set(section, key, value)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write("# Written by `rlk demo` / `rlk up` (rl_engine/stack/airflow_home.py); rewritten on\n"
                 "# every start: ports change, secrets are kept.\n")
        parser.write(fh)
    os.replace(tmp, path)


def activate(home: AirflowHome) -> None:
    """Point this process at ``home``; must happen before Airflow is first imported here."""
    loaded = sys.modules.get("airflow.configuration")
    if loaded is not None and Path(loaded.AIRFLOW_HOME).resolve() != home.home:
        raise RuntimeError(f"Airflow was already loaded in this process with AIRFLOW_HOME="
                           f"{loaded.AIRFLOW_HOME}; start a new process for {home.home}")
    os.environ.update(home.env())


def migrate_and_connect(ray_address: str) -> None:
    """``airflow db migrate`` (in this process) and the ``ray_default`` connection to the head
    at ``ray_address`` (http://host:port of its dashboard), replacing an older one."""
    from sqlalchemy import delete

    from airflow.models.connection import Connection
    from airflow.utils import db
    from airflow.utils.session import create_session

    db.upgradedb()
    host_port = ray_address.split("://", 1)[-1]
    host, port = host_port.rsplit(":", 1)
    with create_session() as session:
        session.execute(delete(Connection).where(Connection.conn_id == RAY_CONN_ID))
        session.add(Connection(conn_id=RAY_CONN_ID, conn_type="http", host=host, port=int(port),
                               description="Ray Job Submission API of the embedded Ray head"))


def prepare(state_dir: Path, *, ray_address: str, api_port: int | None = None) -> AirflowHome:
    """Configure, activate in this process, migrate the database and set the Ray connection."""
    home = configure(state_dir, api_port=api_port)
    activate(home)
    migrate_and_connect(ray_address)
    return home
