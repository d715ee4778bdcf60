"""`rlk matrix run`: every cell runs as its own `rlk run` in a new attempt folder; --case, --resume
and --rerun-failed choose which cells run again; a killed or failed cell leaves no worker behind.

--case and the kill-and-resume test run the real `rlk run` (ci workload, the tiny model); the
crash and --rerun-failed test runs a stand-in (tests/fixtures/fake_run.py) that writes the same run
directory from the same environment in about a second and can crash or break parity on demand.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest

from rl_engine.cli import main
from rl_engine.evidence import records
from rl_engine.evidence.layout import MatrixRoot, RunDir
from rl_engine.matrix import analyze, runner, tables

FAKE = Path(__file__).resolve().parents[1] / "fixtures" / "fake_run.py"
CELLS_OF_CI = 2 * 32  # the ci workload: 1 prompt x 2 samples x 32 tokens


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from rl_engine.models.generate import init_model

    return init_model("tiny", tmp_path_factory.mktemp("model") / "tiny", seed=0)


@pytest.fixture
def clean_env(monkeypatch):
    for var in ("FAKE_RLK_SLEEP_CELLS", "FAKE_RLK_FAIL_CELLS", "FAKE_RLK_BREAK_CELLS", "CI_TEST",
                "RL_KERNEL_RUN_ID", "RL_KERNEL_ARTIFACT_DIR", "VALIDATE_ARTIFACTS"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def fake_rlk(monkeypatch, clean_env):
    monkeypatch.setattr(runner, "RLK_COMMAND", (sys.executable, str(FAKE)))


def matrix(root: Path, *cells: str, groups: list[int] | None = None, on_start=None,
           **kwargs) -> tuple[int, dict]:
    """Runs the cells; each cell's process group id is appended to `groups`."""
    def started(cell, folder, proc):
        if groups is not None:
            groups.append(proc.pid)
        if on_start is not None:
            on_start(cell, folder, proc)

    m = runner.MatrixRun(root=root, cells=cells, workload="ci", on_start=started, **kwargs)
    return runner.run(m)


group_alive = runner.group_alive



def cell_of(report: dict, cell: str) -> dict:
    return next(c for c in report["cells"] if c["cell"] == cell)


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.slow
def test_case_runs_one_cell_into_a_new_attempt(tmp_path, clean_env, tiny_model, capsys):
    root = tmp_path / "m"
    code = main(["matrix", "run", "--matrix-root", str(root), "--case", "ffn:P/R", "--workload",
                 "ci", "--model-root", str(tiny_model), "--no-history"])
    assert code == 0
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["ffn-PR"]
    (attempt,) = analyze.attempts(root, "ffn-PR")
    case = records.read_case_env(RunDir(attempt), problems := [])
    assert not problems
    assert case["RL_KERNEL_FFN_CASE"] == "P/R" and case["RL_KERNEL_ATTENTION_CASE"] == "R/R"
    assert case["RL_KERNEL_RUN_ID"] == f"m-ffn-PR-{attempt.name}"
    assert case["WORKLOAD"] == "ci" and int(case["EXPECTED_NUMEL"]) == CELLS_OF_CI
    assert case["MODEL_ROOT"] == str(tiny_model)
    # The run's console output is kept beside its run.log and streamed to the matrix's output.
    line = f"train_current_rollout_logprob_numel={CELLS_OF_CI}"
    assert line in (RunDir(attempt).console_log).read_text()
    assert f"[ffn-PR] step 0: {line}" in capsys.readouterr().out
    report = json.loads((MatrixRoot(root).report).read_text())
    ffn = cell_of(report, "ffn-PR")
    assert ffn["passed"] and ffn["evidence_complete"] and not ffn["bitwise_required"], ffn["reasons"]
    sides = ffn["latest"]["sides"]
    assert sides["training"]["modules"]["ffn"]["implementation"] == ["production"]
    assert sides["rollout"]["modules"]["ffn"]["implementation"] == ["rlkernel"]
    assert sides["rollout"]["modules"]["ffn"]["call_counts"]["rlkernel.swiglu.cpu.v1"] > 0
    # Cells not chosen are pending (another job may run them), and do not set this run's exit code.
    control = cell_of(report, "control")
    assert control["state"] == "pending" and not control["passed"]
    assert "no attempt of cell control" in " ".join(control["reasons"])
    assert report["verdict"]["pending_cells"] == [c for c in analyze.expected_cells(root) if c != "ffn-PR"]
    assert ffn["state"] == "passed"


