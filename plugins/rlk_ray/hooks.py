"""RayJobHook: submit, watch and stop Ray jobs through the Ray Job Submission API.

The address is the Ray dashboard's HTTP address (the Job Submission API is served there). It comes
from the Airflow connection (``host``/``port`` -> ``http://host:port``; a ``host`` that already
has a scheme keeps it), else from ``RLK_RAY_ADDRESS`` (rl-engine's setting, see
``rl_engine/envs.py``), else from ``RAY_ADDRESS`` (Ray's own).

The token: a Ray cluster started with ``RAY_AUTH_MODE=token`` (the embedded head is, and so are
the compose nodes) refuses every job call without it. It is the connection's password, else Ray's
own ``RAY_AUTH_TOKEN`` (the token) or ``RAY_AUTH_TOKEN_PATH`` (a file holding it), and goes out as
``Authorization: Bearer <token>`` on every call, the log tail included. Ray's client adds the
header by itself only where ``RAY_AUTH_MODE=token`` is set in the caller's own environment, which
an Airflow worker has no reason to set.

``JobSubmissionClient`` is synchronous (``requests``), except its log tail. The ``a*`` methods run
the synchronous calls in a worker thread with a timeout, so a trigger's event loop never waits on
the network; ``atail_logs`` is Ray's own async websocket tail.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseHook
from airflow.sdk.exceptions import AirflowException, AirflowNotFoundException

if TYPE_CHECKING:
    # Ray is imported when first used, so a DAG file that imports the operator parses quickly.
    from ray.job_submission import JobDetails, JobStatus, JobSubmissionClient

# Ray's default dashboard port, used when the connection gives a host but no port.
DEFAULT_DASHBOARD_PORT = 8265
# Seconds an async call may wait for the job server before it counts as failed; the
# synchronous client has no timeout of its own.
REQUEST_TIMEOUT_S = 30.0
ADDRESS_VARIABLES = ("RLK_RAY_ADDRESS", "RAY_ADDRESS")
TOKEN_VARIABLE, TOKEN_FILE_VARIABLE = "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"


class RayJobHook(BaseHook):
    """Talk to one Ray cluster's Job Submission API.

    :param conn_id: Airflow connection holding the dashboard's host and port.
    :param address: an explicit address; skips the connection and the environment for the
        address (the trigger passes the one the operator used). The token is still looked up.
    """

    conn_name_attr = "conn_id"
    default_conn_name = "ray_default"
    conn_type = "ray"
    hook_name = "Ray Jobs"

    def __init__(self, conn_id: str = default_conn_name, address: str | None = None) -> None:
        super().__init__()
        self.conn_id = conn_id
        self._address = address
        self._client: JobSubmissionClient | None = None
        self._client_lock = threading.Lock()

    @property
    def address(self) -> str:
        if self._address is None:
            self._address = self._resolve_address()
        return self._address

    def _resolve_address(self) -> str:
        try:
            conn = self.get_connection(self.conn_id)
        except AirflowNotFoundException:
            conn = None
        if conn is not None and conn.host:
            host = conn.host.rstrip("/")
            base = host if "://" in host else f"http://{host}"
            return f"{base}:{conn.port or DEFAULT_DASHBOARD_PORT}"
        for name in ADDRESS_VARIABLES:
            if os.environ.get(name):
                return os.environ[name]
        raise AirflowNotFoundException(
            f"no Ray address: define the Airflow connection {self.conn_id!r} with the Ray "
            f"dashboard's host and port, or set {' or '.join(ADDRESS_VARIABLES)}"
        )

    def auth_token(self) -> str | None:
        """The cluster's token (see the module docstring), ``None`` for a cluster without one."""
        try:
            conn = self.get_connection(self.conn_id)
        except AirflowNotFoundException:
            conn = None
        if conn is not None and conn.password:
            return conn.password
        if os.environ.get(TOKEN_VARIABLE):
            return os.environ[TOKEN_VARIABLE]
        path = os.environ.get(TOKEN_FILE_VARIABLE)
        if not path:
            return None
        try:
            token = Path(path).read_text().strip()
        except OSError as exc:
            raise AirflowException(f"{TOKEN_FILE_VARIABLE}={path} is not readable ({exc.strerror}); "
                                   "point it at the Ray cluster's token file") from None
        return token or None

    def headers(self) -> dict[str, str]:
        token = self.auth_token()
        return {"Authorization": f"Bearer {token}"} if token else {}

    def get_client(self) -> JobSubmissionClient:
        # Building the client makes two HTTP calls (version checks); build it once per hook.
        from ray.job_submission import JobSubmissionClient

        with self._client_lock:
            if self._client is None:
                self._client = JobSubmissionClient(self.address, headers=self.headers() or None)
            return self._client

    def get_conn(self) -> JobSubmissionClient:
        return self.get_client()

    # Synchronous API, for the operator on a worker.

    def submit(
        self,
        entrypoint: str,
        submission_id: str,
        *,
        entrypoint_num_cpus: float | None = None,
        entrypoint_num_gpus: float | None = None,
        resources: dict[str, float] | None = None,
        runtime_env: dict[str, Any] | None = None,
        metadata: dict[str, str] | None = None,
    ) -> str:
        """Submit ``entrypoint`` as job ``submission_id``; return the submission id."""
        return self.get_client().submit_job(
            entrypoint=entrypoint,
            submission_id=submission_id,
            entrypoint_num_cpus=entrypoint_num_cpus,
            entrypoint_num_gpus=entrypoint_num_gpus,
            entrypoint_resources=resources or None,
            runtime_env=runtime_env or None,
            metadata=metadata,
        )

    def info(self, submission_id: str) -> JobDetails:
        return self.get_client().get_job_info(submission_id)

    def status(self, submission_id: str) -> JobStatus:
        return self.get_client().get_job_status(submission_id)

    def stop(self, submission_id: str) -> bool:
        """Ask Ray to stop the job; ``False`` when it had already ended."""
        return self.get_client().stop_job(submission_id)

    def logs(self, submission_id: str) -> str:
        return self.get_client().get_job_logs(submission_id)

    def node_totals(self) -> list[dict[str, float]]:
        """Total resources of every alive node (CPU, GPU, memory, custom), one dict per node."""
        from ray.util.state import StateApiClient
        from ray.util.state.common import ListApiOptions, StateResource

        # ray.util.state.list_nodes takes no headers; its client does (and then needs the
        # content type, which it otherwise sets itself).
        client = StateApiClient(self.address, headers={"Content-Type": "application/json",
                                                       **self.headers()})
        options = ListApiOptions(filters=[("state", "=", "ALIVE")], detail=True,
                                 timeout=int(REQUEST_TIMEOUT_S))
        nodes = client.list(StateResource.NODES, options=options, raise_on_missing_output=False)
        return [dict(node.resources_total or {}) for node in nodes]

    # Asynchronous API, for the trigger: nothing here blocks the event loop.

    async def _in_thread(self, func, *args):
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for returns the result of a call that
        # ends just as its caller is cancelled, and the cancellation is lost (a trigger cancelled
        # between polls then kept watching its job to the end).
        async with asyncio.timeout(REQUEST_TIMEOUT_S):
            return await asyncio.to_thread(func, *args)

    async def ainfo(self, submission_id: str) -> JobDetails:
        return await self._in_thread(self.info, submission_id)

    async def astop(self, submission_id: str) -> bool:
        return await self._in_thread(self.stop, submission_id)

    async def alogs(self, submission_id: str) -> str:
        return await self._in_thread(self.logs, submission_id)

    async def anode_totals(self) -> list[dict[str, float]]:
        return await self._in_thread(self.node_totals)

    async def atail_logs(self, submission_id: str) -> AsyncIterator[str]:
        """Yield chunks of the job's output as the driver writes them, until the job ends."""
        client = await self._in_thread(self.get_client)
        async for chunk in client.tail_job_logs(submission_id):
            yield chunk
