"""RayJobTrigger against a real Ray head: log streaming, one event, PENDING handling, killing."""

from __future__ import annotations

import asyncio
import importlib
import inspect
import shlex
import threading
import time
from types import SimpleNamespace

import pytest
import requests
import structlog.testing
from airflow.sdk import TaskInstanceState
from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance

from rlk_ray.hooks import RayJobHook
from rlk_ray.triggers import RayJobTrigger, missing_resources, resolve_exit_code

TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}


def python_job(code: str) -> str:
    return shlex.join(["python", "-c", code])


async def collect(trigger: RayJobTrigger) -> list[dict]:
    return [event.payload async for event in trigger.run()]


def test_serialize_returns_every_constructor_argument_and_round_trips():
    trigger = RayJobTrigger(
        submission_id="d-r-t--1-try1", address="http://h:1", entrypoint_num_cpus=1,
        entrypoint_num_gpus=0.5, entrypoint_resources={"worker": 1}, pending_timeout=30,
        poll_interval=0.5, max_poll_errors=3, log_tail_lines=7,
    )
    classpath, kwargs = trigger.serialize()
    assert set(kwargs) == set(inspect.signature(RayJobTrigger.__init__).parameters) - {"self"}
    module, _, name = classpath.rpartition(".")
    again = getattr(importlib.import_module(module), name)(**kwargs)
    assert type(again) is RayJobTrigger and again.serialize() == (classpath, kwargs)
    assert kwargs["entrypoint_resources"] == {"worker": 1} and kwargs["pending_timeout"] == 30.0


def test_exit_code_prefers_driver_code_then_message_then_log_marker():
    lines = ["hello", "[rlk] exit-code 2", "trailing noise"]
    assert resolve_exit_code(3, "failed with exit code 1", lines) == 3
    message = "Job entrypoint command failed with exit code 1, last available logs:\n..."
    assert resolve_exit_code(None, message, lines) == 1
    assert resolve_exit_code(None, "Job was stopped", lines) == 2
    assert resolve_exit_code(None, None, ["[rlk] exit-code 3x"]) is None


def test_missing_resources_is_judged_per_node():
    nodes = [{"CPU": 2.0}, {"CPU": 8.0, "GPU": 1.0}]
    assert missing_resources({"CPU": 4.0, "GPU": 1.0}, nodes) is None
    assert "GPU=2" in missing_resources({"GPU": 2.0}, nodes)
    # 3 GPUs exist in total, but no node has 2 of them: a driver cannot span nodes.
    assert "GPU=2" in missing_resources({"GPU": 2.0}, [{"GPU": 1.0}] * 3)
    split = [{"CPU": 8.0}, {"CPU": 1.0, "GPU": 1.0}]
    assert "together" in missing_resources({"CPU": 4.0, "GPU": 1.0}, split)


def test_streams_log_lines_and_yields_one_succeeded_event(ray_address, monkeypatch):
    hook = RayJobHook(address=ray_address)
    code = "import time; print('hello'); time.sleep(1.5); print('world')"
    sid = hook.submit(python_job(code), "trig-hello")
    # Every HTTP request Ray's client makes must run off the event loop's thread.
    request_threads, original = [], requests.Session.request

    def recording(self, *args, **kwargs):
        request_threads.append(threading.get_ident())
        return original(self, *args, **kwargs)

    monkeypatch.setattr(requests.Session, "request", recording)

    async def run_and_note_loop_thread():
        trigger = RayJobTrigger(submission_id=sid, address=ray_address, poll_interval=0.3)
        return threading.get_ident(), await collect(trigger)

    with structlog.testing.capture_logs() as logs:
        loop_thread, events = asyncio.run(asyncio.wait_for(run_and_note_loop_thread(), 60))
    assert len(events) == 1
    event = events[0]
    assert (event["status"], event["submission_id"], event["exit_code"]) == ("SUCCEEDED", sid, 0)
    assert event["reason"] is None and event["log_tail"][-2:] == ["hello", "world"]
    logged = [entry["event"] for entry in logs]
    assert logged.index("hello") < logged.index("world")
    # The lines came through the stream, not from re-reading the whole log afterwards.
    assert not [entry for entry in logs if entry["log_level"] == "warning"]
    assert request_threads and loop_thread not in request_threads


def test_the_event_follows_the_job_end_not_the_next_poll(ray_address):
    """The log stream closes when the job ends; that wakes the poll, so a task does not wait out
    the rest of a poll interval after its job (a matrix cell's overhead)."""
    hook = RayJobHook(address=ray_address)
    sid = hook.submit(python_job("print('done')"), "trig-prompt")
    trigger = RayJobTrigger(submission_id=sid, address=ray_address, poll_interval=60.0)
    t0 = time.monotonic()
    (event,) = asyncio.run(asyncio.wait_for(collect(trigger), 120))
    elapsed = time.monotonic() - t0
    assert (event["status"], event["exit_code"], event["log_tail"][-1]) == ("SUCCEEDED", 0, "done")
    info = hook.info(sid)
    job_s = (info.end_time - info.start_time) / 1000.0
    assert elapsed < job_s + 10.0, f"the event came {elapsed:.1f} s after a {job_s:.1f} s job"


