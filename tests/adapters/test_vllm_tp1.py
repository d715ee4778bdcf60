"""vLLM at TP=1 on a Qwen3 folder written by transformers (sizes unlike the presets, a vocab that
is no multiple of the log-prob tile) against either trainer of TP=1: the built-in one and the real
Megatron-core one. With every module R each run is bitwise over 2 steps with a weight sync between
them, no route falling back, and each side's evidence written from inside its own engine."""

import json

import pytest

from adapters.test_vllm_tp2 import hf_folder, rlk

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("trainer", ["builtin", "megatron"])
def test_vllm_rollout_on_a_transformers_folder_is_bitwise_over_two_steps(tmp_path, trainer):
    folder = hf_folder(tmp_path / "qwen3")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_token_ids": ids}) + "\n"
                               for ids in ([5, 2999, 17, 400, 1234], [7, 8, 9])))
    run_dir, run_id = tmp_path / "run", f"vllm-{trainer}"
    proc = rlk(tmp_path, "run", "--workload", "ci", "--rollout-engine", "vllm", "--trainer", trainer,
               "--steps", "2", "--tp", "1", "--actor-gpus", "1", "--rollout-gpus", "1",
               "--rollout-gpus-per-engine", "1", "--rollout-batch-size", "2",
               "--max-response-len", "12", "--model-root", str(folder), "--prompt-data",
               str(prompts), "--artifact-dir", str(run_dir), "--run-id", run_id,
               env={"VALIDATE_ARTIFACTS": "1"})
    verdict = run_dir / "bitwise-validation.json"
    report = json.loads(verdict.read_text()) if verdict.is_file() else {}
    assert proc.returncode == 0, (report.get("problems"), proc.stderr[-3000:])
    assert report["passed"] and report["bitwise"] and report["evidence_complete"]
    # steps x prompts x samples x tokens
    assert report["numel"] == 2 * 2 * 2 * 12 and report["max_abs_diff"] == 0.0
    assert report["mismatch_count"] == 0 and report["fallbacks"] == []
    names = sorted(p.name for p in (run_dir / "readbacks").glob("*.json"))
    assert names == [f"{trainer}-training-rank0.json", "vllm-rollout-rank0.json"]
    for name in names:
        record = json.loads((run_dir / "readbacks" / name).read_text())
        assert record["run_id"] == run_id
        for m in record["modules"]:
            assert m["actual"] == "R" and not m["fallback"], (name, m)
            assert m["call_counts"] and all(k.startswith("rlkernel.") for k in m["call_counts"])
    w0, w1 = (json.loads((run_dir / "weights" / f"step-000{s}.json").read_text()) for s in (0, 1))
    assert w0["checksum"] != w1["checksum"] and w1["optimizer_steps"] == 2
