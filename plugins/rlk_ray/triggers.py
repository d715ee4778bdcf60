"""RayJobTrigger: follow one Ray job from the triggerer until it ends.

``run()`` streams the job's output into the task log line by line while it polls the job's status;
it yields exactly one event when the job reaches a terminal state, then returns. Every call to Ray
is awaited (Ray's websocket log tail) or runs in a worker thread, so the triggerer's event loop is
never blocked.

PENDING jobs: a job that has waited longer than ``pending_timeout`` is checked against the cluster.
If no alive node has the resources it asks for (say ``num_gpus=1`` on a cluster without GPUs), it
can never start: the trigger asks Ray to stop it and yields a STOPPED event whose ``reason`` names
the missing resource. A job that fits some node but is queued behind others is left waiting (a
warning is logged once): on a busy cluster waiting is the right thing, and Ray itself fails a job
whose driver never starts (``RAY_JOB_START_TIMEOUT_SECONDS``). ``pending_timeout`` is also the
grace an autoscaler gets to add the missing node type before the job is called infeasible.
``cluster_needs`` are resources the job needs on one node without reserving them for its driver
(the GPUs of ranks that are Ray actors): they count in that check, and a job already RUNNING
after ``pending_timeout`` is checked against them once, so a driver that started on a CPU node
while its ranks can never be placed is stopped the same way.

Killing: Airflow 3.3 calls ``on_kill()`` only when a user acts on the deferred task (mark failed,
clear, mark success), not when the triggerer restarts or hands the trigger to another triggerer.
``on_kill()`` still checks the task's state first and leaves the job running while the task is
DEFERRED, so a trigger dropped from this triggerer without a user action never stops a live job.
``cleanup()`` is the inherited no-op: a restart must not touch the job. After a restart the new
``run()`` streams the job's log from its start again, so the task log may repeat lines.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from rlk_ray.hooks import RayJobHook

# The rlk CLI prints this as its last line, so the code survives wrappers that lose it.
_MARKER = re.compile(r"^\[rlk\] exit-code (-?\d+)\s*$")
# Ray's message for a failed entrypoint: "Job entrypoint command failed with exit code 3, ...".
_MESSAGE_CODE = re.compile(r"exit code (-?\d+)")
# Seconds to let the log stream deliver its last lines once the job is terminal, when its log
# cannot be read in one call.
LOG_DRAIN_S = 10.0
# Seconds between status polls once the job is ending (its log stream ended, or its output's last
# line, the rlk exit-code marker, arrived), and how many such polls at most before the usual
# interval again.
ENDED_POLL_S, ENDED_POLLS = 0.2, 50
# While the job runs, the next poll comes after this fraction of the time since its submission,
# at least FIRST_POLL_S and at most the trigger's poll_interval: the end of a job of a minute is
# seen within about a second (Ray's log stream delivers the exit-code marker a second or two
# late), and a long job is polled every poll_interval (from 250 s on at 5 s; about 150 polls in
# its first 100 s, each a small HTTP call).
FIRST_POLL_S, POLL_FRACTION = 0.25, 0.02


def resolve_exit_code(
    driver_exit_code: int | None, message: str | None, lines: list[str]
) -> int | None:
    """The job's exit code: Ray's ``driver_exit_code``, else the code in Ray's message, else the
    last ``[rlk] exit-code N`` line of the output; ``None`` when none of them says."""
    if driver_exit_code is not None:
        return int(driver_exit_code)
    if message and (found := _MESSAGE_CODE.search(message.splitlines()[0])):
        return int(found.group(1))
    for line in reversed(lines):
        if found := _MARKER.match(line.strip()):
            return int(found.group(1))
    return None


def missing_resources(request: dict[str, float], nodes: list[dict[str, float]]) -> str | None:
    """Why no node can ever run ``request`` (``None`` when one can).

    A job's driver runs on one node, so the request must fit one node's totals, not the sum.
    """
    if not request:
        return None
    if any(all(node.get(k, 0.0) >= v for k, v in request.items()) for node in nodes):
        return None
    short = [
        f"{k}={v:g} (largest node has {max((n.get(k, 0.0) for n in nodes), default=0.0):g})"
        for k, v in request.items()
        if all(n.get(k, 0.0) < v for n in nodes)
    ]
    if short:
        return "no alive node has " + ", ".join(short)
    asked = ", ".join(f"{k}={v:g}" for k, v in request.items())
    return f"no single alive node has {asked} together"


class _LogLines:
    """Turns the stream's chunks into whole lines, logs each once, keeps the last few."""

    def __init__(self, log, keep: int) -> None:
        self.log, self.partial, self.count = log, "", 0
        self.tail: deque[str] = deque(maxlen=keep)
        # Set by the exit-code marker, the rlk command's last line: its output is complete and
        # its process is exiting. Ray closes the stream only a second or more after the job
        # ends, so the marker is the earlier sign of the end.
        self.marker = asyncio.Event()

    def feed(self, chunk: str) -> None:
        *complete, self.partial = (self.partial + chunk).split("\n")
        for line in complete:
            self.emit(line)

    def emit(self, line: str) -> None:
        line = line.rstrip("\r")
        self.log.info("%s", line)
        self.tail.append(line)
        self.count += 1
        if _MARKER.match(line.strip()):
            self.marker.set()

    def catch_up(self, full_log: str) -> None:
        """Log the lines of ``full_log`` the stream did not deliver (it broke, or the job ended
        before it delivered them). Lines are split as ``feed`` splits them, so none is repeated."""
        self.partial = ""
        pieces = full_log.split("\n")
        if pieces[-1] == "":
            pieces.pop()
        for line in pieces[self.count:]:
            self.emit(line)


