"""`rlk`: every capability of rl-engine as a command (Airflow tasks and Ray jobs run these)."""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
from pathlib import Path

import typer
from rl_engine.console import console as make_console

from rl_engine import errors

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Prove that an RL trainer and its rollout engine compute the same log-probs.")
console = make_console(stderr=True)


@app.command()
def preflight(
    device: str = typer.Option("cpu", help="cpu or cuda"),
) -> None:
    """Check that this checkout can run the plan's R routes (RL_KERNEL_*_CASE), before any work."""
    from rl_engine.runtime import preflight as pf
    from rl_engine.runtime.plan import Plan

    plan = Plan.from_env()
    for check in pf.run(plan, device):
        mark = "[green]ok[/]" if check.ok else "[red]FAIL[/]"
        console.print(f"{mark} {check.name}: {check.detail}", highlight=False)
        if not check.ok:
            raise typer.Exit(check.exit_code)


@app.command()
def run(
    steps: int = typer.Option(1, help="post-training steps; weights are synced between steps"),
    workload: str = typer.Option("default", help="default (the runbook's) or ci (fewer tokens and ranks)"),
    tp: int = typer.Option(None, help="trainer TP size (TP_SIZE)"),
    cp: int = typer.Option(None, help="trainer CP size (CP_SIZE)"),
    actor_gpus: int = typer.Option(None, help="trainer ranks = TP x CP x DP (ACTOR_GPUS)"),
    rollout_gpus: int = typer.Option(None, help="rollout ranks (ROLLOUT_GPUS)"),
    rollout_gpus_per_engine: int = typer.Option(None, help="TP of each rollout engine"),
    rollout_batch_size: int = typer.Option(None, help="prompts per step (ROLLOUT_BATCH_SIZE)"),
    n_samples_per_prompt: int = typer.Option(None, help="samples per prompt"),
    max_response_len: int = typer.Option(None, help="new tokens per sample (exactly)"),
    max_tokens_per_gpu: int = typer.Option(None, help="micro-batch token budget per rank"),
    model_root: Path = typer.Option(None, help="Qwen3 folder (MODEL_ROOT); default: embedded tiny"),
    prompt_data: Path = typer.Option(None, help="JSONL prompts (PROMPT_DATA); default: built-in"),
    chat_template: bool = typer.Option(False, help="apply the tokenizer's chat template"),
    run_id: str = typer.Option(None, help="run id (RL_KERNEL_RUN_ID)"),
    artifact_dir: Path = typer.Option(None, help="the run directory (RL_KERNEL_ARTIFACT_DIR)"),
    verify_inputs: Path = typer.Option(None, help="a run's manifest or a sha256sum file the inputs must match"),
    trace: bool = typer.Option(False, help="record a torch.profiler trace into trace/"),
    seed: int = typer.Option(0),
    device: str = typer.Option("cpu", help="cpu or cuda"),
    colocate: bool = typer.Option(True, help="training and rollout share GPUs, one after the other; "
                                             "--no-colocate puts rollout on the next ROLLOUT_GPUS"),
    trainer: str = typer.Option(None, help="the trainer (RLK_TRAINER): builtin or megatron"),
    rollout_engine: str = typer.Option(None, help="the rollout engine (RLK_ROLLOUT_ENGINE): builtin or vllm"),
) -> int:
    """Run post-training steps under the plan of RL_KERNEL_*_CASE (default: the R/R control)."""
    from rl_engine import envs
    from rl_engine.runtime.plan import Plan
    from rl_engine.step.command import execute, resolve_run
    from rl_engine.step.config import StepConfig

    plan = Plan.from_env()
    config = StepConfig.resolve(
        workload, steps=steps, tp=tp, cp=cp, actor_gpus=actor_gpus, rollout_gpus=rollout_gpus,
        rollout_gpus_per_engine=rollout_gpus_per_engine, rollout_batch_size=rollout_batch_size,
        n_samples_per_prompt=n_samples_per_prompt, max_response_len=max_response_len,
        max_tokens_per_gpu=max_tokens_per_gpu, seed=seed, device=device, colocate=colocate,
        trainer=trainer, rollout_engine=rollout_engine)
    rid, root = resolve_run(run_id, artifact_dir)
    return execute(config=config, plan=plan, run_id=rid, root=root,
                   model_root=model_root or envs.MODEL_ROOT, prompt_file=prompt_data or envs.PROMPT_DATA,
                   verify_inputs=verify_inputs, chat_template=chat_template, trace=trace,
                   validate_after=envs.VALIDATE_ARTIFACTS or envs.CI_TEST,
                   require_bitwise=envs.CI_TEST, threshold=envs.CI_LOGP_ABS_DIFF_THRESHOLD)


