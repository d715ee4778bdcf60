"""`rlk run --device cuda`: the ci workload on one GPU per side (TP=1, CP=1) is bitwise for the R/R
control and not for the P/P baseline; a layout needing more GPUs than visible, or a machine with
no GPU, is refused before any rank starts (exit 2). The GPU runs are skipped without a Hopper
GPU."""

import json

import pytest
import torch

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
ONE_GPU = {"TP_SIZE": "1", "CP_SIZE": "1", "ACTOR_GPUS": "1", "ROLLOUT_GPUS": "1",
           "ROLLOUT_GPUS_PER_ENGINE": "1"}
PP = {"RL_KERNEL_ATTENTION_CASE": "P/P", "RL_KERNEL_FFN_CASE": "P/P", "RL_KERNEL_LOGP_CASE": "P/P"}


def _run_ci(rlk, run_dir, env, *flags):
    """`rlk run --device cuda --workload ci` into run_dir, with env and further flags."""
    return rlk("run", "--device", "cuda", "--workload", "ci", "--artifact-dir", str(run_dir), *flags,
               env=env)


def _readbacks(run_dir):
    return [json.loads(p.read_text()) for p in (run_dir / "readbacks").glob("*.json")]


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper (sm_90) CUDA GPU")
def test_control_on_one_gpu_is_bitwise_with_sm90_kernels(rlk, tmp_path):
    run_dir = tmp_path / "control"
    proc = _run_ci(rlk, run_dir, {**ONE_GPU, "CI_TEST": "1"}, "--run-id", "cuda-ctl")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("train_current_rollout_logprob_numel=64 train_current_rollout_logprob_mismatch_count=0 "
            "train_current_rollout_logprob_max_abs_diff=0.0") in proc.stdout
    report = json.loads((run_dir / "bitwise-validation.json").read_text())
    assert report["passed"] and report["bitwise"] and report["mismatch_count"] == 0
    assert report["numel"] == 64
    readbacks = _readbacks(run_dir)
    assert {r["side"] for r in readbacks} == {"training", "rollout"}
    assert all(r["device"].startswith("cuda") for r in readbacks)
    for r in readbacks:
        for m in r["modules"]:
            assert m["actual"] == "R" and not m["fallback"]
            sm90 = [b for b, n in m["call_counts"].items() if b.endswith(".sm90.v1") and n > 0]
            cpu = [b for b in m["call_counts"] if b.endswith(".cpu.v1")]
            assert sm90 and not cpu, (r["side"], m["module"], m["call_counts"])
    data = torch.load(run_dir / "train-data" / "rollout-0000.rank0.pt", weights_only=True)
    assert not data["rollout_logprobs"].is_cuda
    assert torch.equal(data["rollout_logprobs"], data["trainer_logprobs"])
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["layout"]["device"] == "cuda"


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper (sm_90) CUDA GPU")
def test_baseline_on_one_gpu_reports_a_mismatch(rlk, tmp_path):
    run_dir = tmp_path / "baseline"
    proc = _run_ci(rlk, run_dir, {**ONE_GPU, **PP, "VALIDATE_ARTIFACTS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((run_dir / "bitwise-validation.json").read_text())
    assert report["evidence_complete"] and report["mismatch_count"] > 0 and not report["bitwise"]
    assert all(m["actual"] == "P" for r in _readbacks(run_dir) for m in r["modules"])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_more_ranks_than_gpus_is_refused_before_any_rank_starts(rlk, tmp_path):
    gpus = torch.cuda.device_count()
    world = gpus + 1  # DP = world replicas of TP=1, CP=1, one sample each
    layout = {"TP_SIZE": "1", "CP_SIZE": "1", "ACTOR_GPUS": str(world), "ROLLOUT_GPUS": "1",
              "ROLLOUT_GPUS_PER_ENGINE": "1", "N_SAMPLES_PER_PROMPT": str(world)}
    run_dir = tmp_path / "too-many"
    proc = _run_ci(rlk, run_dir, layout)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"world {world} needs {world} GPUs, {gpus} visible" in proc.stderr
    assert not list(run_dir.rglob("*.json"))  # refused before the manifest and any readback


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a CUDA GPU")
def test_cuda_run_without_a_gpu_exits_2_naming_the_fix(rlk, tmp_path):
    proc = _run_ci(rlk, tmp_path / "no-gpu", ONE_GPU)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "no CUDA device is visible; use --device cpu" in proc.stderr
    assert not (tmp_path / "no-gpu").exists()  # refused before the run directory is made


def test_launch_refuses_a_cuda_world_larger_than_the_gpus():
    from rl_engine.engines.launch import launch

    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    want = (f"world {visible + 1} needs {visible + 1} GPUs, {visible} visible; lower TP/CP or use "
            "more GPUs") if visible else "no CUDA device is visible; use --device cpu"
    with pytest.raises(ValueError, match=want):
        launch(print, visible + 1, device="cuda")
    with pytest.raises(ValueError, match="device 'tpu'"):
        launch(print, 1, device="tpu")


HOPPER2 = HOPPER and torch.cuda.device_count() >= 2


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.skipif(not HOPPER2, reason="needs two Hopper (sm_90) CUDA GPUs")
def test_control_at_tp2_is_bitwise_over_the_ipc_collectives(rlk, tmp_path):
    run_dir = tmp_path / "tp2"
    proc = _run_ci(rlk, run_dir, {"TP_SIZE": "2", "CP_SIZE": "1", "ACTOR_GPUS": "2",
                                  "ROLLOUT_GPUS": "2", "ROLLOUT_GPUS_PER_ENGINE": "2", "CI_TEST": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((run_dir / "bitwise-validation.json").read_text())
    assert report["passed"] and report["bitwise"] and report["mismatch_count"] == 0
    for r in _readbacks(run_dir):
        assert r["collective_transport"] == {"communication_backend": "cuda_ag_rs",
                                             "fallback_allowed": False, "fallback": False}
        assert not [k for k in r["collective_calls"] if k.startswith("production.")]


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.skipif(not HOPPER2, reason="needs two Hopper (sm_90) CUDA GPUs")
def test_rollout_on_its_own_gpu_is_bitwise(rlk, tmp_path):
    run_dir = tmp_path / "separate"
    proc = _run_ci(rlk, run_dir, {**ONE_GPU, "CI_TEST": "1"}, "--no-colocate")
    assert proc.returncode == 0, proc.stderr[-3000:]
    devices = {r["side"]: r["device"] for r in _readbacks(run_dir)}
    assert devices == {"training": "cuda:0", "rollout": "cuda:1"}
