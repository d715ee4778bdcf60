"""`rlk run` end to end on the embedded tiny model (the ci workload: TP=2 trainer, one rollout
engine of TP=2, 2 samples x 32 tokens)."""

import json

import pytest
import torch

pytestmark = pytest.mark.slow


def test_control_is_bitwise_over_two_steps_with_weight_sync(rlk, tmp_path):
    run_dir = tmp_path / "control"
    proc = rlk("run", "--workload", "ci", "--steps", "2", "--artifact-dir", str(run_dir),
               "--run-id", "ctl-1", "--trace", env={"CI_TEST": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    for step in (0, 1):
        assert (f"step {step}: train_current_rollout_logprob_numel=64 "
                "train_current_rollout_logprob_mismatch_count=0 "
                "train_current_rollout_logprob_max_abs_diff=0.0") in proc.stdout
    report = json.loads((run_dir / "bitwise-validation.json").read_text())
    assert report["passed"] and report["bitwise"] and report["bitwise_required"]
    assert report["numel"] == 128 and [s["numel"] for s in report["per_step"]] == [64, 64]
    assert (run_dir / "exit-code").read_text().strip() == "0"
    # Weight sync: the weights changed after each step, and the rollout of step 1 ran on them.
    w0 = json.loads((run_dir / "weights" / "step-0000.json").read_text())
    w1 = json.loads((run_dir / "weights" / "step-0001.json").read_text())
    assert w0["checksum"] != w1["checksum"]
    # Evidence: both sides' readbacks of this run, R kernels counted, decode batches above 1.
    readbacks = [json.loads(p.read_text()) for p in (run_dir / "readbacks").glob("*.json")]
    sides = {r["side"] for r in readbacks}
    assert sides == {"training", "rollout"} and {r["run_id"] for r in readbacks} == {"ctl-1"}
    rollout_attn = [m for r in readbacks if r["side"] == "rollout" for m in r["modules"]
                    if m["module"] == "attention"]
    assert max(max(m["shapes"]["decode_batch"]) for m in rollout_attn) > 1
    assert all(m["call_counts"].get("rlkernel.attention.cpu.v1", 0) > 0 for m in rollout_attn)
    data = torch.load(run_dir / "train-data" / "rollout-0001.rank0.pt", weights_only=True)
    assert torch.equal(data["rollout_logprobs"], data["trainer_logprobs"]) and data["step"] == 1
    assert "[rl-engine][route] engine=builtin side=training module=ffn requested=R actual=R" in \
        (run_dir / "run.log").read_text()
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["layout"]["tp"] == 2 and manifest["inputs"]["checkpoint"]
    # The trace of every rank shows our kernels; the gate passes the control and fails the baseline.
    traces = sorted(p.name.split("-")[0] for p in (run_dir / "trace").glob("*.json"))
    assert traces == ["rollout"] * 4 + ["training"] * 4  # 2 ranks x 2 steps per side
    gate = rlk("trace", "gate", "--trace", str(run_dir / "trace"), "--plan", "control",
               "--world-size", "2", "--output", str(tmp_path / "tg.json"))
    assert gate.returncode == 0, gate.stderr[-2000:]
    assert rlk("trace", "gate", "--trace", str(run_dir / "trace"), "--plan", "baseline").returncode == 1


def test_baseline_reports_its_mismatch_and_fails_only_when_bitwise_is_required(rlk, tmp_path):
    pp = {"RL_KERNEL_ATTENTION_CASE": "P/P", "RL_KERNEL_FFN_CASE": "P/P", "RL_KERNEL_LOGP_CASE": "P/P"}
    run_dir = tmp_path / "baseline"
    proc = rlk("run", "--workload", "ci", "--artifact-dir", str(run_dir),
               env={**pp, "VALIDATE_ARTIFACTS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((run_dir / "bitwise-validation.json").read_text())
    assert report["passed"] and not report["bitwise"] and report["mismatch_count"] > 0
    assert report["first_mismatch"]["position"] >= 0
    strict = rlk("validate", str(run_dir), "--output", str(tmp_path / "v.json"), "--require-bitwise")
    assert strict.returncode == 1


def test_two_engines_of_tp2_match_a_tp2_cp2_trainer_bit_for_bit(rlk, tmp_path):
    """The runbook layout (trainer TP=2 x CP=2, two rollout engines of TP=2) on 2 prompts x 2
    samples x 64 new tokens; the readbacks show batched decode over fragmented page tables and each
    CP rank's share of the query rows."""
    run_dir = tmp_path / "layout"
    proc = rlk("run", "--rollout-batch-size", "2", "--max-response-len", "64", "--artifact-dir",
               str(run_dir), env={"CI_TEST": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("train_current_rollout_logprob_numel=256 train_current_rollout_logprob_mismatch_count=0 "
            "train_current_rollout_logprob_max_abs_diff=0.0") in proc.stdout
    readbacks = [json.loads(p.read_text()) for p in (run_dir / "readbacks").glob("*.json")]
    attention = {(r["side"], r["rank"]): next(m for m in r["modules"] if m["module"] == "attention")
                 for r in readbacks}
    assert len(attention) == 8
    rollout = [m["shapes"] for (side, _), m in attention.items() if side == "rollout"]
    assert all(max(s["decode_batch"]) > 1 and max(s["fragmented_page_tables"]) > 0 for s in rollout)
    cp_rows = {r["cp_rank"]: next(m for m in r["modules"] if m["module"] == "attention")["shapes"]
               ["cp_query_rows"] for r in readbacks if r["side"] == "training"}
    data = torch.load(run_dir / "train-data" / "rollout-0000.rank0.pt", weights_only=True)
    lengths = [int(p[-1]) + 1 for p in data["positions"]]  # prompt + response of each sample
    # Each CP rank holds two of the four load-balanced chunks of every sequence: together, all rows.
    assert sum(sum(rows) for rows in cp_rows.values()) == sum(lengths)
