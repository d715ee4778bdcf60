"""The gate steps that run post-training steps: strict-run, traced-run, production-run, matrix.

Each runs `rlk run` (or `rlk matrix run`) of the checkout under test as a subprocess, with the plan
and validation switches set explicitly so the caller's environment cannot change what is proved,
into a run directory `<gate-dir>/<step>/` that is never reused (a retry moves the earlier one aside).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from rl_engine import errors
from rl_engine.artifacts import files, ids
from rl_engine.errors import BadInput
from rl_engine.evidence import judge
from rl_engine.evidence.layout import MatrixRoot, RunDir
from rl_engine.gate.process import last_error, product_env, run_logged
from rl_engine.gate.steps import Result, code_root, fail, ok
from rl_engine.runtime.plan import MODULES, SIDES

RLK: tuple[str, ...] = (sys.executable, "-m", "rl_engine.cli")


@dataclass(frozen=True, kw_only=True, slots=True)
class Workload:
    name: str = "default"
    model_root: Path | None = None
    prompt_data: Path | None = None
    steps: int = 1
    device: str = "cpu"
    timeout: float | None = None           # seconds the run (or the matrix) may take

    def __post_init__(self) -> None:
        from rl_engine.step.config import WORKLOADS

        if self.name not in WORKLOADS:
            raise BadInput(f"--workload {self.name!r}: use one of {', '.join(WORKLOADS)}")
        if self.device not in ("cpu", "cuda"):
            raise BadInput(f"--device {self.device!r}: use cpu or cuda")
        if self.steps < 1:
            raise BadInput(f"--steps {self.steps} must be at least 1")

    def flags(self) -> list[str]:
        out = ["--workload", self.name, "--steps", str(self.steps), "--device", self.device]
        if self.model_root is not None:
            out += ["--model-root", str(Path(self.model_root).resolve())]
        if self.prompt_data is not None:
            out += ["--prompt-data", str(Path(self.prompt_data).resolve())]
        return out


def _plan_env(case: str) -> dict[str, str | None]:
    return {f"RL_KERNEL_{m.upper()}_CASE": case for m in MODULES} | {
        "RLK_MODE": "strict", "RL_KERNEL_RUN_ID": None, "RL_KERNEL_ARTIFACT_DIR": None}


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return files.read_json(path)
    except (OSError, ValueError):
        return None


def _rlk_run(gate_dir: Path, step: str, w: Workload, *, case: str, ci_test: bool, trace: bool,
             root: Path) -> tuple[Result | None, dict[str, Any]]:
    """Runs `rlk run`; returns (a failure or None, details)."""
    run_dir = gate_dir / step
    if run_dir.exists():  # run directories are never reused; the earlier attempt stays as evidence
        run_dir.rename(gate_dir / f"{step}.earlier-{ids.new_attempt_id()}")
    run_id = ids.sanitize(f"gate-{step}-{ids.new_attempt_id()}")
    cmd = [*RLK, "run", *w.flags(), "--run-id", run_id, "--artifact-dir", run_dir,
           *(["--trace"] if trace else [])]
    env = product_env(root, **_plan_env(case), CI_TEST="1" if ci_test else "0",
                      VALIDATE_ARTIFACTS="1", CI_LOGP_ABS_DIFF_THRESHOLD="0")
    log = gate_dir / f"{step}.log"
    code = run_logged(cmd, cwd=root, log=log, env=env, timeout=w.timeout)
    details: dict[str, Any] = {"run_dir": str(run_dir), "run_id": run_id, "plan": case,
                               "code_root": str(root), "rlk_exit_code": code, "log": str(log),
                               "workload": {"name": w.name, "steps": w.steps, "device": w.device,
                                            "model_root": w.model_root, "prompt_data": w.prompt_data}}
    run = RunDir(run_dir)
    man = _read(run.manifest) or {}
    details["source"] = {"commit": man.get("source_commit"), "dirty": man.get("source_dirty")}
    if code is None:
        return fail(errors.INFRASTRUCTURE, f"rlk run did not finish in {w.timeout} s", **details), details
    v = judge.judge(run, expect=judge.Expect(run_id=run_id, finished=True), require_bitwise=ci_test)
    details["validation"] = {k: getattr(v, k) for k in (
        "passed", "evidence_complete", "bitwise", "bitwise_required", "numel", "expected_numel",
        "mismatch_count", "nonfinite_count", "max_abs_diff", "first_mismatch", "problems",
        "fallbacks", "sides")}
    if code != 0:
        why = v.problems or [last_error(log) or f"see {log}"]
        return fail(code, f"rlk run exited {code}: {why[0]}", **details), details
    if not v.passed:
        first = (v.problems or [f"{f['side']} {f['module']} fell back: {f['reason']}" for f in v.fallbacks]
                 or [f"mismatch_count={v.mismatch_count} nonfinite_count={v.nonfinite_count} "
                     f"first {v.first_mismatch}"])[0]
        return fail(v.exit_code, f"validation did not pass: {first}", **details), details
    return None, details


def _trace_gates(gate_dir: Path, step: str, run_dir: Path, root: Path, plan: str,
                 device: str) -> tuple[Result | None, dict[str, Any]]:
    """`rlk trace gate` on each side's trace files, with that side's group size."""
    run = RunDir(run_dir)
    layout = (_read(run.manifest) or {}).get("layout", {})
    world = {"training": layout.get("actor_gpus", 1), "rollout": layout.get("rollout_gpus_per_engine", 1)}
    reports: dict[str, Any] = {}
    failure = None
    for side in SIDES:
        traces = run.trace_files(side)
        if not traces:
            reports[side] = {"passed": False, "problems": [f"no {side} trace files"]}
            failure = failure or fail(errors.INFRASTRUCTURE, f"trace check: `rlk run --trace` left no "
                                                             f"{side} trace in {run.trace}")
            continue
        out = gate_dir / f"{step}.trace-gate.{side}.json"
        out.unlink(missing_ok=True)
        cmd = [*RLK, "trace", "gate", *[f"--trace={t}" for t in traces], "--plan", plan, "--device",
               device, "--world-size", str(world[side]), "--side", side, "--output", out]
        code = run_logged(cmd, cwd=root, log=gate_dir / f"{step}.log", env=product_env(root),
                          timeout=1800)
        report = _read(out) or {}
        reports[side] = {"exit_code": code, "passed": bool(report.get("passed")), "report": str(out),
                         "world_size": world[side], "problems": report.get("problems", []),
                         "counts": {k: n for k, n in report.get("counts", {}).items() if n}}
        if code != 0 and failure is None:
            first = (report.get("problems") or [f"exit {code}"])[0]
            failure = fail(3 if code is None else code, f"trace check ({side}, plan {plan}): {first}")
    return failure, reports


def strict_run(gate_dir: Path, w: Workload, *, checkout: Path | None = None) -> Result:
    """The R/R control under CI_TEST=1 VALIDATE_ARTIFACTS=1: exit 0 and a passed validation."""
    failure, details = _rlk_run(gate_dir, "strict-run", w, case="R/R", ci_test=True, trace=False,
                                root=code_root(gate_dir, checkout))
    return failure or ok(**details)


def traced_run(gate_dir: Path, w: Workload, *, checkout: Path | None = None) -> Result:
    """The R/R control with --trace, then the trace check on both sides with the control plan."""
    root = code_root(gate_dir, checkout)
    failure, details = _rlk_run(gate_dir, "traced-run", w, case="R/R", ci_test=True, trace=True, root=root)
    if failure is not None:
        return failure
    failure, details["trace_gate"] = _trace_gates(gate_dir, "traced-run", Path(details["run_dir"]),
                                                  root, "control", w.device)
    return Result(False, failure.exit_code, failure.reason, details) if failure else ok(**details)


def production_run(gate_dir: Path, w: Workload, *, trace: bool = False,
                   checkout: Path | None = None) -> Result:
    """The P/P run: its verdict passes, so every module ran production on every rank of both sides
    with no fallback and no rl_engine kernel launched (`evidence.judge`); with --trace, the trace
    gate with the baseline (P/P) plan too."""
    root = code_root(gate_dir, checkout)
    failure, details = _rlk_run(gate_dir, "production-run", w, case="P/P", ci_test=False, trace=trace,
                                root=root)
    if failure is not None:
        return failure
    run_dir = Path(details["run_dir"])
    if RunDir(run_dir).trace.is_dir():
        failure, details["trace_gate"] = _trace_gates(gate_dir, "production-run", run_dir, root,
                                                      "baseline", w.device)
        if failure is not None:
            return Result(False, failure.exit_code, failure.reason, details)
    return ok(**details)


def matrix(gate_dir: Path, w: Workload, *, cells: Sequence[str] = (), baseline: bool = False,
           checkout: Path | None = None) -> Result:
    """`rlk matrix run` into <gate-dir>/matrix (not appended to the nightly history): exit 0 and a
    passed verdict."""
    root = code_root(gate_dir, checkout)
    matrix_root = gate_dir / "matrix"
    if cells and "control" not in cells:  # the isolation cells are judged against the control
        cells = ["control", *cells]
    cmd = [*RLK, "matrix", "run", "--matrix-root", matrix_root, *w.flags(),
           *[f"--case={c}" for c in cells], *(["--baseline"] if baseline else []), "--no-history"]
    log = gate_dir / "matrix.log"
    env = product_env(root, **{k: None for k in _plan_env("R/R")})
    code = run_logged(cmd, cwd=root, log=log, env=env, timeout=w.timeout)
    report = _read(MatrixRoot(matrix_root).report)
    verdict = (report or {}).get("verdict", {})
    details = {"matrix_root": str(matrix_root), "code_root": str(root), "rlk_exit_code": code,
               "log": str(log), "verdict": verdict,
               "cells": [{"cell": c["cell"], "passed": c["passed"], "reasons": c["reasons"][:3]}
                         for c in (report or {}).get("cells", [])]}
    if code is None:
        return fail(errors.INFRASTRUCTURE, f"rlk matrix run did not finish in {w.timeout} s", **details)
    if code != 0:
        why = (f"failed cells {verdict.get('failed_cells')}, incomplete {verdict.get('incomplete_cells')}"
               if verdict else last_error(log) or f"see {log}")
        return fail(code, f"rlk matrix run exited {code}: {why}", **details)
    if not verdict.get("passed"):
        return fail(errors.INFRASTRUCTURE, "rlk matrix run exited 0 without a passed verdict", **details)
    return ok(**details)
