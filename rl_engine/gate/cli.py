"""`rlk gate STEP --gate-dir DIR ...`: one command per clean-room gate step.

Every step writes `DIR/<step>.json` atomically (`schema_version`, `step`, `passed`, `exit_code`,
`reason`, `details`, `options`, `started_at`, `finished_at`, `seconds`), also when it fails, and
exits 0 (pass), 1 (the evidence shows a parity or route failure), 2 (bad input) or 3
(infrastructure); a failure prints `gate step <name> failed: <reason>`.
"""

from __future__ import annotations

import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import typer

from rl_engine.console import console as make_console

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="The clean-room gate: one command per step, each writing GATE_DIR/<step>.json.")
console = make_console(stderr=True)

GATE_DIR = typer.Option(..., help="the gate's folder: each step writes <step>.json there")
CHECKOUT = typer.Option(None, help="the code under test (default: the checkout step's folder, "
                                   "else this rl_engine's checkout)")
WORKLOAD = typer.Option("default", help="default (the runbook's) or ci (fewer tokens and ranks)")
MODEL_ROOT = typer.Option(None, help="Qwen3 folder (default: the embedded tiny model)")
PROMPT_DATA = typer.Option(None, help="JSONL prompts (default: built-in)")
STEPS = typer.Option(1, help="post-training steps per run")
DEVICE = typer.Option("cpu", help="cpu or cuda")
TIMEOUT = typer.Option(None, help="seconds the run may take before it is stopped (exit 3)")


@app.callback()
def _group() -> None:
    """The clean-room gate: one command per step, each writing GATE_DIR/<step>.json."""


def execute(step: str, gate_dir: Path, options: dict[str, Any], work: Callable[[Path], Any]) -> int:
    """Runs work(the absolute gate dir), writes the step's result file whatever happens, prints its
    verdict and returns its exit code."""
    from rl_engine import errors
    from rl_engine.artifacts import files
    from rl_engine.gate.steps import Result

    gate_dir = Path(gate_dir).resolve()
    gate_dir.mkdir(parents=True, exist_ok=True)
    started, t0 = datetime.now(timezone.utc), time.monotonic()
    try:
        result = work(gate_dir)
    except Exception as exc:  # noqa: BLE001 - every failure is recorded, with the contract's code
        code = errors.exit_code_for(exc)
        result = Result(False, code, str(exc) if code == errors.BAD_INPUT else f"{type(exc).__name__}: {exc}")
    seconds = round(time.monotonic() - t0, 3)
    path = files.write_json(gate_dir / f"{step}.json", {
        "step": step, "passed": result.passed, "exit_code": result.exit_code, "reason": result.reason,
        "details": result.details, "options": options, "started_at": started.isoformat(timespec="seconds"),
        "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"), "seconds": seconds,
    })
    if result.passed:
        console.print(f"gate step {step} passed in {seconds:.1f} s: {path}", markup=False, highlight=False)
    else:
        console.print(f"gate step {step} failed: {result.reason}", style="red", markup=False,
                      highlight=False)
    return result.exit_code


def _workload(workload: str, model_root: Path | None, prompt_data: Path | None, steps: int,
              device: str, timeout: float | None):
    from rl_engine.gate.runs import Workload

    return Workload(name=workload, model_root=model_root, prompt_data=prompt_data, steps=steps,
                    device=device, timeout=timeout)


@app.command("checkout")
def checkout_cmd(
    gate_dir: Path = GATE_DIR,
    repo: str = typer.Option(None, help="URL or path of the repository to clone"),
    commit: str = typer.Option(None, help="the pinned commit (7 to 40 hex digits)"),
    dest: Path = typer.Option(None, help="an empty folder for the checkout (default: GATE_DIR/checkout)"),
    source: Path = typer.Option(None, help="instead of cloning: this checkout must be clean (at --commit)"),
) -> int:
    """Clone and check out the pinned commit; `git status --porcelain` must be empty."""
    from rl_engine.gate import steps

    return execute("checkout", gate_dir, dict(repo=repo, commit=commit, dest=dest, source=source),
                   lambda d: steps.checkout(d, repo=repo, commit=commit, dest=dest, source=source))


@app.command("build")
def build_cmd(
    gate_dir: Path = GATE_DIR, checkout: Path = CHECKOUT, device: str = DEVICE,
    install: bool = typer.Option(True, help="pip install -e the checkout; --no-install requires "
                                            "its existing build to be newer than its sources"),
) -> int:
    """Build the extension of the checkout, then run preflight (on cuda: the sm90 kernels)."""
    from rl_engine.gate import steps

    return execute("build", gate_dir, dict(checkout=checkout, device=device, install=install),
                   lambda d: steps.build(d, checkout=checkout, install=install, device=device))


