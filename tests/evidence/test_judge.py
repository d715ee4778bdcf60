"""The judge on synthetic run directories: each completeness rule fails with the file or value named,
equality is bit equality, a non-finite log-prob fails the run, and a fallback is exit 1."""

from __future__ import annotations

import json

import pytest
import torch

from rl_engine.cli import main
from rl_engine.evidence import judge, layout
from rl_engine.runtime.plan import SIDES, Plan
from fixtures import fake_run

RUN_ID = "run-a"


def make_run(tmp_path, *, plan=Plan(), rollout=None, trainer=None, training_ranks=2,
             rollout_ranks=2, steps=1) -> layout.RunDir:
    """A finished-looking run of 2 samples x 4 tokens per step, one readback per rank."""
    run = layout.create(tmp_path / "run")
    ro = rollout if rollout is not None else torch.full((2, 4), -1.5)
    tr = trainer if trainer is not None else ro.clone()
    fake_run.write_manifest(run, run_id=RUN_ID, plan=plan, numel=ro.numel() * steps, steps=steps,
                            training_ranks=training_ranks, rollout_ranks=rollout_ranks)
    for side, world in zip(SIDES, (training_ranks, rollout_ranks)):
        for rank in range(world):
            fake_run.write_readback(run, run_id=RUN_ID, plan=plan, side=side, rank=rank,
                                    world_size=world, steps=steps)
    for step in range(steps):
        fake_run.write_train_data(run, run_id=RUN_ID, rollout=ro, trainer=tr, step=step)
    return run


def verdict(run, **kwargs) -> judge.Verdict:
    return judge.judge(run, expect=judge.Expect(run_id=RUN_ID), **kwargs)


def rewrite(path, **changes) -> None:
    body = json.loads(path.read_text())
    body.update(changes)
    path.write_text(json.dumps(body))


def test_complete_bitwise_evidence_of_every_rank_passes(tmp_path):
    v = verdict(make_run(tmp_path, steps=2))
    assert v.passed and v.bitwise and v.evidence_complete and v.bitwise_required, v.problems
    assert v.exit_code == 0 and v.numel == 16 and v.max_abs_diff == 0.0 and v.nonfinite_count == 0
    assert v.sides["training"]["ranks"] == [0, 1] and v.sides["rollout"]["ranks"] == [0, 1]
    assert [s["step"] for s in v.per_step] == [0, 1]


def test_a_missing_rank_is_named(tmp_path):
    run = make_run(tmp_path)
    run.readback_file("builtin", "rollout", 1).unlink()
    v = verdict(run)
    assert not v.evidence_complete and v.exit_code == 3
    assert "missing readback builtin-rollout-rank1.json (rank 1 of 2 on the rollout side)" in v.problems


def test_an_extra_record_is_named(tmp_path):
    run = make_run(tmp_path)
    fake_run.write_readback(run, run_id=RUN_ID, plan=Plan(), side="training", rank=2, world_size=2)
    v = verdict(run)
    assert not v.evidence_complete
    assert any(p.startswith("extra readback builtin-training-rank2.json") for p in v.problems)


def test_a_record_of_another_run_or_commit_or_world_is_named(tmp_path):
    run = make_run(tmp_path)
    rewrite(run.readback_file("builtin", "training", 0), run_id="nightly-old-run")
    rewrite(run.readback_file("builtin", "rollout", 0), source_commit="f" * 40)
    rewrite(run.readback_file("builtin", "rollout", 1), world_size=4)
    text = "\n".join(verdict(run).problems)
    assert "readback builtin-training-rank0.json is of run 'nightly-old-run', not 'run-a'" in text
    assert f"readback builtin-rollout-rank0.json is of source commit '{'f' * 40}'" in text
    assert "readback builtin-rollout-rank1.json says world_size=4, expected 2" in text


def test_a_rank_missing_a_step_or_a_route_is_named(tmp_path):
    run = make_run(tmp_path, steps=2)
    path = run.readback_file("builtin", "training", 1)
    body = json.loads(path.read_text())
    body["steps"] = body["steps"][:1]
    path.write_text(json.dumps(body))
    path = run.readback_file("builtin", "rollout", 0)
    body = json.loads(path.read_text())
    body["steps"][1]["modules"][0]["call_counts"] = {"rlkernel.det_gemm.cpu.v1": 3}
    path.write_text(json.dumps(body))
    text = "\n".join(verdict(run).problems)
    assert "readback builtin-training-rank1.json has no record of step(s) [1] of 2" in text
    assert ("readback builtin-rollout-rank0.json step 1 rollout attention: no launches of rmsnorm, "
            "rope, attention") in text


def test_a_malformed_record_is_named_and_not_also_called_missing(tmp_path):
    run = make_run(tmp_path)
    run.readback_file("builtin", "training", 0).write_text("{not json")
    problems = verdict(run).problems
    assert any(p.startswith("readback builtin-training-rank0.json is malformed") for p in problems)
    assert not any("missing readback builtin-training-rank0.json" in p for p in problems)


