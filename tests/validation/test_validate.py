import json

import pytest
import torch

from rl_engine.artifacts import files
from rl_engine.runtime.plan import Plan
from rl_engine.validation.validate import exit_code, validate


def _module(name, impl, fallback=False):
    backend = "rlkernel.det_gemm.cpu.v1" if impl == "R" else "production.torch.linear"
    return {"module": name, "case": "R/R", "requested": impl, "actual": impl,
            "implementation": "rlkernel" if impl == "R" else "production",
            "call_counts": {backend: 3}, "fallback": fallback,
            "fallback_reason": "no kernel" if fallback else None}


def _evidence(root, *, plan=Plan(), run_id="run-a", rollout=None, trainer=None, foreign=False,
              fallback=False):
    for side, pid in (("training", 11), ("rollout", 22)):
        mods = [_module(m, plan.impl(m, side), fallback and side == "rollout") for m in ("attention", "ffn", "logp")]
        files.write_json(root / "readbacks" / f"builtin-{side}-{pid}.json",
                         {"run_id": "other-run" if foreign and side == "rollout" else run_id,
                          "side": side, "pid": pid, "plan": plan.as_dict(), "modules": mods,
                          "source_commit": "abc"})
    ro = rollout if rollout is not None else torch.full((2, 4), -1.5)
    tr = trainer if trainer is not None else ro.clone()
    (root / "train-data").mkdir(parents=True, exist_ok=True)
    files.write_torch(root / "train-data" / "rollout-0000.rank0.pt",
                      {"run_id": run_id, "step": 0, "sample_ids": torch.arange(2),
                       "positions": torch.arange(4).repeat(2, 1) + 7,
                       "rollout_logprobs": ro, "trainer_logprobs": tr})
    return root / "readbacks", root / "train-data"


def test_bitwise_equal_complete_evidence_passes(tmp_path):
    report = validate(*_evidence(tmp_path), run_id="run-a", plan=Plan(), expected_numel=8)
    assert report["passed"] and report["bitwise"] and report["evidence_complete"]
    assert report["bitwise_required"] and report["numel"] == 8 and report["max_abs_diff"] == 0.0
    assert set(report["sides"]["training"]["modules"]) == {"attention", "ffn", "logp"}
    assert exit_code(report) == 0


def test_a_mismatch_names_the_first_divergent_token(tmp_path):
    tr = torch.full((2, 4), -1.5)
    tr[1, 2] = -1.25
    report = validate(*_evidence(tmp_path, trainer=tr), run_id="run-a", plan=Plan(), expected_numel=8)
    assert not report["passed"] and report["mismatch_count"] == 1 and report["max_abs_diff"] == 0.25
    assert report["first_mismatch"] == {"step": 0, "sample": 1, "position": 9, "rollout": -1.5,
                                        "trainer": -1.25}
    assert exit_code(report) == 1


def test_the_baseline_passes_unless_bitwise_is_required(tmp_path):
    plan = Plan(attention="P/P", ffn="P/P", logp="P/P")
    ev = _evidence(tmp_path, plan=plan, trainer=torch.full((2, 4), -1.0))
    report = validate(*ev, run_id="run-a", plan=plan, expected_numel=8)
    assert report["passed"] and not report["bitwise"] and not report["bitwise_required"]
    strict = validate(*ev, run_id="run-a", plan=plan, expected_numel=8, require_bitwise=True)
    assert not strict["passed"] and exit_code(strict) == 1


def test_a_readback_of_another_run_makes_the_evidence_incomplete(tmp_path):
    report = validate(*_evidence(tmp_path, foreign=True), run_id="run-a", plan=Plan(), expected_numel=8)
    assert not report["evidence_complete"] and not report["passed"]
    assert any("of run 'other-run', not 'run-a'" in p for p in report["problems"])
    assert exit_code(report) == 3


def test_missing_side_wrong_numel_and_corrupt_files_are_named(tmp_path):
    rb, td = _evidence(tmp_path)
    (rb / "builtin-rollout-22.json").unlink()
    (td / "rollout-0001.rank0.pt").write_bytes(b"not a torch file")
    report = validate(rb, td, run_id="run-a", plan=Plan(), expected_numel=16)
    text = "\n".join(report["problems"])
    assert "no rollout readback" in text and "rollout-0001.rank0.pt is unreadable" in text
    assert "compared 8 log-probs, the workload expects 16" in text
    assert exit_code(report) == 3


def test_an_audit_fallback_can_never_pass(tmp_path):
    report = validate(*_evidence(tmp_path, fallback=True), run_id="run-a", plan=Plan(), expected_numel=8)
    assert report["bitwise"] and not report["passed"]
    assert report["fallback_failures"][0]["side"] == "rollout"


def test_cli_validate_writes_the_report_and_exits_by_contract(tmp_path):
    from rl_engine.cli import main

    rb, td = _evidence(tmp_path, trainer=torch.full((2, 4), -1.0))
    out = tmp_path / "bitwise-validation.json"
    assert main(["validate", "--readback-dir", str(rb), "--train-data-dir", str(td),
                 "--output", str(out), "--run-id", "run-a"]) == 1
    assert json.loads(out.read_text())["schema_version"] == 1
