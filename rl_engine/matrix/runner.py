"""`rlk matrix run`: the control, then the isolation cells, each one `rlk run` in a new attempt.

Each cell runs as a subprocess in its own session (process group) with the plan, run id and run
directory in its environment; its console output is streamed to ours and kept in console.log. The
group is killed once the run exits, times out, fails or is interrupted, so no worker of one cell
outlives it. A cell also dies with its runner: the run gets SIGKILL when the runner dies (a
parent-death signal), and a watchdog kills the whole group once the runner is gone (watchdog.py).
A lock file in the cell's folder, held as long as the cell's run lives (the run inherits it),
forbids a second live attempt of the cell. The case file is written into the attempt folder before
the run starts (run directories admit the files the matrix writes, see
rl_engine/evidence/layout.py), so even a run killed at once says what it was; a run that exits
without writing its exit code (bad input refused before its run directory) has it recorded. An
attempt folder is never reused: --resume keeps a cell whose latest attempt's exit code is 0, 1 or 2
(answers a rerun would repeat) and starts a new attempt for any other (and with --rerun-failed, for
one that did not pass).
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence, TextIO

from rl_engine import envs, errors
from rl_engine.artifacts import files, ids, provenance
from rl_engine.evidence import records
from rl_engine.evidence.layout import MatrixRoot, RunDir
from rl_engine.matrix import analyze
from rl_engine.matrix.watchdog import Watchdog, die_with
from rl_engine.runtime.plan import ALL_CELLS, ISOLATION_CELLS, MODULES, cell_plan, normalize_cell

# How a cell's `rlk run` is started; tests swap in a stand-in.
RLK_COMMAND: tuple[str, ...] = (sys.executable, "-m", "rl_engine.cli")
_KILL_GRACE_S = 5.0
# How long a cell waits for another live attempt of it to end (a killed runner's cell dies within
# a second or so) before it is refused as an infrastructure failure (retried by orchestration).
LOCK_WAIT_S = 15.0
LOCK_FILE = "cell.lock"
KEPT_EXIT_CODES = (errors.OK, errors.PARITY_FAILURE, errors.BAD_INPUT)


@dataclass(kw_only=True)
class MatrixRun:
    root: Path
    cells: Sequence[str] = ()             # empty: the control and the nine isolation cells
    baseline: bool = False
    workload: str = "default"
    overrides: dict[str, Any] = field(default_factory=dict)   # StepConfig fields (flags of rlk run)
    model_root: Path | None = None
    prompt_data: Path | None = None
    chat_template: bool = False
    resume: bool = False
    rerun_failed: bool = False
    cell_timeout: float | None = None
    command: Sequence[str] = field(default_factory=lambda: RLK_COMMAND)
    out: TextIO = field(default_factory=lambda: sys.stdout)
    # Called with (cell, attempt folder, process) once a cell's run has started.
    on_start: Callable[[str, Path, subprocess.Popen], None] | None = None

    def selected(self) -> list[str]:
        if self.cells:
            chosen = {normalize_cell(c) for c in self.cells}
        else:
            chosen = {"control", *ISOLATION_CELLS} | ({"baseline"} if self.baseline else set())
        return [c for c in ALL_CELLS if c in chosen]  # the control first


def default_root() -> Path:
    return envs.RLK_MATRIX_ROOT / f"matrix-{ids.new_attempt_id()}"


def _flags(m: MatrixRun) -> list[str]:
    flags = ["--workload", m.workload]
    for name, value in sorted(m.overrides.items()):
        if value is not None:
            flags += [f"--{name.replace('_', '-')}", str(value)]
    if m.model_root is not None:
        flags += ["--model-root", str(m.model_root)]
    if m.prompt_data is not None:
        flags += ["--prompt-data", str(m.prompt_data)]
    if m.chat_template:
        flags.append("--chat-template")
    return flags


def group_alive(pgid: int) -> bool:
    """Whether a process of the group still runs (zombies waiting for a reaper do not count)."""
    import psutil

    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                return True
        except (psutil.Error, OSError):
            continue
    return False


def _kill_group(pgid: int) -> None:
    """SIGTERM to the cell's process group, SIGKILL to whatever is left after a grace period."""
    for sig, wait in ((signal.SIGTERM, _KILL_GRACE_S), (signal.SIGKILL, 0.0)):
        if not group_alive(pgid):
            return
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and group_alive(pgid):
            time.sleep(0.05)


