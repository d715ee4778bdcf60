"""The matrix analyzer on synthetic cell folders: attribution names the module whose production
twin is batch-variant and only it; every kind of broken evidence fails its own cell with a reason
and hides no other cell; the Parquet tables hold the report's rows; show and history print them.

The cells' log-probs come from a toy three-module model run twice per cell, as the rollout runs it
(one decode batch of all samples per position) and as the trainer does (every token in one batch).
Its R implementations sum in one fixed order; its production twins in another fixed order, except
for the injected module, whose twin starts its sum at an offset that depends on the batch size.
"""

from __future__ import annotations

import json
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import torch

from rl_engine.artifacts import files, ids
from rl_engine.cli import main
from rl_engine.evidence import records
from rl_engine.evidence.layout import MatrixRoot, RunDir
from rl_engine.matrix import analyze, history, runner, tables
from rl_engine.runtime.plan import ISOLATION_CELLS, MODULES, cell_plan
from rl_engine.step.config import StepConfig
from fixtures import fake_run

D = 8
CONFIG = StepConfig.resolve("ci", tp=2, cp=1, actor_gpus=2, rollout_gpus=2, rollout_gpus_per_engine=2,
                            rollout_batch_size=1, n_samples_per_prompt=2, max_response_len=32,
                            max_tokens_per_gpu=256)
S, L = CONFIG.global_batch_size, CONFIG.max_response_len
T0 = datetime(2026, 11, 30, 3, 0, tzinfo=timezone.utc)


def weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"attention": torch.randn(D, D, generator=g) / D ** 0.5,
            "ffn": torch.randn(D, D, generator=g) / D ** 0.5,
            "logp": torch.randn(1, D, generator=g), "embed": torch.randn(S, L, D, generator=g)}


def ordered_sum(prod: torch.Tensor, order: list[int]) -> torch.Tensor:
    acc = prod[..., order[0]]
    for j in order[1:]:
        acc = acc + prod[..., j]  # elementwise: each row's bits are independent of the batch
    return acc


def stage(x: torch.Tensor, w: torch.Tensor, impl: str, batch_variant: bool) -> torch.Tensor:
    if impl == "R":
        order = list(range(D))
    elif batch_variant:
        order = [(x.shape[0] - j) % D for j in range(D)]
    else:
        order = list(reversed(range(D)))
    return ordered_sum(x[:, None, :] * w[None], order)


def forward(x, w, impls: dict[str, str], injected: str) -> torch.Tensor:
    # Only +, * and abs between the sums: torch's vectorized and scalar loops round those alike,
    # whereas transcendental functions may differ between a tensor's body and its tail.
    h = stage(x, w["attention"], impls["attention"], injected == "attention")
    h = stage(h, w["ffn"], impls["ffn"], injected == "ffn")
    return -stage(h, w["logp"], impls["logp"], injected == "logp")[:, 0].abs()


def cell_logprobs(cell: str, w, injected: str) -> tuple[torch.Tensor, torch.Tensor]:
    plan = cell_plan(cell)
    side = {s: {m: plan.impl(m, s) for m in MODULES} for s in ("training", "rollout")}
    rollout = torch.stack([forward(w["embed"][:, t], w, side["rollout"], injected)
                           for t in range(L)], dim=1)
    trainer = forward(w["embed"].reshape(S * L, D), w, side["training"], injected).reshape(S, L)
    return rollout, trainer


def add_attempt(root: Path, cell: str, rollout, trainer, *, minutes: int = 0) -> Path:
    """A finished attempt as `rlk matrix run` leaves it (matrix-case.env, then the run's files)."""
    attempt = ids.new_attempt_id(T0 + timedelta(minutes=minutes))
    folder = root / cell / attempt
    folder.mkdir(parents=True)
    mid = analyze.matrix_id(root)
    records.write_case_env(RunDir(folder), runner.case_env(mid, cell, attempt, "ci", CONFIG))
    fake_run.write_run(folder, run_id=analyze.run_id_of(mid, cell, attempt), plan=cell_plan(cell),
                       rollout=rollout, trainer=trainer, require_bitwise=cell == "control")
    return folder


def build_matrix(root: Path, injected: str, seed: int = 0) -> dict[str, Path]:
    files.write_json(MatrixRoot(root).matrix_file, {"matrix_id": root.name,
                                                  "created_at": T0.strftime("%Y-%m-%dT%H:%M:%SZ")})
    w = weights(seed)
    return {cell: add_attempt(root, cell, *cell_logprobs(cell, w, injected))
            for cell in ("control", *ISOLATION_CELLS)}


