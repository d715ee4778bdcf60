"""The clean-room gate steps, run for real where they are fast (a clone of this repository's committed
HEAD, its build's preflight, input checks, pytest, the archive) and for one real run (the strict
control on the ci workload); the production check on fabricated readbacks."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rl_engine.artifacts import files, manifest
from rl_engine.artifacts.provenance import SOURCE_ROOT
from rl_engine.cli import main
from rl_engine.gate import RUN_STEPS, STEPS

RUN_ID = "gate-test-run"


def gate(capsys, *args: str) -> tuple[int, str]:
    """Runs `rlk gate ARGS`; returns the exit code and what it printed on stderr."""
    capsys.readouterr()
    code = main(["gate", *map(str, args)])
    return code, capsys.readouterr().err


def result(gate_dir: Path, step: str) -> dict:
    return json.loads((gate_dir / f"{step}.json").read_text())


@pytest.fixture(scope="module")
def head() -> str:
    return subprocess.run(["git", "-C", str(SOURCE_ROOT), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()


@pytest.fixture(scope="module")
def cloned(tmp_path_factory, head) -> Path:
    """A gate folder whose checkout step cloned the committed HEAD (the working tree may be dirty)."""
    gate_dir = tmp_path_factory.mktemp("gate")
    assert main(["gate", "checkout", "--gate-dir", str(gate_dir), "--repo", str(SOURCE_ROOT),
                 "--commit", head]) == 0
    return gate_dir


def test_checkout_clones_the_pinned_commit_clean_and_records_it(cloned, head, capsys):
    r = result(cloned, "checkout")
    assert r["passed"] and r["exit_code"] == 0 and r["schema_version"] == 1
    assert r["details"]["commit"] == head and r["details"]["status"] == []
    assert r["started_at"] <= r["finished_at"] and r["seconds"] >= 0
    path = Path(r["details"]["path"])
    assert path == cloned / "checkout" and (path / "rl_engine").is_dir()
    assert subprocess.run(["git", "-C", str(path), "status", "--porcelain"], capture_output=True,
                          text=True, check=True).stdout == ""
    # --source: an existing checkout, clean at the pinned commit.
    other = cloned.parent / f"{cloned.name}-source"
    code, err = gate(capsys, "checkout", "--gate-dir", other, "--source", path, "--commit", head[:12])
    assert code == 0, err
    assert result(other, "checkout")["details"]["commit"] == head


def test_checkout_refuses_a_dirty_tree_an_unknown_commit_and_a_branch(cloned, head, tmp_path, capsys):
    path = cloned / "checkout"
    stray = path / "stray.txt"
    stray.write_text("not committed\n")
    try:
        code, err = gate(capsys, "checkout", "--gate-dir", tmp_path, "--source", path)
    finally:
        stray.unlink()
    assert code == 2 and "gate step checkout failed: checkout" in err and "not clean" in err
    r = result(tmp_path, "checkout")
    assert not r["passed"] and r["exit_code"] == 2 and r["details"]["status"] == ["?? stray.txt"]

    code, err = gate(capsys, "checkout", "--gate-dir", tmp_path, "--repo", SOURCE_ROOT, "--commit",
                     "0123456789abcdef0123456789abcdef01234567", "--dest", tmp_path / "a")
    assert code == 2 and "is not in" in err
    code, err = gate(capsys, "checkout", "--gate-dir", tmp_path, "--repo", SOURCE_ROOT, "--commit", "main")
    assert code == 2 and "not pinned" in err
    code, err = gate(capsys, "checkout", "--gate-dir", tmp_path, "--repo", SOURCE_ROOT, "--commit", head,
                     "--dest", SOURCE_ROOT / "rl_engine")
    assert code == 2 and "already holds something else" in err
    code, err = gate(capsys, "checkout", "--gate-dir", tmp_path, "--source", path, "--commit", "abcdef1")
    assert code == 2 and "not the pinned abcdef1" in err


def test_build_runs_preflight_on_the_checkouts_own_existing_build(cloned, tmp_path, capsys):
    """The probe imports rl_engine from the clone (not from this checkout) and launches its kernels;
    a build older than a source is refused."""
    clone = cloned / "checkout"
    built = sorted((SOURCE_ROOT / "rl_engine").glob("_C*.so"))
    assert built, "build the extension first: pip install --no-build-isolation --no-deps -e ."
    shutil.copy2(built[-1], clone / "rl_engine" / built[-1].name)
    os.utime(clone / "rl_engine" / built[-1].name)  # newer than every source of the clone
    code, err = gate(capsys, "build", "--gate-dir", cloned, "--no-install")
    assert code == 0, err
    d = result(cloned, "build")["details"]
    assert Path(d["rl_engine"]).parent == clone / "rl_engine"
    assert d["preflight"] and all(c["ok"] for c in d["preflight"])
    assert d["kernel_totals"]["rlkernel.det_gemm.cpu.v1:det_gemm"] > 0
    assert d["stale_sources"] == [] and d["extension"]["flags"]["cuda"] is False

    source = clone / "csrc" / "schema.cpp"
    before = source.stat()
    os.utime(source, (before.st_atime, before.st_mtime + 10_000))
    try:
        code, err = gate(capsys, "build", "--gate-dir", tmp_path, "--checkout", clone, "--no-install")
    finally:
        os.utime(source, (before.st_atime, before.st_mtime))
    assert code == 2 and "gate step build failed: the build is older than" in err
    assert result(tmp_path, "build")["details"]["stale_sources"] == ["csrc/schema.cpp"]


def test_verify_inputs_passes_on_recorded_hashes_and_names_a_changed_input(tmp_path, capsys):
    model, prompts = tmp_path / "model", tmp_path / "prompts.jsonl"
    model.mkdir()
    (model / "weights.bin").write_bytes(b"\x00\x01" * 100)
    prompts.write_text('{"prompt": "one"}\n')
    sums = tmp_path / "inputs.sha256"
    sums.write_text(f"{manifest.sha256(model / 'weights.bin')}  model/weights.bin\n")
    recorded = tmp_path / "manifest.json"
    files.write_json(recorded, {"inputs": {"prompts": manifest.hash_inputs([prompts])}})
    for args in (["--manifest", sums], ["--manifest", recorded, "--prompt-data", prompts]):
        code, err = gate(capsys, "verify-inputs", "--gate-dir", tmp_path / "g", *args)
        assert code == 0, err
    assert result(tmp_path / "g", "verify-inputs")["details"]["files"] == {
        str(prompts.resolve()): manifest.sha256(prompts)}

    prompts.write_text('{"prompt": "two"}\n')
    code, err = gate(capsys, "verify-inputs", "--gate-dir", tmp_path / "g", "--manifest", recorded,
                     "--prompt-data", prompts)
    assert code == 2 and "gate step verify-inputs failed:" in err and "prompts.jsonl" in err
    assert not result(tmp_path / "g", "verify-inputs")["passed"]
    (model / "weights.bin").write_bytes(b"changed")
    code, err = gate(capsys, "verify-inputs", "--gate-dir", tmp_path / "g", "--manifest", sums)
    assert code == 2 and "weights.bin: sha256 differs" in err
    code, err = gate(capsys, "verify-inputs", "--gate-dir", tmp_path / "g", "--prompt-data", prompts)
    assert code == 2 and "give --manifest" in err


def test_tests_step_archives_log_and_junit_and_maps_pytest_outcomes(tmp_path, capsys):
    co = tmp_path / "co"
    (co / "rl_engine").mkdir(parents=True)
    (co / "test_ok.py").write_text("def test_sum():\n    assert 1 + 1 == 2\n")
    (co / "test_bad.py").write_text("def test_wrong():\n    assert 1 + 1 == 3\n")
    g = tmp_path / "g"
    code, err = gate(capsys, "tests", "--gate-dir", g, "--checkout", co, "--select", "test_ok.py")
    assert code == 0, err
    r = result(g, "tests")["details"]
    assert (r["tests"], r["failures"]) == (1, 0) and (g / "tests-junit.xml").is_file()
    assert "1 passed" in (g / "tests.log").read_text()
    code, err = gate(capsys, "tests", "--gate-dir", g, "--checkout", co, "--select", "test_bad.py")
    assert code == 1 and "gate step tests failed: 1 of 1 tests failed" in err
    code, err = gate(capsys, "tests", "--gate-dir", g, "--checkout", co, "--select", "test_ok.py",
                     "--keyword", "nothing_matches")
    assert code == 2 and "no test matched" in err
    code, err = gate(capsys, "tests", "--gate-dir", g, "--checkout", co)
    assert code == 2 and "--select" in err


def test_strict_run_of_the_ci_workload_passes_with_a_bitwise_validation(tmp_path, capsys):
    code, err = gate(capsys, "strict-run", "--gate-dir", tmp_path, "--workload", "ci")
    assert code == 0, err
    r = result(tmp_path, "strict-run")
    v = r["details"]["validation"]
    assert r["passed"] and v["passed"] and v["bitwise"] and v["bitwise_required"]
    assert v["mismatch_count"] == 0 and v["numel"] == v["expected_numel"] == 64
    run_dir = tmp_path / "strict-run"
    assert (run_dir / "exit-code").read_text().strip() == "0"
    man = json.loads((run_dir / "manifest.json").read_text())
    assert man["plan"] == {"attention": "R/R", "ffn": "R/R", "logp": "R/R", "mode": "strict"}
    assert man["run_id"] == r["details"]["run_id"]

    code, err = gate(capsys, "strict-run", "--gate-dir", tmp_path, "--workload", "huge")
    assert code == 2 and "gate step strict-run failed: --workload 'huge'" in err
    assert (run_dir / "manifest.json").is_file(), "a refused step must not touch the earlier run"


def _fabricated_gate(root: Path, commit: str) -> tuple[Path, Path]:
    gate_dir, matrix_root = root / "gate", root / "matrix-root"
    for step in STEPS[:-2]:
        details = {"commit": commit, "repo": "repo.git", "path": "x"} if step == "checkout" else {}
        files.write_json(gate_dir / f"{step}.json", {"step": step, "passed": True, "exit_code": 0,
                                                      "reason": "", "details": details})
    for step in RUN_STEPS:
        files.write_json(gate_dir / step / "manifest.json",
                         {"run_id": step, "source_commit": commit, "source_dirty": False})
    files.write_json(matrix_root / "matrix-report.json", {"verdict": {
        "passed": True, "exit_code": 0, "failed_cells": [], "incomplete_cells": []}})
    files.write_json(matrix_root / "control" / "20261130T000000Z-abcdef" / "manifest.json",
                     {"run_id": "m", "source_commit": commit, "source_dirty": False})
    return gate_dir, matrix_root


def test_archive_collects_every_result_manifest_and_commit_and_names_the_failed_step(tmp_path, capsys):
    commit = "a" * 40
    gate_dir, matrix_root = _fabricated_gate(tmp_path, commit)
    code, err = gate(capsys, "archive", "--gate-dir", gate_dir, "--matrix-root", matrix_root)
    assert code == 0, err
    a = json.loads((gate_dir / "gate-archive.json").read_text())
    assert a["passed"] and a["schema_version"] == 1 and a["missing_steps"] == a["failed_steps"] == []
    assert set(a["steps"]) == set(STEPS[:-1]) and a["steps"]["matrix"]["passed"]
    assert set(a["manifests"]) == {*RUN_STEPS, "matrix/control/20261130T000000Z-abcdef"}
    assert a["commits"]["checkout"] == commit and a["commits"]["runs"]["strict-run"]["source_commit"] == commit
    env = a["environment"]
    assert env["python"] and env["torch"] and any(p.startswith("torch==") for p in env["pip_freeze"])
    assert result(gate_dir, "archive")["passed"]

    files.write_json(gate_dir / "strict-run" / "manifest.json",
                     {"run_id": "s", "source_commit": commit, "source_dirty": True})
    code, err = gate(capsys, "archive", "--gate-dir", gate_dir, "--matrix-root", matrix_root)
    assert code == 2 and "strict-run ran commit" in err

    files.write_json(gate_dir / "tests.json", {"step": "tests", "passed": False, "exit_code": 1,
                                               "reason": "2 of 9 tests failed"})
    code, err = gate(capsys, "archive", "--gate-dir", gate_dir, "--matrix-root", matrix_root)
    assert code == 1
    assert "gate step archive failed: step tests failed (exit 1): 2 of 9 tests failed" in err
    assert json.loads((gate_dir / "gate-archive.json").read_text())["failed_steps"] == ["tests"]

    (gate_dir / "tests.json").unlink()
    code, err = gate(capsys, "archive", "--gate-dir", gate_dir)  # no matrix result either
    assert code == 3 and "steps tests, matrix left no result" in err
    code, err = gate(capsys, "archive", "--gate-dir", gate_dir, "--skip", "tests", "--skip", "matrix")
    assert code == 2, err  # what is left: the dirty strict-run


def test_a_step_past_its_timeout_leaves_no_process_behind(tmp_path):
    from rl_engine.gate.process import run_logged

    script = ("import subprocess, sys, time\n"
              "child = subprocess.Popen(['sleep', '120'])\n"
              "print('child', child.pid, flush=True)\n"
              "time.sleep(120)\n")
    log = tmp_path / "step.log"
    assert run_logged([sys.executable, "-c", script], cwd=tmp_path, log=log, timeout=3) is None
    pid = int(next(ln for ln in log.read_text().splitlines() if ln.startswith("child ")).split()[1])
    try:  # gone, or a zombie waiting for a reaper: either way it runs no more
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        state = "gone"
    assert state in ("gone", "Z", "X"), f"the step's grandchild {pid} still runs ({state})"


def test_a_step_whose_process_is_killed_leaves_no_process_behind(tmp_path):
    """SIGKILL of the process running a step (a stopped Ray job's driver) takes the step's session
    with it: no handler runs, so the parent-death signal and the watchdog must do it."""
    import signal
    import time

    import psutil

    script = ("import subprocess, sys, time\n"
              "child = subprocess.Popen(['sleep', '120'])\n"
              "print('child', child.pid, flush=True)\n"
              "time.sleep(120)\n")
    log = tmp_path / "step.log"
    driver = subprocess.Popen([sys.executable, "-c", (
        "import sys\nfrom pathlib import Path\nfrom rl_engine.gate.process import run_logged\n"
        f"run_logged([sys.executable, '-c', {script!r}], cwd=Path({str(tmp_path)!r}), "
        f"log=Path({str(log)!r}))\n")], stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not (log.exists() and "child " in log.read_text()):
            assert driver.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        pid = int(next(ln for ln in log.read_text().splitlines() if ln.startswith("child ")).split()[1])
        step = psutil.Process(pid).parent()
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=10)
        gone, alive = psutil.wait_procs([step, psutil.Process(pid)], timeout=5)
        assert not alive, f"left behind: {[p.pid for p in alive]}"
    finally:
        if driver.poll() is None:
            driver.kill()
