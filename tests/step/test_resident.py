"""Resident workers as a user meets them: every rank starts once and serves every step, and a
rank that dies mid-run stops the run with exit 3 naming its side and rank, leaving no half-written
evidence and no other worker behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from step.conftest import _PLAN_VARS

pytestmark = pytest.mark.slow


def test_each_rank_is_one_process_for_the_whole_run(rlk, tmp_path):
    run_dir = tmp_path / "three"
    proc = rlk("run", "--workload", "ci", "--steps", "3", "--artifact-dir", str(run_dir),
               env={"CI_TEST": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    readbacks = [json.loads(p.read_text()) for p in sorted((run_dir / "readbacks").glob("*.json"))]
    assert [r["rank"] for r in readbacks] == [0, 1, 0, 1]
    assert all([s["step"] for s in r["steps"]] == [0, 1, 2] for r in readbacks)
    # Four ranks, four processes: a rank rewrites its one record after each of its three steps.
    assert len({r["pid"] for r in readbacks}) == 4
    weights = [json.loads((run_dir / "weights" / f"step-{s:04d}.json").read_text()) for s in range(3)]
    assert [w["optimizer_steps"] for w in weights] == [1, 2, 3], "the optimizer state persists"
    assert len({w["checksum"] for w in weights}) == 3
    steps = json.loads((run_dir / "steps.json").read_text())["steps"]
    assert "worker_start" in steps[0]["seconds"] and "worker_start" not in steps[1]["seconds"]
    assert all({"rollout", "training", "sync", "digests"} <= set(s["seconds"]) for s in steps)


def test_a_rollout_rank_killed_mid_run_is_exit_3_naming_it(state_dir, tmp_path):
    run_dir = tmp_path / "killed"
    env = {k: v for k, v in os.environ.items() if k not in _PLAN_VARS}
    env.update(RLK_STATE_DIR=str(state_dir), PYTHONUNBUFFERED="1")
    parent = subprocess.Popen([sys.executable, "-m", "rl_engine.cli", "run", "--workload", "ci",
                               "--steps", "50", "--artifact-dir", str(run_dir)], env=env,
                              cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True)
    try:
        record = run_dir / "readbacks" / "builtin-rollout-rank1.json"
        deadline = time.monotonic() + 180
        while not record.exists() and time.monotonic() < deadline and parent.poll() is None:
            time.sleep(0.2)
        assert record.exists(), "the run never finished its first rollout"
        victim = json.loads(record.read_text())["pid"]
        workers = psutil.Process(parent.pid).children(recursive=True)
        os.kill(victim, signal.SIGKILL)
        _, stderr = parent.communicate(timeout=120)
    finally:
        if parent.poll() is None:
            parent.kill()
    assert parent.returncode == 3, stderr[-3000:]
    assert "rollout rank 1 of 2 died with exit code -9" in stderr
    assert (run_dir / "exit-code").read_text().strip() == "3"
    for path in (run_dir / "readbacks").iterdir():
        json.loads(path.read_text())  # every record whole: written atomically or not at all
    gone, alive = psutil.wait_procs(workers, timeout=30)
    assert not alive, f"workers left behind: {[p.pid for p in alive]}"