@pytest.mark.parametrize("injected", MODULES)
def test_attribution_names_the_batch_variant_module_and_only_it(tmp_path, injected):
    root = tmp_path / "matrix"
    build_matrix(root, injected)
    report = analyze.analyze(root)
    assert report["verdict"]["passed"], report["verdict"]
    attribution = report["attribution"]
    assert attribution["conclusive"] and attribution["attributed_modules"] == [injected]
    rollout, trainer = cell_logprobs(f"{injected}-PP", weights(0), injected)
    bad = ~torch.eq(rollout, trainer)
    figures = attribution["modules"][injected]
    assert figures["pp"]["mismatch_count"] == int(bad.sum()) > 0
    first_t = int(bad.any(0).nonzero()[0])
    first_s = int(bad[:, first_t].nonzero()[0])
    assert figures["first_divergent"] == {"step": 0, "sample": first_s,
                                          "position": fake_run.PROMPT_LEN + first_t}
    for module in MODULES:
        m = attribution["modules"][module]
        assert m["pp_reintroduces_mismatch"] is (module == injected)
        # Mixed cells compare two different implementations: they differ, by a measured amount.
        assert m["pr"]["mismatch_count"] > 0 and m["rp"]["mismatch_count"] > 0
        assert 0 < m["pr"]["max_abs_diff"] < 1e-3 and 0 < m["rp"]["max_abs_diff"] < 1e-3


def test_a_control_that_is_not_bitwise_fails_and_makes_attribution_inconclusive(tmp_path):
    root = tmp_path / "matrix"
    folders = build_matrix(root, "ffn")
    rollout, _ = cell_logprobs("control", weights(0), "ffn")
    add_attempt(root, "control", rollout, fake_run.perturbed(rollout, 7), minutes=5)
    report = analyze.analyze(root)
    control = next(c for c in report["cells"] if c["cell"] == "control")
    assert control["evidence_complete"] and not control["bitwise"] and not control["passed"]
    assert control["latest"]["attempt_id"] != folders["control"].name
    assert [a["attempt_id"] for a in control["attempts"]] == [folders["control"].name]
    assert report["verdict"]["exit_code"] == 1 and report["verdict"]["failed_cells"] == ["control"]
    assert not report["attribution"]["conclusive"]
    assert any("control (R/R) is not bitwise" in n for n in report["attribution"]["notes"])


def _rewrite(path: Path, **changes) -> None:
    body = json.loads(path.read_text())
    body.update(changes)
    path.write_text(json.dumps(body))


def test_broken_evidence_is_named_per_cell(tmp_path):
    root = tmp_path / "matrix"
    f = build_matrix(root, "ffn")
    (f["attention-PR"] / "readbacks" / "builtin-training-rank0.json").write_text("{not json")
    (f["ffn-PR"] / "exit-code").unlink()
    _rewrite(f["logp-PR"] / "readbacks" / "builtin-rollout-rank0.json", run_id="nightly-old-run")
    next((f["attention-RP"] / "train-data").glob("*.pt")).write_bytes(b"not a torch file")
    (RunDir(f["ffn-RP"]).case_env).unlink()
    (f["ffn-RP"] / "run.log").write_text("Traceback (most recent call last):\n  ...\n")
    killed = root / "logp-RP" / ids.new_attempt_id(T0 + timedelta(hours=1))
    killed.mkdir()
    (RunDir(killed).case_env).write_text("CELL=logp-RP\n")
    training = f["attention-PP"] / "readbacks" / "builtin-training-rank0.json"
    body = json.loads(training.read_text())
    for record in (body["modules"][1], body["steps"][0]["modules"][1]):
        record.update(fallback=True, fallback_reason="no kernel")  # ffn is R here: nobody planned it
    training.write_text(json.dumps(body))
    RunDir(f["attention-PP"]).write_exit_code(1)  # as `rlk run` exits on a fallback
    _rewrite(f["logp-PP"] / "bitwise-validation.json", mismatch_count=0, numel=999)
    for name in ("exit-code", "run.log"):  # a cell whose whole folder is gone
        (f["ffn-PP"] / name).unlink()
    (f["ffn-PP"] / "readbacks" / "builtin-rollout-rank0.json").unlink()
    (f["ffn-PP"] / "manifest.json").write_text("[]")

    report = analyze.analyze(root)
    reasons = {c["cell"]: " | ".join(c["reasons"]) for c in report["cells"]}
    assert reasons["control"] == "" and report["cells"][0]["passed"]
    assert "readback builtin-training-rank0.json is malformed" in reasons["attention-PR"]
    assert "missing readback builtin-training-rank0.json" not in reasons["attention-PR"]
    assert "no exit-code: the run did not finish" in reasons["ffn-PR"]
    assert ("readback builtin-rollout-rank0.json is of run 'nightly-old-run', not "
            f"'matrix-logp-PR-{f['logp-PR'].name}'") in reasons["logp-PR"]
    assert "train data rollout-0000.rank0.pt is malformed" in reasons["attention-RP"]
    assert "compared 0 log-probs, the workload expects 64" in reasons["attention-RP"]
    assert "no matrix-case.env" in reasons["ffn-RP"] and "run.log holds a traceback" in reasons["ffn-RP"]
    assert "no exit-code" in reasons["logp-RP"] and "no train-data files" in reasons["logp-RP"]
    assert "no manifest.json" in reasons["logp-RP"]
    logp_rp = next(c for c in report["cells"] if c["cell"] == "logp-RP")
    assert logp_rp["attempts"][0]["passed"], "the older attempt is still listed, and judged"
    assert "training ffn rank 0 fell back" in reasons["attention-PP"]
    assert "bitwise-validation.json reports numel=999" in reasons["logp-PP"]
    assert "manifest.json is malformed" in reasons["ffn-PP"]
    broken = {"attention-PR", "ffn-PR", "logp-PR", "attention-RP", "ffn-RP", "logp-RP",
              "logp-PP", "ffn-PP"}
    assert set(report["verdict"]["incomplete_cells"]) == broken
    # A fallback with otherwise complete evidence is a parity-class failure, not incomplete evidence.
    attention_pp = next(c for c in report["cells"] if c["cell"] == "attention-PP")
    assert attention_pp["evidence_complete"] and not attention_pp["passed"]
    assert set(report["verdict"]["failed_cells"]) == broken | {"attention-PP"}
    assert report["verdict"]["exit_code"] == 3
    assert [m for m, v in report["attribution"]["modules"].items()
            if v["pp_reintroduces_mismatch"] is None] == list(MODULES)


