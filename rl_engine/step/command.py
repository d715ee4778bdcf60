"""The `rlk run` command: resolve the settings, create the run directory, run, validate, report."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from rl_engine.console import console as make_console
from rich.table import Table

from rl_engine import envs, errors
from rl_engine.artifacts import files, ids
from rl_engine.evidence import judge, layout
from rl_engine.runtime.plan import Plan
from rl_engine.step import inputs as step_inputs
from rl_engine.step.config import StepConfig
from rl_engine.step.runner import check_device, run_steps, summary

console = make_console(stderr=True)
failure_log = logging.getLogger("rl_engine.step.failure")
failure_log.propagate = False


def resolve_run(run_id: str | None, artifact_dir: Path | None) -> tuple[str, Path]:
    run_id = run_id or envs.RL_KERNEL_RUN_ID or f"run-{ids.new_attempt_id()}"
    ids.check_id(run_id)
    root = artifact_dir or envs.RL_KERNEL_ARTIFACT_DIR or (envs.RLK_RUNS_ROOT / run_id)
    return run_id, Path(root)


def execute(*, config: StepConfig, plan: Plan, run_id: str, root: Path, model_root: Path | None,
            prompt_file: Path | None, verify_inputs: Path | None, chat_template: bool,
            trace: bool, validate_after: bool, require_bitwise: bool, threshold: float) -> int:
    """Runs the steps into a new run directory; returns the exit code (also written there).

    Bad input (inputs, device, an occupied run directory) is refused before the directory is
    written. One found later still exits 2; a run directory this call made is then removed, and a
    matrix attempt's folder (made by the matrix, holding its case file) records exit code 2."""
    inputs = step_inputs.load(model_root, prompt_file, count=config.rollout_batch_size,
                              chat_template=chat_template, verify_with=verify_inputs)
    check_device(plan, config, inputs.config)
    made = not root.exists()
    run = layout.create(root)
    handler = logging.FileHandler(run.log)
    handler.setFormatter(logging.Formatter("%(asctime)s pid=%(process)d %(message)s"))
    logging.getLogger().addHandler(handler)
    # The failure goes into run.log only: the console's one error line comes from the CLI.
    failure_log.addHandler(handler)
    os.environ["RLK_RUN_LOG"] = str(run.log)
    code = errors.INFRASTRUCTURE
    try:
        with console.status("starting") as status:
            figures = run_steps(plan=plan, config=config, inputs=inputs, run=run, run_id=run_id,
                                trace=trace, on_phase=lambda p: status.update(p))
        result = summary(figures)
        files.write_json(run.steps, {"run_id": run_id, **result})
        code = errors.OK
        if require_bitwise and result["max_abs_diff"] > threshold:
            code = errors.PARITY_FAILURE
        if validate_after:
            verdict = judge.judge(run, expect=judge.Expect(run_id=run_id, plan=plan),
                                  require_bitwise=require_bitwise)
            verdict.write(run.validation)
            code = verdict.exit_code or code
        _print_summary(run_id, plan, run.root, figures, code)
        return code
    except BaseException as exc:
        code = errors.exit_code_for(exc) if isinstance(exc, Exception) else errors.INFRASTRUCTURE
        failure_log.error("run failed (%s): %s", type(exc).__name__, exc)
        raise
    finally:
        logging.getLogger().removeHandler(handler)
        failure_log.removeHandler(handler)
        handler.close()
        os.environ.pop("RLK_RUN_LOG", None)
        if code == errors.BAD_INPUT and made:
            shutil.rmtree(run.root, ignore_errors=True)
        else:
            run.write_exit_code(code)


def _print_summary(run_id: str, plan: Plan, root: Path, figures, code: int) -> None:
    table = Table(title=f"rlk run {run_id}  plan attention={plan.attention} ffn={plan.ffn} "
                        f"logp={plan.logp}")
    for col in ("step", "numel", "mismatch_count", "max_abs_diff", "rollout s", "training s"):
        table.add_column(col, justify="right")
    for f in figures:
        table.add_row(str(f.step), str(f.numel), str(f.mismatch_count), repr(f.max_abs_diff),
                      str(f.seconds.get("rollout")), str(f.seconds.get("training")))
    console.print(table)
    for f in figures:
        print(f.line(), flush=True)
    console.print(f"run directory: {root}  exit code {code}", highlight=False)
