"""`rlk matrix run|analyze|show|history`."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rl_engine.console import console as make_console
from rich.table import Table

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="The ablation matrix: run its cells, analyze them, show the report.")
console = make_console(stderr=True)


@app.callback()
def _group() -> None:
    """The ablation matrix: run its cells, analyze them, show the report."""


def _history_root(history_root: Path | None) -> Path:
    from rl_engine import envs

    return history_root or envs.RLK_MATRIX_ROOT / "history"


@app.command("run")
def run_cmd(
    matrix_root: Path = typer.Option(None, help="the matrix root (default: a new UTC-stamped "
                                                "folder under RLK_MATRIX_ROOT)"),
    case: list[str] = typer.Option(None, help="run only this cell (cell id or module:case); "
                                              "repeatable"),
    baseline: bool = typer.Option(False, help="also run the all-P/P baseline"),
    resume: bool = typer.Option(False, help="keep each cell whose latest attempt is complete; "
                                            "run the others in a new attempt"),
    rerun_failed: bool = typer.Option(False, help="as --resume, and also rerun complete cells "
                                                  "that did not pass"),
    workload: str = typer.Option("default", help="default (the runbook's) or ci"),
    steps: int = typer.Option(None, help="post-training steps per cell"),
    tp: int = typer.Option(None), cp: int = typer.Option(None),
    actor_gpus: int = typer.Option(None), rollout_gpus: int = typer.Option(None),
    rollout_gpus_per_engine: int = typer.Option(None), rollout_batch_size: int = typer.Option(None),
    n_samples_per_prompt: int = typer.Option(None), max_response_len: int = typer.Option(None),
    max_tokens_per_gpu: int = typer.Option(None), seed: int = typer.Option(None),
    device: str = typer.Option(None, help="cpu or cuda"),
    trainer: str = typer.Option(None, help="the trainer of every cell (RLK_TRAINER): builtin or megatron"),
    rollout_engine: str = typer.Option(None, help="the rollout engine of every cell (RLK_ROLLOUT_ENGINE): "
                                                  "builtin or vllm"),
    model_root: Path = typer.Option(None, help="Qwen3 folder (MODEL_ROOT)"),
    prompt_data: Path = typer.Option(None, help="JSONL prompts (PROMPT_DATA)"),
    chat_template: bool = typer.Option(False, help="apply the tokenizer's chat template"),
    cell_timeout: float = typer.Option(None, help="seconds a cell may run before it is stopped"),
    history_root: Path = typer.Option(None, help="nightly history dataset (default: "
                                                 "RLK_MATRIX_ROOT/history)"),
    history: bool = typer.Option(True, help="append this matrix to the history"),
) -> int:
    """Run the control, then the isolation cells, each as `rlk run` in a new attempt; analyze.
    Exit 2 when a cell refused its input, else 3 when a cell's evidence is incomplete, else 1 on a
    parity failure, else 0."""
    from rl_engine.matrix import runner

    overrides = dict(steps=steps, tp=tp, cp=cp, actor_gpus=actor_gpus, rollout_gpus=rollout_gpus,
                     rollout_gpus_per_engine=rollout_gpus_per_engine,
                     rollout_batch_size=rollout_batch_size, n_samples_per_prompt=n_samples_per_prompt,
                     max_response_len=max_response_len, max_tokens_per_gpu=max_tokens_per_gpu,
                     seed=seed, device=device, trainer=trainer, rollout_engine=rollout_engine)
    m = runner.MatrixRun(root=matrix_root or runner.default_root(), cells=case or (),
                         baseline=baseline, workload=workload,
                         overrides={k: v for k, v in overrides.items() if v is not None},
                         model_root=model_root, prompt_data=prompt_data, chat_template=chat_template,
                         resume=resume, rerun_failed=rerun_failed, cell_timeout=cell_timeout)
    code, report = runner.run(m, history_root=_history_root(history_root) if history else None)
    _print_report(report)
    console.print(f"matrix root: {m.root}  exit code {code}", highlight=False)
    return code


@app.command("analyze")
def analyze_cmd(
    matrix_root: Path = typer.Option(..., help="the matrix root"),
    output: Path = typer.Option(None, help="report path (default: the report in MATRIX_ROOT); "
                                           "the Parquet tables go beside it"),
    case: list[str] = typer.Option(None, help="judge only these cells; repeatable"),
    baseline: bool = typer.Option(False, help="expect the baseline cell too"),
    history_root: Path = typer.Option(None, help="also append the report to this history dataset"),
    final: bool = typer.Option(True, "--final/--live", help="--live: a cell with no finished attempt "
                                                            "is pending (the matrix still runs)"),
) -> int:
    """Judge every cell's latest attempt; write the matrix report and its Parquet tables."""
    from rl_engine.matrix import analyze
    from rl_engine.runtime.plan import normalize_cell

    cells = [normalize_cell(c) for c in case] if case else None
    report = analyze.write_report(matrix_root, output, cells=cells, baseline=baseline, final=final)
    if history_root is not None:
        from rl_engine.matrix import history

        history.append(report, history_root)
    _print_report(report)
    return report["verdict"]["exit_code"]


