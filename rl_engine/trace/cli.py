"""`rlk trace gate`: check a run's traced kernel launches against its plan, in all and inside each
module's `rlk.<module>` ranges (rl_engine/trace/gate.py says what is required and forbidden)."""

from __future__ import annotations

from pathlib import Path

import typer
from rl_engine.console import console as make_console
from rich.table import Table

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="Check traced kernel launches against an operator plan.")
console = make_console(stderr=True)


@app.callback()
def _group() -> None:
    """Check traced kernel launches against an operator plan."""


@app.command("gate")
def gate_cmd(
    trace: list[Path] = typer.Option(..., help="Chrome trace (.json, .json.gz), Nsight Systems "
                                               "SQLite export, or a folder of them; repeatable"),
    plan: str = typer.Option("control", help="control, baseline, a cell id or module:case"),
    device: str = typer.Option("cpu", help="cpu (rl_engine:: op events) or cuda (kernels)"),
    world_size: int = typer.Option(1, help="ranks of the traced group; >1 requires the "
                                           "fixed-order collectives under an all-R plan"),
    tp: int = typer.Option(1, help="tensor-parallel size of the traced layout: the all-reduce "
                                   "is required when tp > 1, the gradient sync's reduce-scatter "
                                   "when world-size / tp > 1"),
    side: str = typer.Option("both", help="training, rollout or both: the sides to judge; a file "
                                          "named for another side (training-*, rollout-*) is "
                                          "left out"),
    output: Path = typer.Option(None, help="where to write trace-gate.json"),
) -> int:
    """Count launches by kernel family, in all and inside each module's ranges; exit 0 when the
    plan's families ran and none it forbids (no production family inside the range of a module
    that is R on that side, no rl_engine family inside that of a P one), 1 when they did not, 2
    for an unreadable trace, 3 for a trace with no events or an R module with no range."""
    from rl_engine.artifacts import files
    from rl_engine.errors import BadInput
    from rl_engine.runtime.plan import SIDES
    from rl_engine.trace import gate

    if device not in ("cpu", "cuda"):
        raise BadInput(f"device {device!r}: use cpu or cuda")
    if side not in (*SIDES, "both"):
        raise BadInput(f"side {side!r}: use training, rollout or both")
    if world_size < 1:
        raise BadInput(f"--world-size {world_size} must be at least 1")
    sides = SIDES if side == "both" else (side,)
    counts = gate.count(trace, device, sides)
    report = gate.gate(counts, plan, device=device, world_size=world_size, sides=sides, tp=tp)
    report["trace_files"] = [str(p) for p in gate.trace_files(trace)]
    if output is not None:
        files.write_json(output, report)
    table = Table(title=f"trace check: plan {report['cell']} on {device}, world {world_size}, "
                        f"sides {', '.join(sides)}")
    for col in ("family", "want", "launches", "ok"):
        table.add_column(col)
    for c in report["checks"]:
        table.add_row(c["family"], c["want"], str(c["count"]), "ok" if c["ok"] else "FAIL")
    console.print(table)
    ranged = Table(title="inside rlk.<module> ranges")
    for col in ("module", "side", "plan", "ranges", "forbidden launches"):
        ranged.add_column(col)
    for row in report["modules"]:
        ranged.add_row(row["module"], row["side"], row["impl"], str(row["ranges"]),
                       ", ".join(f"{f} {n}" for f, n in row["forbidden"].items()) or "none")
    if report["modules"]:
        console.print(ranged)
    for note in report["notes"]:
        console.print(f"note: {note}", highlight=False)
    for p in report["problems"]:
        console.print(f"[red]problem[/] {p}", highlight=False)
    console.print(f"passed={report['passed']} events={report['events']}", highlight=False)
    return gate.exit_code(report)
