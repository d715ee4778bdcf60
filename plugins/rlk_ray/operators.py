"""RayJobOperator: run one ``rlk`` command as a Ray job, deferring while it runs.

The task outcome follows the exit-code contract of every rlk verb: 0 succeeds; 1 (parity failure)
and 2 (bad input) fail without retry, because running the same thing again gives the same answer;
3 (infrastructure failure), a job Ray lost or cannot report, and a stopped job fail with a plain
AirflowException, which Airflow retries.
"""

from __future__ import annotations

import re
from typing import Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from rlk_ray.entrypoint import build_rlk_command, check_argument
from rlk_ray.hooks import RayJobHook
from rlk_ray.triggers import RayJobTrigger, resolve_exit_code

EXIT_MEANINGS = {
    1: "parity failure (the evidence is complete and the bits differ where equality is required)",
    2: "bad input or usage",
    3: "infrastructure failure",
}
_NOT_RETRIED = (1, 2)


def submission_id_for(
    dag_id: str, run_id: str, task_id: str, map_index: int, try_number: int, ti_id: object = None
) -> str:
    """One Ray submission id per task try, readable in the Ray dashboard, in ``[A-Za-z0-9._-]``.

    A run deleted and created again under the same run id restarts its try numbers, and Ray refuses
    a submission id it has seen; the task instance's own id (a new UUID per try) tells them apart.
    """
    raw = f"{dag_id}-{run_id}-{task_id}-{map_index}-try{try_number}"
    if ti_id is not None:
        raw += f"-{str(ti_id).replace('-', '')[:8]}"
    return re.sub(r"[^A-Za-z0-9._-]", "_", raw)


