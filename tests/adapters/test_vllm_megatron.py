"""The two real engines against each other: `rlk run --rollout-engine vllm --trainer megatron`
(a vLLM engine of TP=1 against a Megatron-core trainer of TP=1, the embedded tiny model) with
every module R is bitwise over 2 steps with a weight sync between them, no route falling back,
and each side's evidence written from inside its own engine."""

import json

import pytest

from adapters.test_vllm_tp2 import rlk

pytestmark = pytest.mark.slow


def test_vllm_rollout_against_the_megatron_trainer_is_bitwise_over_two_steps(tmp_path):
    run_dir = tmp_path / "run"
    proc = rlk(tmp_path, "run", "--workload", "ci", "--rollout-engine", "vllm", "--trainer",
               "megatron", "--steps", "2", "--tp", "1", "--actor-gpus", "1", "--rollout-gpus", "1",
               "--rollout-gpus-per-engine", "1", "--max-response-len", "12",
               "--artifact-dir", str(run_dir), "--run-id", "vllm-megatron",
               env={"VALIDATE_ARTIFACTS": "1"})
    verdict = run_dir / "bitwise-validation.json"
    report = json.loads(verdict.read_text()) if verdict.is_file() else {}
    assert proc.returncode == 0, (report.get("problems"), proc.stderr[-3000:])
    assert report["passed"] and report["bitwise"] and report["evidence_complete"]
    assert report["numel"] == 2 * 2 * 12 and report["max_abs_diff"] == 0.0  # steps x samples x tokens
    assert report["mismatch_count"] == 0 and report["fallbacks"] == []
    names = sorted(p.name for p in (run_dir / "readbacks").glob("*.json"))
    assert names == ["megatron-training-rank0.json", "vllm-rollout-rank0.json"]
    for name in names:
        record = json.loads((run_dir / "readbacks" / name).read_text())
        assert record["run_id"] == "vllm-megatron"
        for m in record["modules"]:
            assert m["actual"] == "R" and not m["fallback"], (name, m)
            assert m["call_counts"] and all(k.startswith("rlkernel.") for k in m["call_counts"])
    w0, w1 = (json.loads((run_dir / "weights" / f"step-000{s}.json").read_text()) for s in (0, 1))
    assert w0["checksum"] != w1["checksum"] and w1["optimizer_steps"] == 2
