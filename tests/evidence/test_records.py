"""Readbacks as workers write them: one file per rank and side, rewritten after every step with
that step's own counts, tagged with the run and the source commit."""

from __future__ import annotations

import json
import os

import torch

from rl_engine.artifacts import provenance
from rl_engine.evidence import layout, records
from rl_engine.runtime.plan import Plan
from rl_engine.runtime.routing import Router


def test_a_rank_record_holds_each_step_and_their_totals(tmp_path):
    run = layout.create(tmp_path / "run")
    router = Router(Plan(logp="P/R"), side="training", engine="builtin")
    router.linear("attention", torch.randn(4, 8), torch.randn(4, 8))
    router.selected_logp("logp", torch.randn(4, 8), torch.randn(32, 8), torch.arange(4))
    records.write_readback(run, router, run_id="run-1", rank=1, world_size=2, step=0)
    for _ in range(2):
        router.linear("attention", torch.randn(4, 8), torch.randn(4, 8))
    path = records.write_readback(run, router, run_id="run-1", rank=1, world_size=2, step=1)
    assert [p.name for p in run.readbacks.iterdir()] == ["builtin-training-rank1.json"]
    data = json.loads(path.read_text())
    assert data["schema_version"] == records.READBACK_SCHEMA and data["run_id"] == "run-1"
    assert (data["rank"], data["world_size"], data["pid"]) == (1, 2, os.getpid())
    assert data["source_commit"] == provenance.source()["commit"]
    steps = {s["step"]: {m["module"]: m for m in s["modules"]} for s in data["steps"]}
    assert steps[0]["attention"]["call_counts"] == {"rlkernel.det_gemm.cpu.v1": 1}
    assert steps[1]["attention"]["call_counts"] == {"rlkernel.det_gemm.cpu.v1": 2}
    assert steps[0]["logp"]["call_counts"] == {"production.torch.log_softmax": 1}
    assert steps[1]["logp"]["call_counts"] == {}
    totals = {m["module"]: m for m in data["modules"]}
    assert totals["attention"]["call_counts"] == {"rlkernel.det_gemm.cpu.v1": 3}
    assert totals["logp"]["implementation"] == "production" and totals["logp"]["case"] == "P/R"


def test_a_new_process_of_the_same_rank_keeps_the_earlier_steps(tmp_path):
    """A rank whose step ran in a fresh process (a fresh router) adds its step to the file."""
    run = layout.create(tmp_path / "run")
    for step in range(2):
        router = Router(Plan(), side="rollout", engine="builtin")
        router.rmsnorm("ffn", torch.randn(2, 8), torch.ones(8), 1e-6)
        records.write_readback(run, router, run_id="run-1", rank=0, world_size=1, step=step)
    data = json.loads(run.readback_file("builtin", "rollout", 0).read_text())
    assert [s["step"] for s in data["steps"]] == [0, 1]
    ffn = {m["module"]: m for m in data["modules"]}["ffn"]
    assert ffn["call_counts"] == {"rlkernel.rmsnorm.cpu.v1": 2}
