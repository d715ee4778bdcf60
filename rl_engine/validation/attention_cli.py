"""`rlk attention-gate`: strict attention forward and backward sharded over TP x CP x replicas must
equal the one-rank computation bit for bit, run after run, on CPU ranks or one GPU per rank."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

console = Console(stderr=True, soft_wrap=True)


def attention_gate(
    world_size: int = typer.Option(..., help="ranks: TP x CP x replicas"),
    tp: int = typer.Option(1, help="tensor parallel size: splits the heads"),
    cp: int = typer.Option(1, help="context parallel size: splits each sequence in 2*CP chunks"),
    device: str = typer.Option("cpu", help="cpu (gloo ranks) or cuda (one GPU per rank, NCCL)"),
    transport: str = typer.Option(None, help="CP exchange, comma-separated for several in one "
                                             "launch: p2p_reference (the runbooks' "
                                             "p2p_nccl_reference) or cpu_ag_rs on cpu, "
                                             "p2p_reference or cuda_ag_rs on cuda; default: both "
                                             "of the device"),
    dtype: str = typer.Option("bf16", help="bf16, fp16 or fp32"),
    seq_lens: str = typer.Option("128,200", help="packed sequence lengths, comma-separated"),
    heads: int = typer.Option(8, help="query heads"),
    kv_heads: int = typer.Option(4, help="kv heads (GQA)"),
    head_dim: int = typer.Option(None, help="default 32 on cpu, 64 on cuda (whose kernels take "
                                            "64 or 128)"),
    repeats: int = typer.Option(2, help="runs per rank that must give the same bits"),
    seed: int = typer.Option(0, help="seed of the inputs"),
    output_dir: Path = typer.Option(Path("attention-gate"), help="one JSON per topology and transport"),
) -> int:
    """Exit 0 when Out, LSE, dQ, dK and dV are bitwise equal to the one-rank computation on every
    rank and repeat, 1 when not, 2 for a topology that cannot be built or a device that cannot run
    it (no GPU, fewer GPUs than ranks, a transport of the other device), 3 when a rank failed."""
    from rl_engine.artifacts import files
    from rl_engine.errors import BadInput
    from rl_engine.validation import attention_gate as gate

    try:
        lens = tuple(int(n) for n in seq_lens.split(","))
    except ValueError:
        raise BadInput(f"--seq-lens {seq_lens!r}: give comma-separated integers") from None
    transports = None if transport is None else tuple(
        t.strip() for t in transport.split(",") if t.strip())
    cfg = gate.GateConfig(world_size=world_size, tp=tp, cp=cp, device=device, transports=transports,
                          dtype=dtype, seq_lens=lens, heads=heads, kv_heads=kv_heads,
                          head_dim=head_dim, repeats=repeats, seed=seed)
    reports = gate.run(cfg)
    passed = True
    for report in reports:
        path = files.write_json(output_dir / gate.file_name(report), report)
        _print(report, path)
        passed = passed and report["passed"]
    return 0 if passed else 1


def _print(report: dict, path: Path) -> None:
    topo = report["topology"]
    table = Table(title=f"attention parity gate on {report['device']}: world {report['world_size']} = "
                        f"TP {topo['tp']} x CP {topo['cp']} x {topo['replicas']} replicas, "
                        f"{report['transport']}, {report['dtype']}, {report['repeats']} repeats")
    for col in ("tensor", "max |diff|", "bitwise", "run to run"):
        table.add_column(col)
    for name, t in report["tensors"].items():
        table.add_row(name, repr(t["max_abs_diff"]), str(t["bitwise"]).lower(),
                      str(t["run_to_run_bitwise"]).lower())
    console.print(table)
    console.print(f"passed={report['passed']} replicas_agree={report['replicas_agree']} "
                  f"fallback={report['fallback']} core={report['core']} -> {path}", highlight=False)


def mount(app: typer.Typer) -> None:
    app.command("attention-gate")(attention_gate)