@pytest.mark.slow
def test_killed_cell_is_rerun_by_resume_into_a_new_attempt(tmp_path, clean_env, tiny_model):
    root = tmp_path / "m"
    groups: list[int] = []

    def kill_once_started(cell, folder, proc):
        deadline = time.monotonic() + 120
        while not (folder / "manifest.json").exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)

    code, report = matrix(root, "ffn-PR", model_root=tiny_model, groups=groups,
                          on_start=kill_once_started)
    assert code == 3
    (killed,) = analyze.attempts(root, "ffn-PR")
    assert (RunDir(killed).case_env).is_file() and not (killed / "exit-code").exists()
    assert "no exit-code: the run did not finish" in cell_of(report, "ffn-PR")["reasons"]
    before = sorted(p.name for p in killed.rglob("*"))

    code, report = matrix(root, "ffn-PR", model_root=tiny_model, groups=groups, resume=True)
    assert code == 0
    old, new = analyze.attempts(root, "ffn-PR")
    assert old == killed and sorted(p.name for p in killed.rglob("*")) == before
    ffn = cell_of(report, "ffn-PR")
    assert ffn["passed"] and ffn["latest"]["attempt_id"] == new.name, ffn["reasons"]
    assert ffn["latest"]["run_id"] == f"m-ffn-PR-{new.name}"
    assert [a["attempt_id"] for a in ffn["attempts"]] == [killed.name]
    assert not ffn["attempts"][0]["complete"]
    tokens = [t for t in tables.read(MatrixRoot.tables_beside(MatrixRoot(root).report)[1]) if t["cell"] == "ffn-PR"]
    assert len(tokens) == CELLS_OF_CI and {t["attempt_id"] for t in tokens} == {new.name}
    assert len(groups) == 2 and not any(map(group_alive, groups)), "a cell's workers outlived it"


def test_rerun_failed_reruns_a_complete_failed_cell(tmp_path, fake_rlk, monkeypatch):
    root = tmp_path / "m"
    pids = tmp_path / "workers"
    groups: list[int] = []
    # The control's trainer differs from its rollout (complete, failed on parity); ffn-PR crashes,
    # leaving a worker process behind.
    monkeypatch.setenv("FAKE_RLK_BREAK_CELLS", "control")
    monkeypatch.setenv("FAKE_RLK_FAIL_CELLS", "ffn-PR")
    monkeypatch.setenv("FAKE_RLK_WORKER_PIDS", str(pids))
    code, report = matrix(root, "control", "ffn-PR", groups=groups)
    assert code == 3
    control, ffn = cell_of(report, "control"), cell_of(report, "ffn-PR")
    assert control["evidence_complete"] and not control["bitwise"] and not control["passed"]
    assert control["latest"]["exit_code"] == 1
    assert "console.log holds a traceback" in ffn["reasons"] and "rlk run exited 3" in ffn["reasons"]
    (worker,) = map(int, pids.read_text().split())
    assert not running(worker), "the crashed cell's worker outlived it"
    assert len(groups) == 2 and not any(map(group_alive, groups))

    monkeypatch.delenv("FAKE_RLK_BREAK_CELLS")
    monkeypatch.delenv("FAKE_RLK_FAIL_CELLS")
    code, report = matrix(root, "control", "ffn-PR", resume=True)
    assert code == 1  # the failed control was kept; only the incomplete ffn-PR ran again
    assert len(analyze.attempts(root, "control")) == 1 and len(analyze.attempts(root, "ffn-PR")) == 2

    code, report = matrix(root, "control", "ffn-PR", rerun_failed=True)
    assert code == 0
    assert len(analyze.attempts(root, "control")) == 2 and len(analyze.attempts(root, "ffn-PR")) == 2
    control = cell_of(report, "control")
    assert control["passed"] and control["bitwise"] and control["latest"]["exit_code"] == 0
    assert [a["passed"] for a in control["attempts"]] == [False]


