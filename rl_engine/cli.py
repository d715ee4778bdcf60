"""`rlk`: every capability of rl-engine as a command (Airflow tasks and Ray jobs run these)."""

from __future__ import annotations

import logging
import sys

import typer
from rich.console import Console

from rl_engine import errors

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Prove that an RL trainer and its rollout engine compute the same log-probs.")
console = Console(stderr=True)


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


def _mount_optional() -> None:
    """Sub-commands that live next to their code."""
    from rl_engine.models.cli import app as model_app

    app.add_typer(model_app, name="model", help="Generate or inspect Qwen3 checkpoints.")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        _mount_optional()
    except ImportError:
        pass
    try:
        result = app(args=argv, standalone_mode=False)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else errors.BAD_INPUT
    except Exception as exc:  # noqa: BLE001 - every error leaves with the contract's exit code
        import click

        if isinstance(exc, click.ClickException):
            exc.show()
            code = errors.BAD_INPUT
        else:
            code = errors.exit_code_for(exc)
            console.print(f"[red]error[/] ({type(exc).__name__}): {exc}", highlight=False)
    else:
        code = result if isinstance(result, int) else 0
    print(f"[rlk] exit-code {code}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