class RayJobOperator(BaseOperator):
    """Submit an rlk command (or a literal entrypoint) as a Ray job; wait for it in the triggerer.

    :param rlk_args: the rlk verb words, e.g. ``["matrix", "run-cell"]`` (templated).
    :param rlk_options: options of the verb, ``{"cell": "tp2-cp1", "dry-run": True}`` (templated);
        see ``rlk_ray.entrypoint.build_rlk_command`` for how values are spelled and checked.
    :param rlk_positional: positional arguments of the verb, e.g. a file (templated).
    :param entrypoint: a literal shell command instead of ``rlk_args``. Not templated on purpose: a
        command built from params must go through ``rlk_args``/``rlk_options``, which are quoted.
    :param num_cpus: CPUs reserved for the entrypoint (the driver), ``num_gpus`` likewise
        (templated, so a DAG can size them from its params).
    :param cluster_needs: resources one node must hold for the job to ever finish though the
        entrypoint does not reserve them (the GPUs of ranks that are Ray actors, say); checked with
        the entrypoint's own request once the job has waited ``pending_timeout`` (templated).
    :param entrypoint_resources: custom Ray resources for the entrypoint (``resources`` is already
        BaseOperator's executor-resources argument).
    :param runtime_env: Ray runtime environment of the job (templated).
    :param pending_timeout: seconds a PENDING job waits before it is checked for feasibility.
    :param poll_interval: the longest time between status polls in the trigger (seconds; a
        young job is polled sooner, see ``rlk_ray.triggers.POLL_FRACTION``).
    :param conn_id: Airflow connection of the Ray dashboard.

    Retries default to 2 with exponential backoff: only retryable failures use them. In Airflow 3.3
    ``retry_exponential_backoff`` is a multiplier (``True`` would mean 1, a constant delay), so the
    default is 2.0, the doubling delay.
    """

    template_fields = ("rlk_args", "rlk_options", "rlk_positional", "runtime_env", "num_gpus",
                       "cluster_needs")
    ui_color = "#e8f0fe"

    def __init__(
        self,
        *,
        rlk_args: list[str] | None = None,
        rlk_options: dict[str, Any] | None = None,
        rlk_positional: list[str] | None = None,
        entrypoint: str | None = None,
        num_cpus: float | None = None,
        num_gpus: float | None = None,
        entrypoint_resources: dict[str, float] | None = None,
        cluster_needs: dict[str, float] | None = None,
        runtime_env: dict[str, Any] | None = None,
        pending_timeout: float = 600.0,
        poll_interval: float = 5.0,
        conn_id: str = RayJobHook.default_conn_name,
        retries: int = 2,
        retry_exponential_backoff: float = 2.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            retries=retries, retry_exponential_backoff=retry_exponential_backoff, **kwargs
        )
        if (rlk_args is None) == (entrypoint is None):
            raise ValueError(f"{self.task_id}: give exactly one of rlk_args and entrypoint")
        if (rlk_options or rlk_positional) and rlk_args is None:
            raise ValueError(f"{self.task_id}: rlk_options and rlk_positional need rlk_args")
        if pending_timeout < 0 or poll_interval <= 0:
            raise ValueError(f"{self.task_id}: pending_timeout={pending_timeout} must be >= 0 and "
                             f"poll_interval={poll_interval} > 0")
        self.rlk_args = rlk_args
        self.rlk_options = rlk_options
        self.rlk_positional = rlk_positional
        self.entrypoint = entrypoint
        self.num_cpus = num_cpus
        self.num_gpus = num_gpus
        self.entrypoint_resources = entrypoint_resources
        self.cluster_needs = cluster_needs
        self.runtime_env = runtime_env
        self.pending_timeout = pending_timeout
        self.poll_interval = poll_interval
        self.conn_id = conn_id
        self._submission_id: str | None = None
        self._address: str | None = None

    def command(self) -> str:
        """The job's shell command, built from the rendered fields."""
        if self.rlk_args is not None:
            return build_rlk_command(list(self.rlk_args), self.rlk_options, self.rlk_positional)
        return check_argument(self.entrypoint, "entrypoint")

    def execute(self, context) -> None:
        ti = context["ti"]
        entrypoint = self.command()
        submission_id = submission_id_for(
            ti.dag_id, ti.run_id, ti.task_id, ti.map_index, ti.try_number, getattr(ti, "id", None)
        )
        hook = RayJobHook(conn_id=self.conn_id)
        self._submission_id, self._address = submission_id, hook.address
        hook.submit(
            entrypoint,
            submission_id,
            entrypoint_num_cpus=self.num_cpus,
            entrypoint_num_gpus=self.num_gpus,
            resources=self.entrypoint_resources,
            runtime_env=self.runtime_env,
            metadata={"airflow_dag_id": ti.dag_id, "airflow_task_id": ti.task_id},
        )
        self.log.info("Submitted Ray job %s to %s: %s", submission_id, hook.address, entrypoint)
        self.defer(
            trigger=RayJobTrigger(
                submission_id=submission_id,
                address=hook.address,
                entrypoint_num_cpus=self.num_cpus,
                entrypoint_num_gpus=self.num_gpus,
                entrypoint_resources=self.entrypoint_resources,
                cluster_needs=self.cluster_needs,
                conn_id=self.conn_id,
                pending_timeout=self.pending_timeout,
                poll_interval=self.poll_interval,
            ),
            method_name="execute_complete",
        )

    def execute_complete(self, context, event: dict[str, Any]) -> str:
        """Turn the trigger's event into the task outcome; return the submission id on success."""
        sid, status = event.get("submission_id"), event.get("status")
        self._submission_id = sid
        if status == "SUCCEEDED":
            self.log.info("Ray job %s succeeded", sid)
            return sid
        detail = event.get("reason") or event.get("message") or "no details"
        if status == "FAILED":
            code = event.get("exit_code")
            if code is None:
                code = resolve_exit_code(None, event.get("message"), event.get("log_tail") or [])
            meaning = EXIT_MEANINGS.get(code, "not an rlk exit code; taken as an infra failure")
            text = f"Ray job {sid} failed with exit code {code}: {meaning} ({detail})"
            if code in _NOT_RETRIED:
                raise AirflowFailException(text + "; not retried")
            raise AirflowException(text)
        if status == "STOPPED":
            raise AirflowException(f"Ray job {sid} was stopped: {detail}")
        raise AirflowException(f"Ray job {sid} ended as {status}: {detail}")

    def on_kill(self) -> None:
        """Stop the Ray job when the task is killed while it runs on a worker."""
        if self._submission_id is None:
            return
        hook = RayJobHook(conn_id=self.conn_id, address=self._address)
        stopped = hook.stop(self._submission_id)
        self.log.info("Stop of Ray job %s requested (was running: %s)",
                      self._submission_id, stopped)