def test_resume_needs_an_existing_root(tmp_path, fake_rlk):
    code = main(["matrix", "run", "--matrix-root", str(tmp_path / "none"), "--resume",
                 "--workload", "ci", "--no-history"])
    assert code == 2
    assert not (tmp_path / "none").exists()


def in_new_python(code: str, *args: str) -> str:
    """The last line a fresh Python prints running ``code`` (this session has torch loaded)."""
    import subprocess

    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def test_the_runner_never_imports_torch(tmp_path, clean_env):
    """`rlk matrix run --case X` (a DAG job) spends nothing on torch (about 1.5 s on a 2-core
    machine), before its cell starts or after: the cell's own `rlk run` imports it, and the runner
    judges the cell's train data with numpy."""
    code = """
import json, sys
from pathlib import Path
from rl_engine.matrix import runner
runner.RLK_COMMAND = (sys.executable, sys.argv[1])
seen = {}
m = runner.MatrixRun(root=Path(sys.argv[2]), cells=["ffn-PR"], workload="ci",
                     on_start=lambda cell, folder, proc: seen.setdefault(cell, "torch" in sys.modules))
code, report = runner.run(m)
cell = next(c for c in report["cells"] if c["cell"] == "ffn-PR")
print(json.dumps({"at_cell_start": seen["ffn-PR"], "after": "torch" in sys.modules, "code": code,
                  "numel": cell["latest"]["numel"]}))
"""
    out = json.loads(in_new_python(code, str(FAKE), str(tmp_path / "m")))
    assert out == {"at_cell_start": False, "after": False, "code": 0, "numel": CELLS_OF_CI}


def test_the_runner_loads_what_the_analysis_needs_while_a_cell_exits(tmp_path, clean_env):
    """A cell's `rlk run` prints its exit-code marker as its last line, then exits (a second with
    the Ray launcher, while its Ray connection closes); the runner imports what judging the cell
    needs (pyarrow, for the tables) in that time rather than after the run has exited."""
    slow_exit = tmp_path / "slow_exit.py"
    slow_exit.write_text(f"""
import os, runpy, sys, time
from pathlib import Path
try:
    runpy.run_path({str(FAKE)!r}, run_name="__main__")
except SystemExit as exc:
    code = exc.code
print(f"[rlk] exit-code {{code}}", file=sys.stderr, flush=True)
time.sleep(2)  # the run's exit
Path(os.environ["EXITED_AT"]).write_text(str(time.time()))
""")
    code = """
import json, os, sys, threading, time
from pathlib import Path
from rl_engine.matrix import runner
root, exited = Path(sys.argv[2]), Path(sys.argv[3])
os.environ["EXITED_AT"] = str(exited)
runner.RLK_COMMAND = (sys.executable, sys.argv[1])
seen = []
def watch():
    while "pyarrow.parquet" not in sys.modules:
        time.sleep(0.02)
    seen.append(time.time())
threading.Thread(target=watch, daemon=True).start()
at_start = []
code, report = runner.run(runner.MatrixRun(
    root=root, cells=["ffn-PR"], workload="ci",
    on_start=lambda cell, folder, proc: at_start.append("pyarrow.parquet" in sys.modules)))
print(json.dumps({"code": code, "at_start": at_start, "before_exit": seen[0] < float(exited.read_text())}))
"""
    out = json.loads(in_new_python(code, str(slow_exit), str(tmp_path / "m"),
                                   str(tmp_path / "exited")))
    assert out == {"code": 0, "at_start": [False], "before_exit": True}
