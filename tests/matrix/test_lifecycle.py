"""A cell's life is bounded by its runner's: SIGKILL of `rlk matrix run` takes the cell's whole
process group with it; --resume keeps only attempts that exited 0, 1 or 2; a per-cell lock forbids
two live attempts of one cell; a cell refused for bad input records exit 2 and the matrix exits 2.

The runner drives the stand-in `rlk run` of tests/fixtures/fake_run.py (see test_runner.py), except
for the bad-input cell, which is the real `rlk run` refusing a model folder without weights.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from rl_engine import errors
from rl_engine.cli import main
from rl_engine.evidence.layout import RunDir
from rl_engine.matrix import analyze, runner

FAKE = Path(__file__).resolve().parents[1] / "fixtures" / "fake_run.py"


@pytest.fixture
def fake_env(monkeypatch, tmp_path):
    for var in ("FAKE_RLK_SLEEP_CELLS", "FAKE_RLK_FAIL_CELLS", "FAKE_RLK_BREAK_CELLS", "CI_TEST",
                "RL_KERNEL_RUN_ID", "RL_KERNEL_ARTIFACT_DIR", "VALIDATE_ARTIFACTS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("FAKE_RLK_WORKER_PIDS", str(tmp_path / "workers"))
    monkeypatch.setattr(runner, "RLK_COMMAND", (sys.executable, str(FAKE)))


def in_process(root: Path, *cells: str, **kwargs) -> tuple[int, dict]:
    return runner.run(runner.MatrixRun(root=root, cells=cells, workload="ci", **kwargs))


def start_runner(root: Path, cell: str, sleep: bool) -> subprocess.Popen:
    """`rlk matrix run --case cell` over the stand-in, as its own process."""
    script = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from rl_engine.matrix import runner
        runner.RLK_COMMAND = (sys.executable, {str(FAKE)!r})
        code, _ = runner.run(runner.MatrixRun(root=Path({str(root)!r}), cells=[{cell!r}], workload="ci"))
        sys.exit(code)
    """)
    env = {**os.environ, "FAKE_RLK_SLEEP_CELLS": cell if sleep else ""}
    return subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def wait_for_cell(runner_proc: subprocess.Popen, root: Path, cell: str) -> tuple[Path, int]:
    """The live attempt's folder and its process group, once its run wrote its manifest."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert runner_proc.poll() is None, "the runner ended before its cell started"
        folders = analyze.attempts(root, cell)
        if folders and (folders[-1] / "manifest.json").exists():
            (run,) = [p for p in psutil.Process(runner_proc.pid).children()
                      if str(FAKE) in " ".join(p.cmdline())]
            return folders[-1], os.getpgid(run.pid)
        time.sleep(0.05)
    raise AssertionError(f"cell {cell} never started")


def worker_pids(tmp_path: Path) -> list[int]:
    return [int(p) for p in (tmp_path / "workers").read_text().split()]


def test_sigkill_of_the_runner_takes_the_cell_group_and_resume_runs_a_new_attempt(tmp_path, fake_env):
    root = tmp_path / "m"
    proc = start_runner(root, "ffn-PR", sleep=True)
    try:
        killed, pgid = wait_for_cell(proc, root, "ffn-PR")
        (worker,) = worker_pids(tmp_path)
        assert runner.group_alive(pgid) and psutil.pid_exists(worker)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 5
        while runner.group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not runner.group_alive(pgid), "the cell outlived its runner"
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not RunDir(killed).exit_code.exists()

    code, report = in_process(root, "ffn-PR", resume=True)
    assert code == 0
    old, new = analyze.attempts(root, "ffn-PR")
    assert old == killed and not RunDir(old).exit_code.exists()
    assert RunDir(new).exit_code.read_text().strip() == "0"


@pytest.mark.parametrize("recorded, reruns", [(3, True), (2, False), (1, False), (0, False)])
def test_resume_keeps_only_attempts_that_exited_0_1_or_2(tmp_path, fake_env, recorded, reruns):
    root = tmp_path / "m"
    code, _ = in_process(root, "control")
    assert code == 0
    (first,) = analyze.attempts(root, "control")
    # The evidence stays complete: only the recorded exit code says whether the attempt is kept
    # (a run that failed after writing its verdict, such as a dead pipe, exits 3).
    RunDir(first).write_exit_code(recorded)
    in_process(root, "control", resume=True)
    assert len(analyze.attempts(root, "control")) == (2 if reruns else 1)


def test_a_live_attempt_locks_its_cell(tmp_path, fake_env, monkeypatch, capsys):
    root = tmp_path / "m"
    monkeypatch.setattr(runner, "LOCK_WAIT_S", 1.0)
    proc = start_runner(root, "logp-RP", sleep=True)
    try:
        live, pgid = wait_for_cell(proc, root, "logp-RP")
        code = main(["matrix", "run", "--matrix-root", str(root), "--case", "logp-RP", "--resume",
                     "--workload", "ci", "--no-history"])
        assert code == errors.INFRASTRUCTURE
        err = capsys.readouterr().err
        assert f"cell logp-RP of {root} has a live attempt (started by runner pid {proc.pid})" in err
        assert analyze.attempts(root, "logp-RP") == [live]
        # The lock lives with the cell's run, not with the runner that started it.
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 5
        while runner.group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()
    code, _ = in_process(root, "logp-RP", resume=True)
    assert code == 0 and len(analyze.attempts(root, "logp-RP")) == 2


def test_a_cell_refused_for_bad_input_records_exit_2_and_the_matrix_exits_2(tmp_path, monkeypatch):
    from rl_engine.models.generate import init_model

    for var in ("CI_TEST", "RL_KERNEL_RUN_ID", "RL_KERNEL_ARTIFACT_DIR", "VALIDATE_ARTIFACTS"):
        monkeypatch.delenv(var, raising=False)
    model = init_model("tiny", tmp_path / "model", seed=0)
    (model / "model.safetensors").unlink()  # the config is fine: only the cell finds this
    (model / "manifest.sha256").unlink()
    root = tmp_path / "m"
    code = main(["matrix", "run", "--matrix-root", str(root), "--case", "control", "--workload",
                 "ci", "--model-root", str(model), "--no-history"])
    assert code == errors.BAD_INPUT
    (attempt,) = analyze.attempts(root, "control")
    run = RunDir(attempt)
    assert run.exit_code.read_text().strip() == "2"
    assert run.case_env.is_file() and not run.manifest.exists() and not run.log.exists()
    # Kept by --resume: the same input gives the same answer.
    code = main(["matrix", "run", "--matrix-root", str(root), "--case", "control", "--workload",
                 "ci", "--model-root", str(model), "--no-history", "--resume"])
    assert code == errors.BAD_INPUT and len(analyze.attempts(root, "control")) == 1


def _cell(name: str, exit_code: int | None, complete: bool, passed: bool) -> dict:
    return {"cell": name, "evidence_complete": complete, "bitwise": passed, "passed": passed,
            "bitwise_required": name == "control", "state": "passed" if passed else "failed",
            "latest": {"exit_code": exit_code}}


def test_the_matrix_verdict_orders_bad_input_then_incomplete_then_parity():
    refused, dead = _cell("ffn-PR", 2, False, False), _cell("ffn-RP", 3, False, False)
    broken, fine = _cell("control", 1, True, False), _cell("logp-PP", 0, True, True)
    assert analyze.verdict([fine, broken, dead, refused])["exit_code"] == 2
    assert analyze.verdict([fine, broken, refused])["bad_input_cells"] == ["ffn-PR"]
    assert analyze.verdict([fine, broken, dead])["exit_code"] == 3
    assert analyze.verdict([fine, broken])["exit_code"] == 1
    assert analyze.verdict([fine])["exit_code"] == 0