class RayJobTrigger(BaseTrigger):
    """Wait for Ray job ``submission_id`` at ``address`` (the dashboard's HTTP address).

    :param entrypoint_num_cpus: what the job was submitted with (``entrypoint_num_gpus`` and
        ``entrypoint_resources`` likewise); Ray's job details do not report it, and the
        feasibility check needs it.
    :param cluster_needs: resources one node must hold for the job, beyond what its entrypoint
        reserved (see the module docstring).
    :param conn_id: the Airflow connection, for the cluster's token (the address is given).
    :param pending_timeout: seconds a job may stay PENDING before its request is checked against
        the cluster (see the module docstring).
    :param poll_interval: the longest time between status polls (seconds); the polls come sooner
        while the job is young (``FIRST_POLL_S``, ``POLL_FRACTION``).
    :param max_poll_errors: consecutive failed polls after which the job counts as lost.
    :param log_tail_lines: last output lines carried in the event, for the exit-code marker.
    """

    def __init__(
        self,
        *,
        submission_id: str,
        address: str,
        entrypoint_num_cpus: float | None = None,
        entrypoint_num_gpus: float | None = None,
        entrypoint_resources: dict[str, float] | None = None,
        cluster_needs: dict[str, float] | None = None,
        conn_id: str = RayJobHook.default_conn_name,
        pending_timeout: float = 600.0,
        poll_interval: float = 5.0,
        max_poll_errors: int = 5,
        log_tail_lines: int = 20,
    ) -> None:
        super().__init__()
        self.submission_id = submission_id
        self.address = address
        self.entrypoint_num_cpus = entrypoint_num_cpus
        self.entrypoint_num_gpus = entrypoint_num_gpus
        self.entrypoint_resources = dict(entrypoint_resources or {})
        self.cluster_needs = dict(cluster_needs or {})
        self.conn_id = conn_id
        self.pending_timeout = float(pending_timeout)
        self.poll_interval = float(poll_interval)
        self.max_poll_errors = int(max_poll_errors)
        self._fast_polls = 0  # polls since the log stream ended (not state: a restart resets it)
        self.log_tail_lines = int(log_tail_lines)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "submission_id": self.submission_id,
                "address": self.address,
                "entrypoint_num_cpus": self.entrypoint_num_cpus,
                "entrypoint_num_gpus": self.entrypoint_num_gpus,
                "entrypoint_resources": self.entrypoint_resources,
                "cluster_needs": self.cluster_needs,
                "conn_id": self.conn_id,
                "pending_timeout": self.pending_timeout,
                "poll_interval": self.poll_interval,
                "max_poll_errors": self.max_poll_errors,
                "log_tail_lines": self.log_tail_lines,
            },
        )

    def _hook(self) -> RayJobHook:
        return RayJobHook(conn_id=self.conn_id, address=self.address)

    async def run(self) -> AsyncIterator[TriggerEvent]:
        hook = self._hook()
        lines = _LogLines(self.log, self.log_tail_lines)
        stream = asyncio.create_task(self._stream(hook, lines))
        rest: str | None = None
        try:
            event, started = await self._watch(hook, stream, lines)
            if not stream.done():
                # The job has ended, and its log with it; Ray's stream delivers the last lines a
                # second or more later and closes later still, so the rest is read in one call.
                # Only when that fails is the stream given time to deliver them.
                rest = await self._full_log(hook)
                if rest is None and started:
                    await asyncio.wait({stream}, timeout=LOG_DRAIN_S)
        finally:
            stream.cancel()
            await asyncio.gather(stream, return_exceptions=True)
        ended = stream.done() and not stream.cancelled() and stream.result()
        if rest is None and not ended:  # the stream broke: read what it missed
            rest = await self._full_log(hook)
        if rest is not None:
            lines.catch_up(rest)
        elif lines.partial:
            lines.emit(lines.partial)
        event["log_tail"] = list(lines.tail)
        if event["exit_code"] is None:
            event["exit_code"] = resolve_exit_code(None, event["message"], event["log_tail"])
        yield TriggerEvent(event)

    async def _full_log(self, hook: RayJobHook) -> str | None:
        try:
            return await hook.alogs(self.submission_id)
        except Exception as exc:
            self.log.warning("could not read the rest of job %s's log: %s", self.submission_id, exc)
            return None

    async def _stream(self, hook: RayJobHook, lines: _LogLines) -> bool:
        """Feed the job's output to ``lines``; True if the stream ended with the job."""
        try:
            async for chunk in hook.atail_logs(self.submission_id):
                lines.feed(chunk)
            return True
        except Exception as exc:
            self.log.warning("log stream of job %s broke: %s", self.submission_id, exc)
            return False

    def _event(self, status: str, info=None, reason: str | None = None) -> dict[str, Any]:
        message = getattr(info, "message", None)
        return {
            "status": status,
            "submission_id": self.submission_id,
            # Ray appends up to 20 kB of log to a failure message; the task log has it already.
            "message": message.splitlines()[0][:500] if message else None,
            "exit_code": getattr(info, "driver_exit_code", None),
            "reason": reason,
        }

    def interval(self, age: float) -> float:
        """Seconds to the next poll of a job submitted ``age`` seconds ago."""
        return min(self.poll_interval, max(FIRST_POLL_S, POLL_FRACTION * age))

    async def _pause(self, stream: asyncio.Task | None, lines: _LogLines | None = None,
                     age: float | None = None) -> None:
        """Wait for the next poll, ``interval(age)`` (``poll_interval`` when the age is unknown).
        The rlk exit-code marker, the command's last line, and the end of the log stream (the
        server closes it once the job has ended) each wake the poll at once, and the polls after
        them come faster: the task ends within a fraction of a second of its job, not up to a poll
        interval late."""
        marker = lines is not None and lines.marker.is_set()
        wait = self.poll_interval if age is None else self.interval(age)
        if stream is None:
            await asyncio.sleep(wait)
        elif not stream.done() and not marker:
            wake = {stream} if lines is None else {stream, asyncio.ensure_future(lines.marker.wait())}
            await asyncio.wait(wake, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
            for waiter in wake - {stream}:
                waiter.cancel()
        elif (marker or (not stream.cancelled() and stream.exception() is None and stream.result()))\
                and self._fast_polls < ENDED_POLLS:
            self._fast_polls += 1
            await asyncio.sleep(min(self.poll_interval, ENDED_POLL_S))
        else:  # the stream broke (it says nothing of the job), or the job still runs after all
            await asyncio.sleep(wait)

    async def _watch(self, hook: RayJobHook, stream: asyncio.Task | None = None,
                     lines: _LogLines | None = None) -> tuple[dict[str, Any], bool]:
        """Poll until the job ends; return the event and whether the job's driver ever started."""
        errors, warned, checked = 0, False, False
        while True:
            try:
                info = await hook.ainfo(self.submission_id)
                errors = 0
            except Exception as exc:
                errors += 1
                self.log.warning("polling job %s failed (%d/%d): %s",
                                 self.submission_id, errors, self.max_poll_errors, exc)
                if errors >= self.max_poll_errors:
                    return self._event("LOST", reason=f"job server did not answer: {exc}"), False
                await asyncio.sleep(self.poll_interval)
                continue
            started = info.driver_agent_http_address is not None
            if info.status.is_terminal():
                return self._event(str(info.status), info), started
            pending = str(info.status) == "PENDING"
            if (pending or (self.cluster_needs and not checked)) \
                    and self._age(info) >= self.pending_timeout:
                # A running driver already has its own reservation: only the needs are left.
                missing = await self._missing(hook, self.request() if pending else self.cluster_needs)
                if missing:
                    return await self._stop_infeasible(hook, info, missing), started
                checked = checked or (missing is None and not pending)
                if missing is None and pending and not warned:
                    warned = True
                    self.log.warning("job %s pending for over %.0fs; it fits the cluster, so it "
                                     "waits", self.submission_id, self.pending_timeout)
            await self._pause(stream, lines, self._age(info))

    async def _missing(self, hook: RayJobHook, request: dict[str, float]) -> str | None:
        """What the cluster lacks for ``request``, ``None`` if it fits, ``""`` if unknown just now."""
        try:
            return missing_resources(request, await hook.anode_totals())
        except Exception as exc:
            self.log.warning("could not read the cluster's resources: %s", exc)
            return ""

    async def _stop_infeasible(self, hook: RayJobHook, info, missing: str) -> dict[str, Any]:
        # Ray keeps a job whose driver never started PENDING after a stop request (until
        # RAY_JOB_START_TIMEOUT_SECONDS, then FAILED); the request stays queued, so the job exits
        # at once should it ever start. Waiting for Ray's verdict would only hold the task.
        reason = f"infeasible: the job can never run, {missing}"
        try:
            await hook.astop(self.submission_id)
            reason += "; stop requested"
        except Exception as exc:
            reason += f"; stop request failed: {exc}"
        self.log.error("job %s %s", self.submission_id, reason)
        return self._event("STOPPED", info, reason)

    @staticmethod
    def _age(info) -> float:
        """Seconds since the job's submission (how long it has been pending, while it is).
        start_time is the submission time (ms): the clock survives triggerer restarts."""
        return time.time() - info.start_time / 1000.0 if info.start_time else 0.0

    def request(self) -> dict[str, float]:
        """What one node must hold to run the job: its entrypoint's reservation, by Ray resource
        name, and at least its ``cluster_needs``."""
        request = {"CPU": self.entrypoint_num_cpus or 0, "GPU": self.entrypoint_num_gpus or 0}
        request.update(self.entrypoint_resources)
        for name, amount in self.cluster_needs.items():
            request[name] = max(float(request.get(name) or 0), float(amount or 0))
        return {k: float(v) for k, v in request.items() if v and float(v) > 0}

    async def _task_state(self) -> Any:
        """The task instance's state as the API server has it; ``None`` when it cannot be read."""
        ti = self.task_instance
        if ti is None:
            return None
        try:
            from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance

            states = await asyncio.to_thread(
                RuntimeTaskInstance.get_task_states,
                dag_id=ti.dag_id,
                task_ids=[ti.task_id],
                run_ids=[ti.run_id],
                map_index=ti.map_index,
            )
        except Exception as exc:
            self.log.warning("could not read the state of task %s: %s", ti.task_id, exc)
            return None
        # The API keys a mapped task instance as "<task_id>_<map_index>".
        mapped = ti.map_index is not None and ti.map_index >= 0
        key = f"{ti.task_id}_{ti.map_index}" if mapped else ti.task_id
        return states.get(ti.run_id, {}).get(key)

    async def on_kill(self) -> None:
        state = await self._task_state()
        # TaskInstanceState is a str enum, so this also matches the plain string from the API.
        if state == "deferred":
            self.log.info("task is still deferred; leaving Ray job %s running", self.submission_id)
            return
        self.log.info("task is %s; stopping Ray job %s", getattr(state, "value", state),
                      self.submission_id)
        await self._hook().astop(self.submission_id)