@app.command("validate")
def validate_cmd(
    run_dir: Path = typer.Argument(..., help="the run directory `rlk run` wrote"),
    output: Path = typer.Option(None, help="also write the verdict JSON here"),
    require_bitwise: bool = typer.Option(False, help="bitwise equality required (CI_TEST=1 sets it)"),
    run_id: str = typer.Option(None, help="the run id every record must carry (default: the manifest's)"),
) -> int:
    """Judge a run's evidence: complete, of this run and commit, and bitwise equal where required."""
    from rl_engine import envs
    from rl_engine.validation.validate import validate

    verdict = validate(run_dir, run_id=run_id, require_bitwise=require_bitwise or envs.CI_TEST,
                       output=output)
    for problem in verdict.problems:
        console.print(f"[red]problem[/] {problem}", highlight=False)
    for fb in verdict.fallbacks:
        console.print(f"[red]fallback[/] {fb['side']} {fb['module']} rank {fb['rank']}: {fb['reason']}",
                      highlight=False)
    console.print(f"passed={verdict.passed} evidence_complete={verdict.evidence_complete} "
                  f"bitwise={verdict.bitwise} bitwise_required={verdict.bitwise_required} "
                  f"numel={verdict.numel} mismatch_count={verdict.mismatch_count} "
                  f"nonfinite_count={verdict.nonfinite_count} max_abs_diff={verdict.max_abs_diff}",
                  highlight=False)
    return verdict.exit_code


manifest_app = typer.Typer(no_args_is_help=True, help="Record and check input hashes.")
app.add_typer(manifest_app, name="manifest")


@manifest_app.command("verify")
def manifest_verify(file: Path = typer.Argument(..., help="a run's manifest or a sha256sum-format file")) -> int:
    """Check every input file against its recorded sha256; exit 2 naming the first difference."""
    from rl_engine.artifacts import manifest

    if not file.is_file():
        console.print(f"[red]error[/] {file} does not exist", highlight=False)
        return 2
    problems = manifest.verify(file)
    for p in problems:
        console.print(f"[red]differs[/] {p}", highlight=False)
    if not problems:
        console.print(f"ok: every input matches {file}", highlight=False)
    return 2 if problems else 0


def _mount_subcommands() -> None:
    """Sub-commands that live next to their code. A sub-command that cannot be imported is a broken
    checkout, so the error is not swallowed."""
    from rl_engine.gate.cli import app as gate_app
    from rl_engine.matrix.cli import app as matrix_app
    from rl_engine.models.cli import app as model_app
    from rl_engine.stack.cli import mount as mount_stack
    from rl_engine.trace.cli import app as trace_app
    from rl_engine.validation.attention_cli import mount as mount_attention_gate

    mount_stack(app)  # demo, up, down
    mount_attention_gate(app)  # attention-gate
    app.add_typer(matrix_app, name="matrix")
    app.add_typer(trace_app, name="trace")
    app.add_typer(model_app, name="model", help="Generate or inspect Qwen3 checkpoints.")
    app.add_typer(gate_app, name="gate")


def _help_of(ctx) -> str:
    """`rlk <verb ...> --help` for the command a usage error came from."""
    words = []
    while ctx is not None and ctx.parent is not None:
        words.insert(0, ctx.info_name)
        ctx = ctx.parent
    return " ".join(["rlk", *words, "--help"])


def main(argv: list[str] | None = None) -> int:
    """Run one verb; return its exit code. ``argv`` None: the `rlk` command itself (the arguments
    are the process's), whose process exits next."""
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    _mount_subcommands()
    try:
        result = app(args=argv, standalone_mode=False)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else errors.BAD_INPUT
    except typer.TyperException as exc:  # a usage error: an unknown flag, verb or a bad value
        message = exc.format_message().rstrip(".")
        if message:  # empty when the help was shown for a verb given without arguments
            console.print(f"[red]error[/] ({type(exc).__name__}): {message}; "
                          f"see `{_help_of(getattr(exc, 'ctx', None))}`", highlight=False)
        code = errors.BAD_INPUT
    except Exception as exc:  # noqa: BLE001 - every error leaves with the contract's exit code
        code = errors.exit_code_for(exc)
        console.print(f"[red]error[/] ({type(exc).__name__}): {exc}", highlight=False)
    else:
        code = result if isinstance(result, int) else 0
    print(f"{errors.MARKER} {code}", file=sys.stderr)
    if argv is None:
        _exit(code)
    return code


def _exit(code: int) -> None:
    """The `rlk` process's end: threads, exit handlers (the Ray launcher's, multiprocessing's,
    logging's) and buffered output finish as in any exit, then the process ends without the
    interpreter's teardown. With torch loaded that teardown takes about 0.15 s on a small CPU (its
    garbage collections 0.5 s more) only to free memory the exit frees anyway, and a matrix cell
    pays it twice, in its run and in its runner."""
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing left to say there
            pass
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