@app.command("show")
def show_cmd(matrix_root: Path = typer.Argument(..., help="a matrix root or its report file")) -> int:
    """Print a matrix report."""
    from rl_engine.errors import BadInput
    from rl_engine.evidence.layout import report_path

    path = report_path(matrix_root)
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise BadInput(f"cannot read {path}: {exc}; run rlk matrix analyze first") from None
    _print_report(report)
    return report["verdict"]["exit_code"]


@app.command("history")
def history_cmd(
    history_root: Path = typer.Option(None, help="the history dataset (default: RLK_MATRIX_ROOT/history)"),
    last: int = typer.Option(30, help="show the last N matrices"),
) -> int:
    """Print one line per matrix of the nightly history, oldest first."""
    from rl_engine.matrix import history

    rows = history.summarize(history.read(_history_root(history_root)))[-last:]
    table = Table(title=f"matrix history ({len(rows)} matrices)")
    for col in ("date", "matrix", "passed", "cells passed", "control mismatches", "failed cells",
                "attributed"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["date"], r["matrix_id"], _mark(r["passed"]), f"{r['cells_passed']}/{r['cells']}",
                      str(r["control_mismatch_count"]), ", ".join(r["failed"]),
                      ", ".join(r["attributed_modules"]) or "-")
    make_console().print(table)
    return 0


def _mark(ok) -> str:
    return "[green]yes[/]" if ok else "[red]no[/]"


def _print_report(report: dict) -> None:
    v = report["verdict"]
    table = Table(title=f"matrix {report['matrix_id']}: passed={v['passed']} "
                        f"evidence_complete={v['evidence_complete']} bitwise={v['bitwise']}")
    for col in ("cell", "plan", "attempt", "older", "exit", "state", "evidence", "bitwise", "passed",
                "numel", "mismatches", "max |diff|", "first pos", "reasons"):
        table.add_column(col)
    for c in report["cells"]:
        r = c["latest"]
        plan = f"{r['plan_attention']} {r['plan_ffn']} {r['plan_logp']}"
        table.add_row(c["cell"], plan, r["attempt_id"] or "-", str(len(c["attempts"])),
                      str(r["exit_code"]), c.get("state", "-"), _mark(c["evidence_complete"]),
                      _mark(c["bitwise"]),
                      _mark(c["passed"]), str(r["numel"]), str(r["mismatch_count"]),
                      f"{r['max_abs_diff']:.3g}", str(r["first_position"]),
                      "; ".join(c["reasons"][:3]) + (" ..." if len(c["reasons"]) > 3 else ""))
    out = make_console()
    out.print(table)
    a = report.get("attribution") or {}
    if a:
        att = Table(title=f"attribution (conclusive={a.get('conclusive')}): "
                          f"{', '.join(a.get('attributed_modules') or []) or 'no module'}")
        for col in ("module", "P/P mismatch", "P/P max |diff|", "P/R max |diff|", "R/P max |diff|",
                    "first divergent"):
            att.add_column(col)
        for module, m in a.get("modules", {}).items():
            fig = {k: (m.get(k) or {}).get("max_abs_diff") for k in ("pp", "pr", "rp")}
            first = m.get("first_divergent")
            att.add_row(module, str(m.get("pp_reintroduces_mismatch")), *(
                "-" if fig[k] is None else f"{fig[k]:.3g}" for k in ("pp", "pr", "rp")),
                "-" if not first else f"step {first['step']} sample {first['sample']} "
                                      f"position {first['position']}")
        out.print(att)
        for note in a.get("notes", []):
            out.print(f"note: {note}", highlight=False)