@contextmanager
def cell_lock(root: Path, cell: str, out: TextIO) -> Iterator[int]:
    """An exclusive lock on the cell's lock file; yields its descriptor, which the cell's run
    inherits so that the lock lives exactly as long as the run (even if this process dies)."""
    folder = MatrixRoot(root).cell(cell)
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + LOCK_WAIT_S
        waited = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
                    raise errors.InfrastructureError(
                        f"cell {cell} of {root} has a live attempt (started by runner pid {holder}) "
                        f"after {LOCK_WAIT_S:.0f} s; two attempts of one cell never run at once: "
                        "wait for it to end or stop it, then run again") from None
                if not waited:
                    out.write(f"[matrix] {cell}: another attempt of this cell is live; waiting\n")
                    out.flush()
                    waited = True
                time.sleep(0.2)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield fd
    finally:
        os.close(fd)


# What judging a finished cell imports: pyarrow writes the tables, about 0.3 s on a small CPU.
# Torch is not among them: the train data is read with numpy (`artifacts.torchfile`).
ANALYSIS_MODULES = ("pyarrow.parquet", "rl_engine.matrix.tables")
_MARKER = errors.MARKER.encode()


def _import_analysis() -> None:
    import importlib

    for name in ANALYSIS_MODULES:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the analysis imports it again and reports the error
            return


def _pump(stream, console: Path, out: TextIO, prefix: str) -> None:
    """Copy the cell's output to console.log and ours. The run's last line, its exit-code marker,
    says it is exiting (which takes it a second with the Ray launcher, while its Ray connection
    closes): the analysis' imports are loaded then, while the runner would only wait, rather than
    after the run has exited."""
    with open(console, "ab") as fh:
        for line in iter(stream.readline, b""):
            fh.write(line)
            fh.flush()
            out.write(prefix + line.decode("utf-8", "replace"))
            out.flush()
            if line.startswith(_MARKER):
                threading.Thread(target=_import_analysis, daemon=True, name="import-analysis").start()


def case_env(mid: str, cell: str, attempt_id: str, workload: str, config, *,
             model_root: Path | None = None, prompt_data: Path | None = None) -> dict[str, Any]:
    """The case file: what the attempt was asked to run (plan, layout, workload, source)."""
    plan = cell_plan(cell)
    src = provenance.source()
    return {"MATRIX_ID": mid, "CELL": cell, "ATTEMPT_ID": attempt_id,
            "RL_KERNEL_RUN_ID": analyze.run_id_of(mid, cell, attempt_id),
            **{f"RL_KERNEL_{mod.upper()}_CASE": plan.case(mod) for mod in MODULES},
            "RLK_MODE": plan.mode, "WORKLOAD": workload,
            **{k.upper(): v for k, v in config.as_dict().items()},
            "EXPECTED_NUMEL": config.numel_per_step * config.steps,
            "MODEL_ROOT": model_root or "", "PROMPT_DATA": prompt_data or "",
            "SOURCE_COMMIT": src["commit"] or "", "SOURCE_DIRTY": src["dirty"],
            "STARTED_AT": datetime.now(timezone.utc).isoformat(timespec="milliseconds")}


def run_cell(m: MatrixRun, cell: str, mid: str, config, lock_fd: int | None = None) -> Path:
    """One attempt of one cell; returns its folder. Raises only on interruption. The run inherits
    lock_fd (the cell's lock) so that the lock is held as long as the run lives."""
    while True:
        attempt_id = ids.new_attempt_id()
        folder = m.root / cell / attempt_id
        try:
            folder.mkdir(parents=True)
            break
        except FileExistsError:
            continue
    plan = cell_plan(cell)
    run_id = analyze.run_id_of(mid, cell, attempt_id)
    run = RunDir(folder)
    records.write_case_env(run, case_env(
        mid, cell, attempt_id, m.workload, config, model_root=m.model_root,
        prompt_data=m.prompt_data))
    env = {**os.environ, "RL_KERNEL_RUN_ID": run_id, "RL_KERNEL_ARTIFACT_DIR": str(folder),
           "VALIDATE_ARTIFACTS": "1", "CI_TEST": "1" if cell == "control" else "0",
           "PYTHONUNBUFFERED": "1", "RLK_MODE": plan.mode,
           **{f"RL_KERNEL_{mod.upper()}_CASE": plan.case(mod) for mod in MODULES}}
    cmd = [*m.command, "run", *_flags(m)]
    m.out.write(f"[matrix] {cell}: attempt {attempt_id} run {run_id}\n")
    m.out.flush()
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=die_with(os.getpid()),
                            pass_fds=() if lock_fd is None else (lock_fd,))
    Watchdog.watch(proc.pid)
    pump = threading.Thread(target=_pump, args=(proc.stdout, run.console_log, m.out,
                                                f"[{cell}] "), daemon=True)
    pump.start()
    try:
        if m.on_start is not None:
            m.on_start(cell, folder, proc)
        try:
            code = proc.wait(timeout=m.cell_timeout)
        except subprocess.TimeoutExpired:
            m.out.write(f"[matrix] {cell}: no exit after {m.cell_timeout} s; stopping it\n")
            _kill_group(proc.pid)
            code = proc.wait()
    except BaseException:
        _kill_group(proc.pid)
        proc.wait()
        raise
    finally:
        _kill_group(proc.pid)  # workers the run left behind, also after a clean exit
        Watchdog.forget(proc.pid)
        pump.join(timeout=10)
        if pump.is_alive():  # a process outside the group holds the pipe; closing it would block
            m.out.write(f"[matrix] {cell}: output still open after the run ended; not waiting\n")
        else:
            proc.stdout.close()
    if code >= 0 and not run.exit_code.exists():  # refused before its run directory was written
        run.write_exit_code(code)
    how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
    m.out.write(f"[matrix] {cell}: attempt {attempt_id} ended ({how})\n")
    m.out.flush()
    return folder