def test_an_attempt_the_analyzer_cannot_read_fails_alone(tmp_path):
    root = tmp_path / "matrix"
    f = build_matrix(root, "ffn")
    training = f["ffn-RP"] / "readbacks" / "builtin-training-rank0.json"
    body = json.loads(training.read_text())
    body["modules"][0]["call_counts"] = {"rlkernel.det_gemm.cpu.v1": "many"}
    training.write_text(json.dumps(body))
    report = analyze.write_report(root)
    failed = {c["cell"]: c["reasons"] for c in report["cells"] if not c["passed"]}
    assert failed == {"ffn-RP": ["analysis failed: ValueError: invalid literal for int() with base "
                                 "10: 'many'"]}
    assert report["attribution"]["attributed_modules"] == ["ffn"]


def test_parquet_tables_hold_the_report_rows(tmp_path):
    root = tmp_path / "matrix"
    build_matrix(root, "logp")
    rollout, trainer = cell_logprobs("logp-PP", weights(0), "logp")
    add_attempt(root, "logp-PP", rollout, trainer, minutes=9)
    report = analyze.write_report(root)
    on_disk = json.loads((MatrixRoot(root).report).read_text())
    assert on_disk["schema_version"] == analyze.REPORT_SCHEMA_VERSION
    rows = [r for c in on_disk["cells"] for r in (c["latest"], *c["attempts"])]
    assert len(rows) == 11 == on_disk["tables"]["cell_rows"]
    assert tables.read(MatrixRoot.tables_beside(MatrixRoot(root).report)[0]) == [tables.cell_record(r) for r in rows]
    tokens = tables.read(MatrixRoot.tables_beside(MatrixRoot(root).report)[1])
    assert len(tokens) == 10 * S * L == report["tables"]["token_rows"]
    mine = [t for t in tokens if t["cell"] == "logp-PP"]
    latest = next(c for c in on_disk["cells"] if c["cell"] == "logp-PP")["latest"]["attempt_id"]
    assert {t["attempt_id"] for t in mine} == {latest}
    got_ro = torch.tensor([t["rollout"] for t in mine]).reshape(S, L)
    got_tr = torch.tensor([t["trainer"] for t in mine]).reshape(S, L)
    assert torch.equal(got_ro, rollout) and torch.equal(got_tr, trainer)
    assert sum(t["rollout"] != t["trainer"] for t in mine) == latest_mismatches(on_disk, "logp-PP")


def latest_mismatches(report: dict, cell: str) -> int:
    return next(c for c in report["cells"] if c["cell"] == cell)["latest"]["mismatch_count"]


def test_analyze_show_and_history_commands(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")
    hist = tmp_path / "history"
    for n, injected in enumerate(("attention", "ffn")):
        root = tmp_path / f"nightly-{n}"
        build_matrix(root, injected, seed=n)
        assert main(["matrix", "analyze", "--matrix-root", str(root), "--history-root", str(hist)]) == 0
    assert main(["matrix", "analyze", "--matrix-root", str(root), "--history-root", str(hist)]) == 0
    capsys.readouterr()
    assert main(["matrix", "show", str(root)]) == 0
    out = capsys.readouterr().out
    assert "matrix nightly-1: passed=True" in out and "attribution (conclusive=True): ffn" in out
    assert main(["matrix", "show", str(tmp_path / "none")]) == 2
    rows = history.read(hist)
    assert len(rows) == 2 * 10, "re-analyzing a matrix replaces its history, never duplicates it"
    assert {r["date"] for r in rows} == {"2026-11-30"}  # the matrices' day, not the analysis's
    capsys.readouterr()
    assert main(["matrix", "history", "--history-root", str(hist)]) == 0
    out = capsys.readouterr().out
    assert "nightly-0" in out and "nightly-1" in out and "10/10" in out and "attention" in out
