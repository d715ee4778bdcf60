"""The embedded Ray head: free loopback ports, its own temp folder, stopped by the pids it started.

One real head per module (about 10 s to start). The head requires Ray's token for every job call. A bystander process stands for everything else on
the shared machine: stopping the head must leave it running.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import requests

from rl_engine.stack import ray_head


@pytest.fixture
def bystander():
    """A process of someone else: its own session, not started by any head."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                            start_new_session=True)
    yield proc
    proc.kill()
    proc.wait()


def _listening(procs: list[psutil.Process]) -> list[tuple[str, int]]:
    addrs = []
    for p in procs:
        try:
            conns = p.net_connections(kind="inet")
        except psutil.Error:
            continue
        addrs += [(c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]
    return addrs


def _wait_job(client, sid: str, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while not (status := client.get_job_status(sid)).is_terminal():
        assert time.monotonic() < deadline, f"job {sid} still {status}"
        time.sleep(0.2)
    return str(status)


@pytest.mark.slow
def test_head_runs_jobs_on_loopback_and_stops_only_what_it_started(tmp_path, bystander):
    from ray.job_submission import JobSubmissionClient

    head = ray_head.start(num_cpus=1, env={"RLK_TEST_MARK": "from-the-head"}, log=tmp_path / "head.log")
    try:
        assert head.address.startswith("http://127.0.0.1:") and head.dashboard_port != 8265
        assert not head.gcs_address.endswith(":6379")
        assert len(head.temp_dir) <= 40, "Ray's socket paths must stay short"
        procs = head.processes()
        assert bystander.pid not in {p.pid for p in procs}
        listening = _listening(procs)
        assert listening, "the head listens somewhere"
        assert all(ip in ("127.0.0.1", "::ffff:127.0.0.1") for ip, _ in listening), listening

        # Ray's token authentication: the token is the owner's alone, and a submission without
        # it, or with another one, is refused before anything runs.
        token = Path(head.token_file)
        assert stat.S_IMODE(token.stat().st_mode) == 0o600 and len(token.read_text().strip()) >= 32
        jobs = f"{head.address}/api/jobs/"
        attack = {"entrypoint": "touch " + str(tmp_path / "pwned")}
        assert requests.post(jobs, json=attack, timeout=30).status_code == 401
        wrong = {"Authorization": "Bearer " + "0" * 64}
        assert requests.post(jobs, json=attack, headers=wrong, timeout=30).status_code == 403
        assert requests.get(jobs, timeout=30).status_code == 401  # nor can it read the jobs
        with pytest.raises(Exception, match="Unauthorized"):
            JobSubmissionClient(head.address).submit_job(entrypoint=attack["entrypoint"])

        # Jobs inherit the head's environment, find this environment's executables, and report
        # no usage statistics.
        client = JobSubmissionClient(head.address, headers=head.headers())
        sid = client.submit_job(entrypoint=(
            "python -c \"import os, shutil; print(os.environ['RLK_TEST_MARK'], "
            "os.environ['RAY_USAGE_STATS_ENABLED'], shutil.which('rlk') is not None)\""))
        assert _wait_job(client, sid) == "SUCCEEDED"
        assert "from-the-head 0 True" in client.get_job_logs(sid)
        assert not (tmp_path / "pwned").exists(), "an unauthenticated submission ran"

        # What `rlk down` sees after `rlk up` saved the head.
        head.save(tmp_path / "head.json")
        again = ray_head.RayHead.load(tmp_path / "head.json")
        assert again == head and again.alive()
    finally:
        head.stop()
    assert not head.alive()
    gone = [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not gone, f"still running after stop: {gone}"
    assert bystander.poll() is None, "stopping the head killed a process it did not start"
    assert not Path(head.temp_dir).exists()


def test_a_recorded_pid_reused_by_another_process_is_never_signalled(bystander):
    me = psutil.Process(bystander.pid)
    stale = ray_head.RayHead(address="http://127.0.0.1:1", gcs_address="127.0.0.1:2",
                             temp_dir="/tmp/rlkray-never-created-by-anyone", pid=bystander.pid,
                             create_time=me.create_time() - 3600.0, num_cpus=1)
    assert not stale.alive()
    assert stale.processes() == []
    stale.stop()
    assert bystander.poll() is None


def test_temp_folder_falls_back_to_tmp_when_the_state_path_is_too_long(tmp_path):
    deep = tmp_path / ("x" * 60)
    folder, fresh = ray_head._temp_dir(deep)
    try:
        assert fresh and str(folder).startswith("/tmp/rlkray-") and len(str(folder)) <= 40
    finally:
        folder.rmdir()
    short = Path(os.path.realpath("/tmp")) / f"rlks{os.getpid()}"
    try:
        folder, fresh = ray_head._temp_dir(short)
        assert folder == short / "ray" and not fresh
    finally:
        (short / "ray").rmdir()
        short.rmdir()


def test_start_refuses_a_head_without_cpus():
    with pytest.raises(ValueError, match="num_cpus=0"):
        ray_head.start(num_cpus=0)