def _wants_run(m: MatrixRun, cell: str, mid: str) -> bool:
    if not (m.resume or m.rerun_failed):
        return True
    previous = analyze.attempts(m.root, cell)
    if not previous:
        return True
    row = analyze.inspect_attempt(previous[-1], cell, mid)
    name, code = previous[-1].name, row["exit_code"]
    if code not in KEPT_EXIT_CODES:
        why = "has no exit code (it was killed)" if code is None else f"exited {code}"
        m.out.write(f"[matrix] {cell}: attempt {name} {why}; new attempt\n")
        return True
    if m.rerun_failed and not row["passed"]:
        m.out.write(f"[matrix] {cell}: attempt {name} did not pass; new attempt\n")
        return True
    m.out.write(f"[matrix] {cell}: attempt {name} exited {code}; kept\n")
    return False


def check_inputs(m: MatrixRun) -> None:
    """What every cell would refuse, refused once: the model folder's config and the prompts file.
    The cells still check everything (weights, hashes, the device) themselves."""
    if m.model_root is not None:
        from rl_engine.models import checkpoint

        checkpoint.load_config(m.model_root)
    if m.prompt_data is not None and not Path(m.prompt_data).is_file():
        raise errors.BadInput(f"PROMPT_DATA {m.prompt_data} does not exist; give a JSONL file of prompts")


def _init_root(root: Path) -> str:
    """The matrix id (from matrix.json, written the first time a root is used)."""
    path = MatrixRoot(root).matrix_file
    if not path.exists():
        root.mkdir(parents=True, exist_ok=True)
        files.write_json(path, {"matrix_id": ids.sanitize(root.resolve().name),
                                "created_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                                "source": provenance.source()})
    return analyze.matrix_id(root)


def run(m: MatrixRun, *, history_root: Path | None = None) -> tuple[int, dict[str, Any]]:
    """Runs the selected cells, analyzes the root and writes the report; returns (exit code, report).
    The exit code is the verdict over the selected cells."""
    from rl_engine.step.config import StepConfig

    # Bad input is refused here, before the matrix root is written: cells, layout, inputs.
    cells = m.selected()
    config = StepConfig.resolve(m.workload, **m.overrides)
    if (m.resume or m.rerun_failed) and not m.root.is_dir():
        raise errors.BadInput(f"--resume needs an existing --matrix-root; {m.root} does not exist")
    check_inputs(m)
    mid = _init_root(m.root)
    for cell in cells:
        with cell_lock(m.root, cell, m.out) as lock_fd:
            if _wants_run(m, cell, mid):
                run_cell(m, cell, mid, config, lock_fd)
    # Cells this run did not select may still be run by another (the DAG runs one cell per job):
    # they are pending, not failed, unless this run covered every cell of the matrix.
    final = set(analyze.expected_cells(m.root, m.baseline or "baseline" in cells)) <= set(cells)
    report = analyze.write_report(m.root, baseline=m.baseline or "baseline" in cells, final=final)
    if history_root is not None:
        from rl_engine.matrix import history

        history.append(report, history_root)
    chosen = [c for c in report["cells"] if c["cell"] in cells]
    return analyze.verdict(chosen)["exit_code"], report