def test_negative_zero_differs_from_zero(tmp_path):
    ro = torch.full((2, 4), -1.5)
    ro[0, 0] = 0.0
    tr = ro.clone()
    tr[0, 0] = -0.0
    v = verdict(make_run(tmp_path, rollout=ro, trainer=tr))
    assert v.evidence_complete and not v.bitwise and not v.passed and v.exit_code == 1
    assert v.mismatch_count == 1 and v.max_abs_diff == 0.0
    assert v.first_mismatch == {"step": 0, "sample": 0, "position": fake_run.PROMPT_LEN,
                                "rollout": 0.0, "trainer": -0.0}


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_log_prob_fails_even_with_equal_bits(tmp_path, value):
    ro = torch.full((2, 4), -1.5)
    ro[1, 3] = value
    tr = ro.clone()
    tr[0, 0] = -1.25
    plan = Plan(attention="P/P", ffn="P/P", logp="P/P")  # bitwise not required: only NaN fails it
    v = verdict(make_run(tmp_path, plan=plan, rollout=ro, trainer=tr))
    assert v.evidence_complete and not v.passed and v.exit_code == 1
    assert v.nonfinite_count == 1 and v.mismatch_count == 1
    assert v.max_abs_diff == 0.25, "max |diff| is over the finite pairs, the NaN does not hide it"


def test_a_fallback_is_a_parity_failure_not_incomplete_evidence(tmp_path):
    run = make_run(tmp_path)
    path = run.readback_file("builtin", "rollout", 1)
    body = json.loads(path.read_text())
    for record in (body["modules"][2], body["steps"][0]["modules"][2]):
        record.update(actual="P", implementation="production", fallback=True,
                      fallback_reason="no linear_logp kernel", call_counts={"production.x": 1})
    path.write_text(json.dumps(body))
    v = verdict(run)
    assert v.evidence_complete and v.bitwise and not v.passed and v.exit_code == 1
    assert v.fallbacks == [{"side": "rollout", "module": "logp", "rank": 1,
                            "reason": "no linear_logp kernel"}]


def test_the_baseline_passes_unless_bitwise_is_required(tmp_path):
    plan = Plan(attention="P/P", ffn="P/P", logp="P/P")
    run = make_run(tmp_path, plan=plan, trainer=torch.full((2, 4), -1.0))
    assert verdict(run).passed and not verdict(run).bitwise
    strict = verdict(run, require_bitwise=True)
    assert not strict.passed and strict.exit_code == 1


def test_stale_train_data_and_wrong_numel_are_named(tmp_path):
    run = make_run(tmp_path)
    fake_run.write_train_data(run, run_id="other-run", rollout=torch.zeros(2, 4),
                              trainer=torch.zeros(2, 4), step=0)
    (run.train_data / "stray.pt").write_bytes(b"x")
    text = "\n".join(verdict(run).problems)
    assert "train data rollout-0000.rank0.pt is of run 'other-run', not 'run-a'" in text
    assert "train data stray.pt is not named <rollout-id>.rank<r>.pt" in text
    assert "compared 0 log-probs, the workload expects 8" in text


def test_cli_validate_writes_the_verdict_and_exits_by_contract(tmp_path, capsys):
    run = make_run(tmp_path, trainer=torch.full((2, 4), -1.0))
    out = tmp_path / "verdict.json"
    assert main(["validate", str(run.root), "--output", str(out)]) == 1
    body = json.loads(out.read_text())
    assert body["schema_version"] == 1 and body["kind"] == "rlk.verdict"
    assert body["mismatch_count"] == 8 and body["run_id"] == RUN_ID and "tokens" not in body
    assert main(["validate", str(tmp_path / "nowhere")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_an_all_production_side_that_launched_our_kernels_is_named(tmp_path):
    """What the clean-room gate's production run relies on: under P/P a record whose process
    launched an rl_engine kernel, or whose module ran R, contradicts the plan."""
    plan = Plan(attention="P/P", ffn="P/P", logp="P/P")
    run = make_run(tmp_path, plan=plan)
    rewrite(run.readback_file("builtin", "rollout", 0),
            kernel_totals={"rlkernel.rmsnorm.cpu.v1:rmsnorm": 3})
    path = run.readback_file("builtin", "training", 1)
    body = json.loads(path.read_text())
    body["steps"][0]["modules"][1].update(actual="R", implementation="rlkernel")
    path.write_text(json.dumps(body))
    text = "\n".join(verdict(run).problems)
    assert ("readback builtin-rollout-rank0.json: every module of the rollout side is P, yet it "
            "launched rl_engine kernels ['rlkernel.rmsnorm.cpu.v1:rmsnorm']") in text
    assert "readback builtin-training-rank1.json step 0 training ffn: requested P (production), ran R" in text