def test_the_exit_code_marker_wakes_the_poll_before_the_log_stream_ends():
    """rlk's last line, `[rlk] exit-code N`, says the command is done: it wakes a poll that waits
    on a log stream still open, and the polls after it come fast. Ray closes the stream a second
    or more after the job has ended (about 4 s after it on the 2-core machine), so waiting for
    the stream alone cost a matrix cell that much."""
    import logging

    from rlk_ray.triggers import ENDED_POLL_S, _LogLines

    async def scenario():
        trigger = RayJobTrigger(submission_id="s", address="http://127.0.0.1:1", poll_interval=60.0)
        lines = _LogLines(logging.getLogger("test"), 5)
        stream = asyncio.get_running_loop().create_future()  # a stream Ray has not closed yet
        lines.feed("last words\n")
        waiting = asyncio.create_task(trigger._pause(stream, lines))
        await asyncio.sleep(0.1)
        assert not waiting.done()  # other output does not end the wait
        start = time.monotonic()
        lines.feed("[rlk] exit-code 0\n")
        await asyncio.wait_for(waiting, 5)
        woke = time.monotonic() - start
        start = time.monotonic()
        await asyncio.wait_for(trigger._pause(stream, lines), 5)  # the next poll comes fast too
        fast = time.monotonic() - start
        stream.cancel()
        return woke, fast

    woke, fast = asyncio.run(scenario())
    assert woke < 5 and ENDED_POLL_S * 0.5 <= fast < 5


def test_a_short_job_is_seen_ending_by_a_status_poll_before_its_log_says_so():
    """Ray delivers a job's output a second or two late, so a cell's task would wait that long
    after its job for the exit-code marker; the status polls come often while a job is young, so
    the end of a short job is seen within a fraction of a second whatever the log stream does."""
    import logging

    from ray.job_submission import JobStatus

    from rlk_ray.triggers import FIRST_POLL_S, POLL_FRACTION, _LogLines

    submitted = time.time()
    ends = submitted + 1.5
    polls = []

    class Hook:  # a job that runs 1.5 s
        async def ainfo(self, submission_id):
            polls.append(time.time())
            status = JobStatus.SUCCEEDED if time.time() >= ends else JobStatus.RUNNING
            return SimpleNamespace(status=status, driver_agent_http_address="http://agent",
                                   start_time=submitted * 1000, message=None, driver_exit_code=0)

    async def scenario():
        trigger = RayJobTrigger(submission_id="s", address="http://127.0.0.1:1", poll_interval=60.0)
        lines = _LogLines(logging.getLogger("test"), 5)
        stream = asyncio.get_running_loop().create_future()  # Ray's stream: nothing more yet
        event, started = await asyncio.wait_for(trigger._watch(Hook(), stream, lines), 10)
        stream.cancel()
        return trigger, event, started

    trigger, event, started = asyncio.run(scenario())
    late = time.time() - ends
    assert (event["status"], event["exit_code"], started) == ("SUCCEEDED", 0, True)
    assert late < 2 * FIRST_POLL_S, f"the end was seen {late:.2f} s after the job ended"
    assert len(polls) < 15  # often, not busily
    # A long job is polled every poll_interval, no more often.
    assert trigger.interval(10_000.0) == 60.0 and trigger.interval(40.0) == 40.0 * POLL_FRACTION


def test_the_end_of_the_log_is_read_at_once_when_the_job_has_ended(monkeypatch):
    """Ray's stream delivers a job's last lines a second or more after the job ends and closes
    later still; once the job has ended its log is read in one call, so the task does not wait
    for the stream, and every line reaches the task log once, in order."""
    from ray.job_submission import JobStatus

    submitted = time.time()
    output = "first\nsecond\n[rlk] exit-code 0\n"

    class Hook:  # a job that has just ended; its stream has delivered only the first line
        async def ainfo(self, submission_id):
            return SimpleNamespace(status=JobStatus.SUCCEEDED, driver_agent_http_address="http://a",
                                   start_time=submitted * 1000, message=None, driver_exit_code=0)

        async def atail_logs(self, submission_id):
            yield "first\nsec"
            await asyncio.sleep(3600)  # Ray's stream, still open

        async def alogs(self, submission_id):
            return output

    trigger = RayJobTrigger(submission_id="s", address="http://127.0.0.1:1", poll_interval=60.0)
    monkeypatch.setattr(trigger, "_hook", Hook)

    async def first_event():
        agen = trigger.run()
        try:
            await asyncio.sleep(0.1)  # let the stream deliver its first chunk
            return (await anext(agen)).payload
        finally:
            await agen.aclose()

    with structlog.testing.capture_logs() as logs:
        t0 = time.monotonic()
        event = asyncio.run(asyncio.wait_for(first_event(), 5))
        elapsed = time.monotonic() - t0
    assert (event["status"], event["exit_code"]) == ("SUCCEEDED", 0) and elapsed < 3
    assert event["log_tail"] == ["first", "second", "[rlk] exit-code 0"]
    logged = [e["event"] for e in logs if e["log_level"] == "info"]
    assert logged == ["first", "second", "[rlk] exit-code 0"]


