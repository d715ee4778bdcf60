"""`rlk demo`, `rlk up`, `rlk down`: the embedded stack (a local Ray head, a SQLite Airflow home)."""

from __future__ import annotations

from pathlib import Path

import typer

from rl_engine.runtime.plan import ISOLATION_CELLS


def _state(state_dir: Path | None) -> Path:
    from rl_engine import envs

    return (state_dir or envs.RLK_STATE_DIR).resolve()


def _matrix_base(matrix_root: Path | None) -> Path:
    from rl_engine import envs

    return (matrix_root or envs.RLK_MATRIX_ROOT).resolve()


def demo(
    workload: str = typer.Option("ci", help="ci (fewer tokens and ranks) or default (the runbook's)"),
    cell: list[str] = typer.Option(None, help="run only this isolation cell (repeatable; default: all "
                                              "nine; baseline is optional); the control always runs"),
    launcher: str = typer.Option("ray", help="ray (ranks are Ray actors) or local (processes of the job)"),
    num_cpus: int = typer.Option(4, help="CPUs of the local Ray head (a cell's ranks must fit)"),
    state_dir: Path = typer.Option(None, help="state folder (RLK_STATE_DIR, default ./.state)"),
    matrix_root: Path = typer.Option(None, help="folder of matrix roots (RLK_MATRIX_ROOT, default "
                                                "./matrix-runs)"),
) -> int:
    """Run the matrix DAG end to end on the embedded stack and print its report.

    Every cell is a Ray job on a local Ray head, which is stopped at the end."""
    from rl_engine.errors import BadInput
    from rl_engine.stack import demo as demo_mod

    if workload not in ("ci", "default"):
        raise BadInput(f"--workload {workload!r}: use ci or default")
    if launcher not in ("ray", "local"):
        raise BadInput(f"--launcher {launcher!r}: use ray or local")
    allowed = (*ISOLATION_CELLS, "baseline")
    for name in cell or ():
        if name not in allowed:
            raise BadInput(f"--cell {name!r} is not one of {', '.join(allowed)}")
    return demo_mod.run(workload=workload, cells=list(cell) if cell else None, launcher=launcher,
                        num_cpus=num_cpus, state_dir=_state(state_dir),
                        matrix_base=_matrix_base(matrix_root))


def up(
    num_cpus: int = typer.Option(4, help="CPUs of the local Ray head"),
    api_port: int = typer.Option(None, help="port of the Airflow UI on 127.0.0.1 (default: a free one)"),
    state_dir: Path = typer.Option(None, help="state folder (RLK_STATE_DIR, default ./.state)"),
    matrix_root: Path = typer.Option(None, help="folder of matrix roots (RLK_MATRIX_ROOT)"),
) -> int:
    """Start the embedded stack in the background (Ray head, Airflow); `rlk down` stops it.

    Airflow runs its api-server on 127.0.0.1, a scheduler, a dag-processor and a triggerer."""
    from rl_engine.stack import services

    return services.up(_state(state_dir), _matrix_base(matrix_root), num_cpus=num_cpus,
                       api_port=api_port, out=typer.echo)


def down(
    state_dir: Path = typer.Option(None, help="state folder (RLK_STATE_DIR, default ./.state)"),
) -> int:
    """Stop what `rlk up` started, by the pids it recorded."""
    from rl_engine.stack import services

    return services.down(_state(state_dir), out=typer.echo)


def mount(app: typer.Typer) -> None:
    app.command("demo")(demo)
    app.command("up")(up)
    app.command("down")(down)
