"""`rlk matrix run`: the control, then the isolation cells, each one `rlk run` in a new attempt.

Each cell runs as a subprocess in its own session (process group) with the plan, run id and run
directory in its environment; its console output is streamed to ours and kept in console.log. The
group is killed once the run exits, times out, fails or is interrupted, so no worker of one cell
outlives it. The case file is written into the attempt folder before the run starts (run
directories admit the files the matrix writes, see rl_engine/evidence/layout.py), so even a run
killed at once says what it was. An attempt folder is never reused: --resume starts a new attempt
for every cell whose latest one is incomplete (and with --rerun-failed, did not pass).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Sequence, TextIO

from rl_engine import envs, errors
from rl_engine.artifacts import files, ids, provenance
from rl_engine.evidence import records
from rl_engine.evidence.layout import MatrixRoot, RunDir
from rl_engine.matrix import analyze
from rl_engine.runtime.plan import ALL_CELLS, ISOLATION_CELLS, MODULES, cell_plan, normalize_cell

# How a cell's `rlk run` is started; tests swap in a stand-in.
RLK_COMMAND: tuple[str, ...] = (sys.executable, "-m", "rl_engine.cli")
_KILL_GRACE_S = 5.0


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


def _pump(stream, console: Path, out: TextIO, prefix: str) -> None:
    with open(console, "ab") as fh:
        for line in iter(stream.readline, b""):
            fh.write(line)
            fh.flush()
            out.write(prefix + line.decode("utf-8", "replace"))
            out.flush()


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


def run_cell(m: MatrixRun, cell: str, mid: str, config) -> Path:
    """One attempt of one cell; returns its folder. Raises only on interruption."""
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
                            stderr=subprocess.STDOUT, start_new_session=True)
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
        pump.join(timeout=10)
        if pump.is_alive():  # a process outside the group holds the pipe; closing it would block
            m.out.write(f"[matrix] {cell}: output still open after the run ended; not waiting\n")
        else:
            proc.stdout.close()
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
    if not row["complete"]:
        m.out.write(f"[matrix] {cell}: attempt {previous[-1].name} is incomplete; new attempt\n")
        return True
    if m.rerun_failed and not row["passed"]:
        m.out.write(f"[matrix] {cell}: attempt {previous[-1].name} did not pass; new attempt\n")
        return True
    m.out.write(f"[matrix] {cell}: attempt {previous[-1].name} is complete; kept\n")
    return False


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

    config = StepConfig.resolve(m.workload, **m.overrides)   # a layout it refuses is exit 2 now
    if (m.resume or m.rerun_failed) and not m.root.is_dir():
        raise errors.BadInput(f"--resume needs an existing --matrix-root; {m.root} does not exist")
    mid = _init_root(m.root)
    cells = m.selected()
    for cell in cells:
        if _wants_run(m, cell, mid):
            run_cell(m, cell, mid, config)
    # Cells this run did not select may still be run by another (the DAG runs one cell per job):
    # they are pending, not failed, unless this run covered every cell of the matrix.
    final = set(analyze.expected_cells(m.root, m.baseline or "baseline" in cells)) <= set(cells)
    report = analyze.write_report(m.root, baseline=m.baseline or "baseline" in cells, final=final)
    if history_root is not None:
        from rl_engine.matrix import history

        history.append(report, history_root)
    chosen = [c for c in report["cells"] if c["cell"] in cells]
    return analyze.verdict(chosen)["exit_code"], report