def test_job_asking_for_a_gpu_on_a_gpu_less_cluster_is_stopped(ray_address, wait_status):
    hook = RayJobHook(address=ray_address)
    sid = hook.submit("echo never", "trig-gpu", entrypoint_num_gpus=1)
    trigger = RayJobTrigger(submission_id=sid, address=ray_address, entrypoint_num_gpus=1,
                            pending_timeout=1.0, poll_interval=0.3)
    (event,) = asyncio.run(asyncio.wait_for(collect(trigger), 30))
    assert event["status"] == "STOPPED" and event["exit_code"] is None
    assert "infeasible" in event["reason"] and "GPU=1" in event["reason"]
    assert "stop requested" in event["reason"]
    # Ray keeps a job whose driver never started PENDING after a stop request (the stop is queued
    # on its supervisor); what matters is that it never ran.
    assert str(hook.status(sid)) == "PENDING" and hook.logs(sid) == ""


def test_running_job_whose_ranks_need_gpus_the_cluster_lacks_is_stopped(ray_address, wait_status):
    # A driver that reserves nothing starts on the CPU head; its ranks (Ray actors) would wait
    # for GPUs forever. The trigger checks what the job needs on one node and stops it.
    hook = RayJobHook(address=ray_address)
    sid = hook.submit("sleep 60", "trig-needs-gpus")
    wait_status(hook, sid, {"RUNNING"})
    trigger = RayJobTrigger(submission_id=sid, address=ray_address, cluster_needs={"GPU": 4},
                            pending_timeout=0.5, poll_interval=0.3)
    assert trigger.serialize()[1]["cluster_needs"] == {"GPU": 4}
    (event,) = asyncio.run(asyncio.wait_for(collect(trigger), 30))
    assert event["status"] == "STOPPED"
    assert "infeasible" in event["reason"] and "GPU=4 (largest node has 0)" in event["reason"]
    assert wait_status(hook, sid, TERMINAL, timeout=30) == "STOPPED"


def test_queued_job_that_fits_is_left_waiting_past_pending_timeout(ray_address, wait_status):
    hook = RayJobHook(address=ray_address)
    blocker = hook.submit("sleep 60", "trig-blocker", entrypoint_num_cpus=2)
    queued = None
    try:
        # Only once the blocker holds both CPUs: submitted together, Ray may start the small job
        # first, and it ends before the trigger looks.
        wait_status(hook, blocker, {"RUNNING"})
        queued = hook.submit("echo late", "trig-queued", entrypoint_num_cpus=1)
        trigger = RayJobTrigger(submission_id=queued, address=ray_address, entrypoint_num_cpus=1,
                                pending_timeout=0.5, poll_interval=0.3)
        with structlog.testing.capture_logs() as logs, pytest.raises(TimeoutError):
            asyncio.run(asyncio.wait_for(collect(trigger), 4))
        assert str(hook.status(queued)) == "PENDING"
        assert any("fits the cluster" in entry["event"] for entry in logs)
    finally:
        if queued is not None:
            hook.stop(queued)
        hook.stop(blocker)
    wait_status(hook, blocker, TERMINAL)


def _as_task(trigger: RayJobTrigger, monkeypatch, state) -> None:
    """Attach a mapped task instance whose state the (faked) Airflow API reports as ``state``."""
    trigger.task_instance = SimpleNamespace(dag_id="d", task_id="cell", run_id="r1", map_index=4)

    def get_task_states(dag_id, task_ids, run_ids, map_index, **_):
        assert (dag_id, task_ids, run_ids, map_index) == ("d", ["cell"], ["r1"], 4)
        return {"r1": {"cell_4": state}}

    monkeypatch.setattr(RuntimeTaskInstance, "get_task_states", staticmethod(get_task_states))


def test_cancel_leaves_job_running_and_on_kill_stops_it_only_once_task_left_deferred(
    ray_address, wait_status, monkeypatch
):
    hook = RayJobHook(address=ray_address)
    sid = hook.submit("sleep 60", "trig-kill")
    wait_status(hook, sid, {"RUNNING"})
    trigger = RayJobTrigger(submission_id=sid, address=ray_address, poll_interval=0.3)
    # A triggerer restart cancels run(): the job must survive it.
    with pytest.raises(TimeoutError):
        asyncio.run(asyncio.wait_for(collect(trigger), 2))
    asyncio.run(trigger.cleanup())
    _as_task(trigger, monkeypatch, TaskInstanceState.DEFERRED)
    asyncio.run(trigger.on_kill())
    # Give a stop request, had there been one, time to land before checking.
    time.sleep(1.0)
    assert str(hook.status(sid)) == "RUNNING"
    _as_task(trigger, monkeypatch, "failed")
    asyncio.run(trigger.on_kill())
    assert wait_status(hook, sid, TERMINAL, timeout=30) == "STOPPED"