@app.command("verify-inputs")
def verify_inputs_cmd(
    gate_dir: Path = GATE_DIR,
    manifest: Path = typer.Option(None, help="a run's manifest or a sha256sum file the inputs must match"),
    model_root: Path = typer.Option(None, help="model folder: checked against its manifest.sha256"),
    prompt_data: Path = typer.Option(None, help="JSONL prompts: must be recorded in --manifest"),
) -> int:
    """Check the inputs against their recorded hashes before anything runs."""
    from rl_engine.gate import steps

    return execute("verify-inputs", gate_dir,
                   dict(manifest=manifest, model_root=model_root, prompt_data=prompt_data),
                   lambda d: steps.verify_inputs(d, manifest_file=manifest, model_root=model_root,
                                               prompt_data=prompt_data))


@app.command("tests")
def tests_cmd(
    gate_dir: Path = GATE_DIR, checkout: Path = CHECKOUT,
    select: list[str] = typer.Option(None, help="test path or node id, relative to the checkout; repeatable"),
    keyword: str = typer.Option(None, help="pytest -k expression"),
    timeout: float = TIMEOUT,
) -> int:
    """Targeted tests of the checkout; GATE_DIR/tests.log and tests-junit.xml."""
    from rl_engine.gate import steps

    return execute("tests", gate_dir, dict(checkout=checkout, select=select, keyword=keyword),
                   lambda d: steps.tests(d, select=select or [], keyword=keyword,
                                       checkout=checkout, timeout=timeout))


def _run_command(name: str, doc: str) -> None:
    """Registers the gate step `name`: one `rlk run` of the workload, judged by runs.<name>."""

    def command(
        gate_dir: Path = GATE_DIR, checkout: Path = CHECKOUT, workload: str = WORKLOAD,
        model_root: Path = MODEL_ROOT, prompt_data: Path = PROMPT_DATA, steps: int = STEPS,
        device: str = DEVICE, timeout: float = TIMEOUT,
    ) -> int:
        from rl_engine.gate import runs

        judge = getattr(runs, name.replace("-", "_"))
        opts = dict(checkout=checkout, workload=workload, model_root=model_root,
                    prompt_data=prompt_data, steps=steps, device=device, timeout=timeout)
        return execute(name, gate_dir, opts, lambda d: judge(
            d, _workload(workload, model_root, prompt_data, steps, device, timeout), checkout=checkout))

    command.__doc__ = doc
    app.command(name)(command)


_run_command("strict-run", "The R/R control, CI_TEST=1 VALIDATE_ARTIFACTS=1, into GATE_DIR/strict-run.")
_run_command("traced-run", "The R/R control with --trace into GATE_DIR/traced-run, then the trace "
                           "gate (control plan).")


@app.command("production-run")
def production_run_cmd(
    gate_dir: Path = GATE_DIR, checkout: Path = CHECKOUT, workload: str = WORKLOAD,
    model_root: Path = MODEL_ROOT, prompt_data: Path = PROMPT_DATA, steps: int = STEPS,
    device: str = DEVICE, timeout: float = TIMEOUT,
    trace: bool = typer.Option(False, help="also trace it and run the trace check with the P/P plan"),
) -> int:
    """The P/P run into GATE_DIR/production-run: every module production on both sides."""
    from rl_engine.gate import runs

    opts = dict(checkout=checkout, workload=workload, model_root=model_root, prompt_data=prompt_data,
                steps=steps, device=device, timeout=timeout, trace=trace)
    return execute("production-run", gate_dir, opts, lambda d: runs.production_run(
        d, _workload(workload, model_root, prompt_data, steps, device, timeout), trace=trace,
        checkout=checkout))


@app.command("matrix")
def matrix_cmd(
    gate_dir: Path = GATE_DIR, checkout: Path = CHECKOUT, workload: str = WORKLOAD,
    model_root: Path = MODEL_ROOT, prompt_data: Path = PROMPT_DATA, steps: int = STEPS,
    device: str = DEVICE, timeout: float = TIMEOUT,
    case: list[str] = typer.Option(None, help="run only this cell after the control; repeatable"),
    baseline: bool = typer.Option(False, help="also run the all-P/P baseline"),
) -> int:
    """`rlk matrix run` into GATE_DIR/matrix: the control and the isolation cells."""
    from rl_engine.gate import runs

    opts = dict(checkout=checkout, workload=workload, model_root=model_root, prompt_data=prompt_data,
                steps=steps, device=device, timeout=timeout, case=case, baseline=baseline)
    return execute("matrix", gate_dir, opts, lambda d: runs.matrix(
        d, _workload(workload, model_root, prompt_data, steps, device, timeout),
        cells=case or (), baseline=baseline, checkout=checkout))


@app.command("archive")
def archive_cmd(
    gate_dir: Path = GATE_DIR,
    matrix_root: Path = typer.Option(None, help="a matrix root run outside the gate (the DAG's)"),
    skip: list[str] = typer.Option(None, help="a step left out on purpose; repeatable"),
) -> int:
    """GATE_DIR/gate-archive.json: every result, manifest, commit and the environment; the verdict."""
    from rl_engine.gate import archive

    return execute("archive", gate_dir, dict(matrix_root=matrix_root, skip=skip),
                   lambda d: archive.build(d, matrix_root=matrix_root, skip=skip or ()))
